"""``python -m kvbench.store verify [--results DIR] [--clean]``: find incomplete, orphaned and inconsistent jobs.

Every job directory ``runs/<4 parts>/<hash12>/`` is classified:

* ``finished``: scores.json present and consistent with its records;
* ``running``: another process holds its lock;
* ``incomplete``: records but no scores (a kill; rerunning the job resumes it) — and ``torn`` when its last record
  line is cut (the next run repairs it; ``--clean`` repairs it now);
* ``failed``: a ``failed.json`` written by a sweep (its cause is shown);
* ``inconsistent``: config.yaml missing or unreadable, its key hashing to another directory name, duplicate or
  unparseable record lines, scores.json whose sample count differs from the unique records, or a finished job whose
  scores.json disagrees with its records: the task's aggregate and the efficiency means are recomputed from
  samples.jsonl as the job runner computes them (``kvbench.store.scores``) and every number is compared
  (relative tolerance 1e-9), so a hand-edited score is named with both values. A job whose task cannot be rebuilt
  here (a task module not installed, its data elsewhere) or whose task version changed since gets a note instead;
* ``uncompressed``: a job of a compressing method whose records show it never compressed (the transformers 5.24
  keyword rename ran every method as FullKV under its own name; ``kvbench.store.compression``); the line names the
  transformers version of meta.json. Rerun it (delete the directory first: its records would be resumed);
* ``orphaned``: no config.yaml and no records (a job that died before it started), or leftover temp files of an
  atomic write.

``--clean`` removes orphaned directories and temp files, repairs torn lines and moves complete lines that are not
records to ``samples.corrupt.jsonl`` (the next run redoes their samples); it never deletes records or scores
(inconsistent and uncompressed jobs are reported for a human to decide). Exit code 0 when nothing is wrong, 1
otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbench.store import config_hash, ids_digest, load_yaml, lock_is_held
from kvbench.store.compression import uncompressed_reason

STATES = ("finished", "running", "incomplete", "failed", "uncompressed", "inconsistent", "orphaned")
#: states a human has to act on (exit code 1)
WRONG = ("inconsistent", "orphaned", "failed", "uncompressed")
#: scores.json and a recomputation from the same records agree to this relative tolerance
SCORE_RTOL = 1e-9


@dataclass
class JobReport:
    path: Path
    state: str
    problems: list[str] = field(default_factory=list)
    records: int = 0
    torn: bool = False
    temp_files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked here; not a problem
    corrupt_lines: list[int] = field(default_factory=list)  # complete samples.jsonl lines that are not records


def inspect(path: Path) -> JobReport:
    report = JobReport(path, "finished")
    report.temp_files = sorted(p for p in path.iterdir() if p.name.startswith(".") and p.name != ".lock")
    if report.temp_files:
        report.problems.append(f"{len(report.temp_files)} leftover temp file(s)")
    samples = path / "samples.jsonl"
    ids: list[str] = []
    records: list[dict[str, Any]] = []
    if samples.exists():
        data = samples.read_bytes()
        good_end = data.rfind(b"\n") + 1
        report.torn = good_end < len(data)
        for number, line in enumerate(data[:good_end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids.append(str(record["id"]))
            except (ValueError, KeyError, TypeError):
                report.problems.append(f"samples.jsonl line {number} is not a record")
                report.corrupt_lines.append(number)
                continue
            records.append(record)
        duplicates = [i for i, c in Counter(ids).items() if c > 1]
        if duplicates:
            report.problems.append(f"duplicate records: {', '.join(duplicates[:5])}")
    report.records = len(set(ids))
    config = path / "config.yaml"
    stored_config: dict[str, Any] = {}
    if not config.exists():
        if not ids and not (path / "scores.json").exists():
            report.state = "orphaned"
            report.problems.append("no config.yaml and no records")
            return report
        report.problems.append("config.yaml is missing")
    else:
        try:
            stored_config = load_yaml(config.read_text())
            key = stored_config["key"]
            if config_hash(key)[:12] != path.name:
                report.problems.append(f"config key hashes to {config_hash(key)[:12]}, not {path.name}")
        except (yaml.YAMLError, KeyError, TypeError) as exc:
            report.problems.append(f"config.yaml unreadable ({type(exc).__name__})")
    scores_path = path / "scores.json"
    scores = None
    if scores_path.exists():
        try:
            scores = json.loads(scores_path.read_text())
        except ValueError:
            report.problems.append("scores.json is not JSON")
    if scores is not None and scores.get("n_samples") is not None and scores["n_samples"] > report.records:
        report.problems.append(f"scores.json counts {scores['n_samples']} samples, records hold {report.records}")
    structural = [p for p in report.problems if "temp file" not in p]
    if structural:
        report.state = "inconsistent"
    elif lock_is_held(path / ".lock"):  # (no write access needed: open_lock_for_probe)
        report.state = "running"
    elif (path / "failed.json").exists() and scores is None:
        report.state = "failed"
        try:
            cause = json.loads((path / "failed.json").read_text())
            error = cause.get("error") or f"{cause.get('type', '?')}: {cause.get('message', '')}"
            report.problems.append(f"failed ({cause.get('kind', 'exception')}): {str(error)[:120]}")
        except ValueError:
            report.problems.append("failed (failed.json unreadable)")
    elif scores is None:
        report.state = "incomplete"
    elif scores.get("n_failed"):
        report.state = "failed"
        report.problems.append(f"{scores['n_failed']} sample(s) failed (errors.jsonl); a rerun retries them")
    if report.state in ("finished", "incomplete", "failed"):
        reason = uncompressed_reason(_read_meta(path), records)
        if reason is not None:
            report.state = "uncompressed"
            report.problems.append(f"{reason}; delete the job directory and run it again (a rerun in place keeps "
                                   "these records)")
    if report.state == "finished":
        check_scores(report, stored_config, scores, records)
    if report.torn and report.state != "running":
        report.problems.append("torn last record line")
    return report


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def check_scores(report: JobReport, config: dict[str, Any], scores: dict[str, Any], records: list[dict]) -> None:
    """Recompute scores.json's numbers from the records the way the job runner does (``kvbench.jobs``); a job whose
    scores.json says otherwise (edited by hand, or written from other records) becomes ``inconsistent``, naming each
    number."""
    from kvbench.store.scores import record_scores
    from kvbench.tasks import build_task

    scored = scored_records(records, scores)
    if scored is None:
        report.notes.append(f"scores.json counts {scores.get('n_samples')} samples and its sample digest matches no "
                            f"prefix of the {len(records)} records: scores not recomputed")
        return
    resolved_task = (config.get("resolved") or {}).get("task") or {}
    # data_dir says where the data was, not what was scored (the key leaves it out): scoring needs no data here
    task_cfg = {k: v for k, v in resolved_task.items() if k != "data_dir"}
    try:
        task = build_task(task_cfg)
    except Exception as exc:  # a task module not installed here, a field it no longer has: nothing to compare with
        report.notes.append(f"task {task_cfg.get('name', '?')!r} cannot be rebuilt here "
                            f"({type(exc).__name__}: {str(exc)[:100]}): scores not recomputed")
        return
    if scores.get("task_version") not in (None, task.version):
        report.notes.append(f"task version {scores['task_version']!r} was scored, this kvbench has {task.version!r}: "
                            "scores not recomputed")
        return
    try:
        expected = record_scores(task, scored)
    except Exception as exc:  # records without a field the aggregate reads (an older format), data not here
        report.notes.append(f"scores not recomputed ({type(exc).__name__}: {str(exc)[:100]})")
        return
    differences = disagreements(expected, scores)
    if differences:
        report.state = "inconsistent"
        shown = "; ".join(differences[:4]) + (f"; {len(differences) - 4} more" if len(differences) > 4 else "")
        report.problems.append(f"scores.json disagrees with its records: {shown}")


def scored_records(records: list[dict], scores: dict[str, Any]) -> list[dict] | None:
    """The records scores.json was computed from: all of them, or the first ``n_samples`` when a later run with a
    smaller ``limit`` scored fewer than the file holds (the digest of its planned ids then matches them); None when
    neither fits (the limit is not part of the job's key, so one directory can hold both runs' records)."""
    n = scores.get("n_samples")
    if n == len(records):
        return records
    if isinstance(n, int) and 0 <= n < len(records):
        if ids_digest([str(r["id"]) for r in records[:n]]) == scores.get("sample_ids_digest"):
            return records[:n]
    return None


def disagreements(expected: Any, stored: Any, name: str = "") -> list[str]:
    """Every number of ``expected`` (nested in dicts and lists) that ``stored`` holds differently: ``key: scores.json
    has X, the records give Y``. Keys scores.json lacks (an older kvbench wrote it) and non-numbers are skipped."""
    if isinstance(expected, dict):
        if not isinstance(stored, dict):
            return [f"{name}: scores.json has {stored!r:.60}, the records give a mapping"]
        return [d for key, value in expected.items() if key in stored
                for d in disagreements(value, stored[key], f"{name}.{key}" if name else str(key))]
    if isinstance(expected, (list, tuple)):
        if not isinstance(stored, list) or len(stored) != len(expected):
            return [f"{name}: scores.json has {stored!r:.60}, the records give {list(expected)!r:.60}"]
        return [d for i, (value, held) in enumerate(zip(expected, stored)) for d in disagreements(value, held,
                                                                                                 f"{name}[{i}]")]
    if not _is_number(expected) or (_is_number(stored) and _same_number(expected, stored)):
        return []
    return [f"{name}: scores.json has {stored!r}, the records give {expected!r}"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_number(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)  # an empty bucket is nan in both
    return math.isclose(a, b, rel_tol=SCORE_RTOL, abs_tol=0.0)


def job_dirs(results_dir: Path) -> list[Path]:
    runs = results_dir / "runs"
    if not runs.is_dir():
        return []
    return sorted(p for p in runs.glob("*/*/*/*/*") if p.is_dir())


def clean(report: JobReport) -> list[str]:
    """Safe repairs only; returns what was done."""
    done = []
    if report.state == "running":
        return done
    for temp in report.temp_files:
        temp.unlink(missing_ok=True)
        done.append(f"removed {temp.name}")
    if report.state == "orphaned":
        shutil.rmtree(report.path)
        done.append("removed the orphaned directory")
        return done
    if report.corrupt_lines:
        done.append(_set_aside_corrupt_lines(report))
    if report.torn:
        samples = report.path / "samples.jsonl"
        data = samples.read_bytes()
        with open(samples, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)
            fh.flush()
            os.fsync(fh.fileno())
        done.append("cut the torn last line")
    return done


def _set_aside_corrupt_lines(report: JobReport) -> str:
    """Move complete lines that are not records from samples.jsonl to samples.corrupt.jsonl (appended, never
    deleted); the job's next run redoes their samples. The torn last line, if any, stays for the torn repair."""
    samples = report.path / "samples.jsonl"
    data = samples.read_bytes()
    good_end = data.rfind(b"\n") + 1
    lines = data[:good_end].splitlines(keepends=True)
    bad = set(report.corrupt_lines)
    aside = b"".join(line for n, line in enumerate(lines, 1) if n in bad)
    with open(report.path / "samples.corrupt.jsonl", "ab") as fh:
        fh.write(aside)
        fh.flush()
        os.fsync(fh.fileno())
    kept = b"".join(line for n, line in enumerate(lines, 1) if n not in bad) + data[good_end:]
    tmp = samples.with_name(".samples.jsonl.clean")
    with open(tmp, "wb") as fh:  # bytes as they were: a record's text is never re-encoded
        fh.write(kept)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, samples)
    report.problems = [p for p in report.problems if "is not a record" not in p]
    if report.state == "inconsistent" and not [p for p in report.problems if "temp file" not in p]:
        report.state = "incomplete"
    shown = ", ".join(str(n) for n in sorted(bad))
    return f"moved line(s) {shown} (not records) to samples.corrupt.jsonl; the next run redoes their samples"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbench.store", description="Result store maintenance.")
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="report incomplete, orphaned and inconsistent job directories")
    verify.add_argument("--results", type=Path, default=None, help="results dir (default: KVBENCH_RESULTS_DIR or "
                        "the checkout's results/)")
    verify.add_argument("--clean", action="store_true", help="remove orphans and temp files, repair torn lines")
    args = parser.parse_args(argv)
    results = args.results or Path(os.environ.get("KVBENCH_RESULTS_DIR") or _default_results())
    if not results.is_dir():
        print(f"error: results dir {results} does not exist", file=sys.stderr)
        return 2
    reports = [inspect(p) for p in job_dirs(results)]
    counts = Counter(r.state for r in reports)
    for report in reports:
        if report.state != "finished" or report.problems or report.notes:
            detail = "; ".join(report.problems + [f"note: {note}" for note in report.notes]) or "resumable"
            print(f"{report.state:12} {report.path.relative_to(results)}: {detail} ({report.records} records)")
            if args.clean:
                for action in clean(report):
                    print(f"{'':12} {action}")
    print(f"{len(reports)} job dirs in {results}: " + ", ".join(f"{counts[s]} {s}" for s in STATES if counts[s]))
    bad = [r for r in reports if r.state in WRONG or r.problems]
    unrepairable = any(r.state in ("inconsistent", "uncompressed") for r in reports)  # --clean never touches them
    return 1 if bad and not args.clean else (1 if unrepairable else 0)


def _default_results() -> str:
    from kvbench.config import project_root

    return str(Path(project_root()) / "results")
