"""What a results directory's finished runs ran on, and what their samples cost: read from every job's ``meta.json``
(versions, commit, torch threads) and ``samples.jsonl`` (each record's ``prefill_seconds`` and ``decode_seconds``).

The time is the model's: prefill + decode summed over the recorded samples. It survives a job's interruption and
resumption (each sample is timed once, when it ran), unlike a job's ``started``/``finished`` in its meta, which a
resumed job rewrites; it leaves out model loading, tokenisation and scoring. A README says what it means in wall time
(how many jobs shared the cores); this block only states what the files say, so it cannot go stale.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.report.store import job_dirs, meta, records


@dataclass
class Provenance:
    #: task -> [jobs, samples, seconds]
    tasks: dict[str, list[float]] = field(default_factory=dict)
    versions: Counter = field(default_factory=Counter)  # "transformers 5.24.0, torch ..., python ..." -> runs
    commits: Counter = field(default_factory=Counter)  # git sha (12 characters, "-dirty" kept) -> runs
    threads: Counter = field(default_factory=Counter)  # torch threads per job -> runs

    @property
    def jobs(self) -> int:
        return int(sum(t[0] for t in self.tasks.values()))

    @property
    def samples(self) -> int:
        return int(sum(t[1] for t in self.tasks.values()))

    @property
    def seconds(self) -> float:
        return sum(t[2] for t in self.tasks.values())


def provenance(results_dir: str | Path) -> Provenance:
    """Every finished job under ``results_dir`` (``scores.json`` present), counted once."""
    root = Path(results_dir)
    out = Provenance()
    for path in job_dirs(root):
        rel = str(path.relative_to(root))
        info = meta(root, rel)
        recs = records(root, rel)
        row = out.tasks.setdefault(path.parts[-4], [0, 0, 0.0])  # runs/<model>/<task>/<method>/<budget>/<hash>
        row[0] += 1
        row[1] += len(recs)
        row[2] += sum(float(r.get("prefill_seconds") or 0) + float(r.get("decode_seconds") or 0) for r in recs)
        v = info.get("versions") or {}
        out.versions[", ".join(f"{k} {v.get(k, '?')}" for k in ("transformers", "torch", "python"))] += 1
        sha = str(info.get("git_sha") or "unknown")
        out.commits[sha[:12] + ("-dirty" if sha.endswith("-dirty") else "")] += 1
        out.threads[str((info.get("hardware") or {}).get("torch_threads", "?"))] += 1
    return out


def _counted(counter: Counter, total: int) -> str:
    if len(counter) == 1:
        return f"{next(iter(counter))} (all {total})"
    return "; ".join(f"{k} ({n})" for k, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def _n(count: float, noun: str) -> str:
    return f"{int(count)} {noun}{'' if int(count) == 1 else 's'}"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def provenance_markdown(results_dir: str | Path) -> str:
    p = provenance(results_dir)
    if not p.jobs:
        return "No finished runs.\n"
    per_task = ", ".join(f"{task} {_n(j, 'job')} / {_n(s, 'sample')} / {_hours(t)}" for task, (j, s, t) in
                         sorted(p.tasks.items()))
    return (f"{_n(p.jobs, 'finished job')}, {_n(p.samples, 'sample')}. "
            f"From every run's meta: {_counted(p.versions, p.jobs)}; "
            f"kvbench commit {_counted(p.commits, p.jobs)}; torch threads per job {_counted(p.threads, p.jobs)}.\n"
            f"The model's time (prefill + decode, summed over samples): {_hours(p.seconds)} ({per_task}).\n")


__all__ = ["Provenance", "provenance", "provenance_markdown"]
