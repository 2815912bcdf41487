"""The result store: one directory per job, named by a hash of what produced it.

    <results_dir>/runs/<model>/<task>/<method>/<budget>/<hash12>/
        config.yaml     the resolved job config (the hashed part under ``key``)
        meta.json       git sha, package versions, hardware, protocol, timings, memory
        samples.jsonl   one record per finished sample, appended and fsynced as it finishes
        errors.jsonl    samples that raised in the last run (id, error, traceback); they get no record and are retried
        scores.json     aggregate scores over all the job's stored records (written atomically, last)
        scores.limit-<N>.json   a ``limit=N`` run's scores when the job stores more records than its first N
                        samples: a smaller limit never rewrites the job's own summary
        failed.json     why the last attempt failed (exception, cancellation, dead worker; host, time, traceback
                        tail), written by the sweep worker; removed when scores.json is written
        .lock           held (flock) by the process running the job

A killed job resumes after its last complete record; a torn last line is cut off before appending. A job whose
``scores.json`` covers the planned sample ids is finished and skipped.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from kvbench import faults
from kvbench.errors import DataError, KVBenchError

#: PyYAML's safe loader, its libyaml form where PyYAML has it (the same documents, about 9x faster: the report and
#: ``store verify`` read every stored run's config.yaml)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` through ``SAFE_LOADER``."""
    return yaml.load(text, Loader=SAFE_LOADER)


class JobLockedError(KVBenchError):
    """Another process holds the job's lock (exit code 3: busy, not bad input)."""

    exit_code = 3


