"""A sweep worker: one launched Hydra job that runs a chunk of jobs, loading each model once.

Per-job timings exclude the load; the load is recorded once, in the worker's record
(``<sweep dir>/.kvbench/workers/<n>.json``: host, Slurm ids, models loaded with their load seconds, the job running
now, every job's outcome). One job's exception (CUDA OOM included) is written to its ``failed.json`` and the worker
goes on with the next job. SIGTERM (scancel, preemption, the time limit) stops the worker: the running job is
recorded as cancelled, the rest as not run, and the worker returns normally so that the launcher hears about it at
once instead of waiting for Slurm's accounting.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kvbench.store import JobDir, atomic_write_text


class WorkerCancelled(BaseException):
    """Raised in the worker's main thread by SIGTERM. A BaseException, so no ``except Exception`` swallows it."""


def run_worker(chunk_path: str | Path) -> dict[str, Any]:
    """Run the chunk's jobs in order; return ``{"worker": n, "outcomes": [...]}`` (one outcome per job)."""
    chunk = json.loads(Path(chunk_path).read_text())
    if chunk.get("gpus"):
        _pin_gpu(int(chunk["worker"]), chunk["gpus"])
    record = WorkerRecord(Path(chunk_path).parent.parent / "workers" / f"{int(chunk['worker']):04d}.json")
    models = ModelCache(record)
    outcomes: list[dict[str, Any]] = []
    items = chunk["jobs"]
    try:
        with _sigterm_cancels():
            for item in items:
                outcome = _run_one(item, models, record)
                outcomes.append(outcome)
                record.finish_job(outcome)
    except WorkerCancelled as exc:
        if len(outcomes) < len(items):
            outcome = _failed(items[len(outcomes)], exc, kind="cancelled", record=record)
            outcomes.append(outcome)
            record.finish_job(outcome)
        for rest in items[len(outcomes):]:
            outcome = {"hash": rest["hash"], "status": "not_run", "path": rest["path"],
                       "cause": "the worker was cancelled before this job started"}
            outcomes.append(outcome)
            record.finish_job(outcome)
    finally:
        models.release()
        record.close()
    return {"worker": chunk["worker"], "host": socket.gethostname(), "outcomes": outcomes}


def _run_one(item: dict[str, Any], models: ModelCache, record: WorkerRecord) -> dict[str, Any]:
    from kvbench.errors import NotAvailableError
    from kvbench.jobs import plan_job, run_job
    from kvbench.store import JobLockedError

    cfg = OmegaConf.create(item["config"])
    started = time.time()
    record.start_job(item)
    try:
        job = plan_job(cfg)
        if JobDir(cfg.paths.results_dir, job.parts, job.key).finished_scores(cfg.limit) is not None:
            return {"hash": item["hash"], "status": "skipped", "path": item["path"], "cause": "finished meanwhile"}
        scores = run_job(cfg, loaded=models.get)
    except JobLockedError as exc:
        return {"hash": item["hash"], "status": "not_run", "path": item["path"], "cause": str(exc)}
    except NotAvailableError as exc:  # e.g. a method that needs CUDA, planned on a machine that has none
        return _failed(item, exc, kind="not available", record=record)
    except Exception as exc:
        if _is_time_limit(exc):  # submitit raises this from its USR2 handler when the job will not be requeued
            raise WorkerCancelled(f"the time limit was reached ({exc})") from exc
        models.after_failure(exc)
        return _failed(item, exc, kind="exception", record=record)
    return {"hash": item["hash"], "status": "succeeded", "path": item["path"], "score": scores.get("score"),
            "seconds": round(time.time() - started, 3)}


def _is_time_limit(exc: BaseException) -> bool:
    return type(exc).__name__ == "UncompletedJobError" and type(exc).__module__.startswith("submitit")


def _failed(item: dict[str, Any], exc: BaseException, kind: str, record: WorkerRecord) -> dict[str, Any]:
    """Write the job's failed.json (cause, host, time, traceback tail) and return its outcome."""
    path = Path(item["path"])
    done = 0
    samples = path / "samples.jsonl"
    if samples.exists():
        done = sum(1 for line in samples.read_bytes().splitlines() if line.strip())
    failure = {
        "kind": kind,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)[-12:]),
        "samples_done": done,
        **record.where(),
    }
    _write_failure(path, failure)
    return {"hash": item["hash"], "status": "failed", "path": item["path"], "cause": failure["error"]}


def _write_failure(path: Path, failure: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path / "failed.json", json.dumps(failure, indent=2, sort_keys=True, default=str) + "\n")


