"""``python -m kvbench.store verify [--results DIR] [--clean]``: find incomplete, orphaned and inconsistent jobs.

Every job directory ``runs/<4 parts>/<hash12>/`` is classified:

* ``finished``: scores.json present and consistent with its records;
* ``running``: another process holds its lock;
* ``incomplete``: records but no scores (a kill; rerunning the job resumes it) — and ``torn`` when its last record
  line is cut (the next run repairs it; ``--clean`` repairs it now);
* ``failed``: a ``failed.json`` written by a sweep (its cause is shown);
* ``inconsistent``: config.yaml missing or unreadable, its key hashing to another directory name, duplicate or
  unparseable record lines, or scores.json whose sample count differs from the unique records;
* ``orphaned``: no config.yaml and no records (a job that died before it started), or leftover temp files of an
  atomic write.

``--clean`` removes orphaned directories and temp files and repairs torn lines; it never deletes records or
scores (inconsistent jobs are reported for a human to decide). Exit code 0 when nothing is wrong, 1 otherwise.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvbench.store import config_hash

STATES = ("finished", "running", "incomplete", "failed", "inconsistent", "orphaned")


@dataclass
class JobReport:
    path: Path
    state: str
    problems: list[str] = field(default_factory=list)
    records: int = 0
    torn: bool = False
    temp_files: list[Path] = field(default_factory=list)


def _locked(path: Path) -> bool:
    lock = path / ".lock"
    if not lock.exists():
        return False
    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def inspect(path: Path) -> JobReport:
    report = JobReport(path, "finished")
    report.temp_files = sorted(p for p in path.iterdir() if p.name.startswith(".") and p.name != ".lock")
    if report.temp_files:
        report.problems.append(f"{len(report.temp_files)} leftover temp file(s)")
    samples = path / "samples.jsonl"
    ids: list[str] = []
    if samples.exists():
        data = samples.read_bytes()
        good_end = data.rfind(b"\n") + 1
        report.torn = good_end < len(data)
        for number, line in enumerate(data[:good_end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                ids.append(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                report.problems.append(f"samples.jsonl line {number} is not a record")
        duplicates = [i for i, c in Counter(ids).items() if c > 1]
        if duplicates:
            report.problems.append(f"duplicate records: {', '.join(duplicates[:5])}")
    report.records = len(set(ids))
    config = path / "config.yaml"
    if not config.exists():
        if not ids and not (path / "scores.json").exists():
            report.state = "orphaned"
            report.problems.append("no config.yaml and no records")
            return report
        report.problems.append("config.yaml is missing")
    else:
        try:
            key = yaml.safe_load(config.read_text())["key"]
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
    elif _locked(path):
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
    if report.torn and report.state != "running":
        report.problems.append("torn last record line")
    return report


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
    if report.torn:
        samples = report.path / "samples.jsonl"
        data = samples.read_bytes()
        with open(samples, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)
            fh.flush()
            os.fsync(fh.fileno())
        done.append("cut the torn last line")
    return done


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
        if report.state != "finished" or report.problems:
            print(f"{report.state:12} {report.path.relative_to(results)}: {'; '.join(report.problems) or 'resumable'}"
                  f" ({report.records} records)")
            if args.clean:
                for action in clean(report):
                    print(f"{'':12} {action}")
    print(f"{len(reports)} job dirs in {results}: " + ", ".join(f"{counts[s]} {s}" for s in STATES if counts[s]))
    bad = [r for r in reports if r.state in ("inconsistent", "orphaned", "failed") or r.problems]
    return 1 if bad and not args.clean else (1 if any(r.state == "inconsistent" for r in reports) else 0)


def _default_results() -> str:
    from kvbench.config import project_root

    return str(Path(project_root()) / "results")