class CorruptRecordError(DataError):
    """A complete line of samples.jsonl that is not a record (a torn last line is a kill's, and is repaired)."""


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(key: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the job key (model, method, budget, task protocol, seed, generation)."""
    return hashlib.sha256(canonical_json(key).encode()).hexdigest()


def ids_digest(ids: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def atomic_write_text(path: Path, text: str, fault_point: str | None = None) -> None:
    """Write via a temp file in the same directory and rename: readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if fault_point is not None:
            faults.reach(fault_point)  # tests: a kill between the temp file and the rename
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def open_lock_for_probe(lock: Path):
    """A job's ``.lock`` opened to probe it: for writing where possible (NFS emulates flock with write locks), else
    read-only (a read-only store: local flock needs no write access)."""
    try:
        return open(lock, "a+")
    except OSError:
        return open(lock)


def lock_is_held(lock: Path) -> bool:
    """Whether some process holds the job directory's ``lock`` file right now (a probe: it takes and drops the lock
    if free; False where there is no lock file)."""
    if not lock.exists():
        return False
    with open_lock_for_probe(lock) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def check_results_writable(results_dir: str | Path) -> None:
    """Refuse, in one line, a results directory kvbench cannot write (read-only, no permission, full), before
    anything is created or loaded: a probe file is written, fsynced and removed in the directory, or in its nearest
    existing parent when it does not exist yet (nothing is left behind either way)."""
    import errno

    path = Path(results_dir)
    probe_dir = path
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    where = "" if probe_dir == path else f" (it does not exist; its parent {probe_dir} cannot be written)"
    if not probe_dir.is_dir():
        raise DataError(f"results directory {path} cannot be created: {probe_dir} is not a directory; set "
                        "KVBENCH_RESULTS_DIR or paths.results_dir to a writable directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe_dir, prefix=".kvbench-write-probe-")
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as exc:
        why = {errno.EROFS: "is on a read-only file system", errno.ENOSPC: "has no space left",
               errno.EDQUOT: "has no space left (disk quota)"}.get(exc.errno, "cannot be written")
        raise DataError(f"results directory {path} {why}{where} ({exc.strerror}); set KVBENCH_RESULTS_DIR or "
                        "paths.results_dir to a writable directory") from None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _safe(part: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in str(part)) or "_"


class JobDir:
    """One job's directory. Use as a context manager to hold its lock while running."""

    def __init__(self, results_dir: str | Path, parts: tuple[str, str, str, str], key: dict[str, Any]):
        self.key = key
        self.hash = config_hash(key)
        self.path = Path(results_dir) / "runs" / Path(*(_safe(p) for p in parts)) / self.hash[:12]
        self._lock_fh = None

    @property
    def samples_path(self) -> Path:
        return self.path / "samples.jsonl"

    @property
    def scores_path(self) -> Path:
        return self.path / "scores.json"

    @property
    def failure_path(self) -> Path:
        return self.path / "failed.json"

    # ---- locking -------------------------------------------------------------------------------------------------
    def __enter__(self) -> JobDir:
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(self.path / ".lock", "a+")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.close()
            self._lock_fh = None
            raise JobLockedError(f"job {self.path} is being run by another process; skipping it") from None
        # written only under this lock: a temp file left by a kill between write and rename is garbage now
        for name in ("config.yaml", "meta.json", "scores.json", "scores.limit-*.json"):
            for stale in self.path.glob(f".{name}.*"):
                stale.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    def lock_held(self) -> bool:
        """Whether some process holds the job's lock right now (a probe; it takes and drops the lock if free)."""
        return self._lock_fh is not None or lock_is_held(self.path / ".lock")

    # ---- contents -----------------------------------------------------------------------------------------------
    def write_config(self, text: str) -> None:
        atomic_write_text(self.path / "config.yaml", text)

    def write_meta(self, meta: dict[str, Any]) -> None:
        atomic_write_text(self.path / "meta.json", json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")

    def read_meta(self) -> dict[str, Any]:
        path = self.path / "meta.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def read_scores(self) -> dict[str, Any] | None:
        if not self.scores_path.exists():
            return None
        try:
            return json.loads(self.scores_path.read_text())
        except json.JSONDecodeError:
            return None

    def subset_scores_path(self, limit: int) -> Path:
        """Where a ``limit`` run's scores go when the job stores more records than that run covers."""
        return self.path / f"scores.limit-{limit}.json"

    def finished_scores(self, limit: int | None) -> dict[str, Any] | None:
        """The scores of a finished run with the same ``limit`` (what ``run_job`` and the sweep skip), else None:
        the job's ``scores.json``, or for a ``limit`` the subset's summary beside it."""
        for scores in (self.read_scores(),
                       None if limit is None else _read_json(self.subset_scores_path(limit))):
            if scores is not None and scores.get("limit") == limit and not scores.get("n_failed"):
                return scores  # a run with failed samples is not finished: the next run retries them
        return None

    def write_subset_scores(self, scores: dict[str, Any]) -> None:
        """A ``limit`` run over fewer samples than the job stores: its summary goes beside ``scores.json``."""
        atomic_write_text(self.subset_scores_path(scores["limit"]),
                          json.dumps(scores, indent=2, sort_keys=True, default=str) + "\n")

    def set_aside_scores(self, limit: int | None) -> None:
        """Before records are appended: a ``scores.json`` written by a run with another ``limit`` would describe a
        subset of the records once they are; it moves to its own ``scores.limit-<N>.json`` (still true of its N)."""
        scores = self.read_scores()
        if scores is not None and isinstance(scores.get("limit"), int) and scores["limit"] != limit:
            os.replace(self.scores_path, self.subset_scores_path(scores["limit"]))

    def is_finished(self, planned_ids: list[str]) -> bool:
        scores = self.read_scores()
        return scores is not None and scores.get("sample_ids_digest") == ids_digest(planned_ids)

    def read_records(self, repair: bool = False) -> list[dict[str, Any]]:
        """Complete records in order. A torn last line (a kill mid-write) is dropped, and cut from the file when
        ``repair`` (only done while holding the lock)."""
        if not self.samples_path.exists():
            return []
        data = self.samples_path.read_bytes()
        good_end = data.rfind(b"\n") + 1
        records = []
        for number, line in enumerate(data[:good_end].splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict) or "id" not in record:
                        raise ValueError("not a record")
                except ValueError:  # a complete line that is not a record: not a kill's doing, never guessed at
                    raise CorruptRecordError(
                        f"{self.samples_path} line {number} is not a record (corrupted); run `python -m kvbench.store "
                        f"verify --clean --results {self.path.parents[5]}` to set it aside (the next run redoes "
                        "its sample)") from None
                records.append(record)
        if repair and good_end < len(data):
            with open(self.samples_path, "r+b") as fh:
                fh.truncate(good_end)
                fh.flush()
                os.fsync(fh.fileno())
        return records

    def append_record(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        with open(self.samples_path, "ab") as fh:
            if faults.armed("record_write"):  # tests: a kill with half the line on disk
                fh.write(line[: len(line) // 2])
                fh.flush()
                os.fsync(fh.fileno())
                faults.die()
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    @property
    def errors_path(self) -> Path:
        return self.path / "errors.jsonl"

    def append_error(self, error: dict[str, Any]) -> None:
        """A sample that raised (its record is not written, so a rerun retries it)."""
        with open(self.errors_path, "a") as fh:
            fh.write(json.dumps(error, sort_keys=True, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read_errors(self) -> list[dict[str, Any]]:
        if not self.errors_path.exists():
            return []
        out = []
        for line in self.errors_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a torn line of a killed run
        return out

    def clear_errors(self) -> None:
        """Start of a (re)run: earlier sample failures are retried, so their records go."""
        self.errors_path.unlink(missing_ok=True)

    def write_scores(self, scores: dict[str, Any]) -> None:
        """Write the final scores; a job that finishes is no longer failed, so its failure record goes."""
        atomic_write_text(self.scores_path, json.dumps(scores, indent=2, sort_keys=True, default=str) + "\n",
                          fault_point="scores_write")
        self.failure_path.unlink(missing_ok=True)

    def discard_if_empty(self) -> bool:
        """Remove this job's directory when it holds no record and no scores (a job stopped before its first sample
        finished leaves nothing behind: a failed compression check stores no result). Returns whether it did."""
        if self.read_records() or self.scores_path.exists():
            return False
        for name in ("config.yaml", "meta.json", "errors.jsonl", "failed.json", "samples.jsonl", ".lock"):
            (self.path / name).unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:
            return False  # something else lives there: leave it for ``store verify`` to report
        parent = self.path.parent
        for _ in range(4):  # <budget>/<method>/<task>/<model> directories this job alone created
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
        return True

    # ---- failures ------------------------------------------------------------------------------------------------
    def write_failure(self, failure: dict[str, Any]) -> None:
        """Record why the last attempt failed (the sweep lists it; the next successful run removes it)."""
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.failure_path, json.dumps(failure, indent=2, sort_keys=True, default=str) + "\n")

    def read_failure(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.failure_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