def outcomes_of_dead_worker(chunk_path: str | Path, cause: str) -> list[dict[str, Any]]:
    """Outcomes of a worker that never answered (SIGKILL, OOM killer, lost node, cancelled while pending): from its
    record and the store. The job it was running gets a failed.json with ``cause``; jobs it never reached are
    "not run" (they stay missing in the store, so the next sweep submits them)."""
    chunk = json.loads(Path(chunk_path).read_text())
    record_path = Path(chunk_path).parent.parent / "workers" / f"{int(chunk['worker']):04d}.json"
    try:
        record = json.loads(record_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        record = {}
    finished = {o["hash"]: o for o in record.get("outcomes", [])}
    current = record.get("current")
    first_line = cause.splitlines()[0] if cause else "?"
    outcomes = []
    for item in chunk["jobs"]:
        if item["hash"] in finished:
            outcomes.append(finished[item["hash"]])
        elif item["hash"] == current:
            failure = {"kind": "worker died", "error": cause[:2000], "host": record.get("host"),
                       "slurm_job_id": record.get("slurm_job_id"), "worker": str(record_path),
                       "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            _write_failure(Path(item["path"]), failure)
            outcomes.append({"hash": item["hash"], "status": "failed", "path": item["path"],
                             "cause": f"worker died: {first_line}"})
        else:
            outcomes.append({"hash": item["hash"], "status": "not_run", "path": item["path"],
                             "cause": f"its worker died before reaching it ({first_line})"})
    return outcomes


# ---- the model, loaded once per worker ---------------------------------------------------------------------------
class ModelCache:
    """Holds one loaded model at a time (a chunk is ordered by model); a failed load fails that model's jobs at
    once with the same cause instead of loading again for each."""

    def __init__(self, record: WorkerRecord):
        self.record = record
        self.spec: Any = None
        self.loaded: Any = None
        self.load_errors: dict[str, BaseException] = {}

    def get(self, spec: Any) -> Any:
        from kvbench.models import load_model

        if self.loaded is not None and self.spec == spec:
            return self.loaded
        key = repr(spec)
        if key in self.load_errors:
            raise RuntimeError(f"model {spec.name!r} failed to load earlier in this worker: "
                               f"{type(self.load_errors[key]).__name__}: {self.load_errors[key]}")
        self.release()
        started = time.time()
        try:
            self.loaded = load_model(spec)
        except Exception as exc:
            self.load_errors[key] = exc
            raise
        self.spec = spec
        self.record.model_loaded(spec.name, self.loaded.load_seconds, time.time() - started, self.loaded.device)
        return self.loaded

    def release(self) -> None:
        if self.loaded is None:
            return
        self.loaded = self.spec = None
        gc.collect()
        _empty_cuda_cache()

    def after_failure(self, exc: BaseException) -> None:
        """Free what a failed job left on the GPU (a CUDA OOM leaves its activations until collected)."""
        gc.collect()
        _empty_cuda_cache()


def _empty_cuda_cache() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the worker's record -----------------------------------------------------------------------------------------
class WorkerRecord:
    """``workers/<n>.json``, rewritten atomically at every change, so a dead worker's last state is readable."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {
            **self.where(), "pid": os.getpid(), "started": _now(), "models": [], "current": None, "outcomes": [],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        self._write()

    def where(self) -> dict[str, Any]:
        slurm = os.environ.get("SLURM_ARRAY_JOB_ID")
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        job_id = f"{slurm}_{task}" if slurm and task else os.environ.get("SLURM_JOB_ID")
        return {"host": socket.gethostname(), "time": _now(), "slurm_job_id": job_id, "worker": str(self.path)}

    def model_loaded(self, name: str, load_seconds: float, wall_seconds: float, device: str) -> None:
        self.data["models"].append({"model": name, "load_seconds": round(load_seconds, 3),
                                    "wall_seconds": round(wall_seconds, 3), "device": device, "time": _now()})
        self._write()

    def start_job(self, item: dict[str, Any]) -> None:
        self.data["current"] = item["hash"]
        self.data["current_label"] = item.get("label")
        self._write()

    def finish_job(self, outcome: dict[str, Any]) -> None:
        self.data["outcomes"].append(outcome)
        self.data["current"] = None
        self._write()

    def close(self) -> None:
        self.data["finished"] = _now()
        self._write()

    def _write(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=1, default=str) + "\n")


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# ---- signals and GPUs --------------------------------------------------------------------------------------------
@contextmanager
def _sigterm_cancels() -> Iterator[None]:
    """SIGTERM raises WorkerCancelled in the main thread (once); the previous handler comes back afterwards.
    submitit's own handler ignores SIGTERM, which leaves a cancelled task running until SIGKILL (KillWait later)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def cancel(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one cancellation; cleanup must not be interrupted again
        raise WorkerCancelled(f"SIGTERM received on {socket.gethostname()} (scancel, preemption or time limit)")

    previous: Callable | int | None = signal.signal(signal.SIGTERM, cancel)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _pin_gpu(worker: int, gpus: list[str]) -> None:
    """launcher=local: submitit's local executor gives every worker the same devices; worker i takes the i-th GPU
    the sweep saw (set before CUDA initialises, which reads CUDA_VISIBLE_DEVICES once)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus[worker % len(gpus)])
