"""Reliability (issue #8): SIGKILL at each named point then resume, two processes on one job, two sweeps sharing a
store, determinism, and a CUDA OOM in a sweep. Kills are placed exactly with ``KVBENCH_FAULT`` (kvbench/faults.py);
every job runs in a subprocess on the tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.faults import POINTS

JOB = ["model=tiny-random", "task=passkey", "task.context_lengths=[256,384]", "task.depths=[10,50,90]",
       "method=snapkv", "budget=64", "task.max_new_tokens=12", "seed=7"]  # 6 samples
TIMINGS = {"prefill_seconds", "decode_seconds"}


def _env(results: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVBENCH_FAULT"}
    return {**env, "KVBENCH_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1", **extra}


def _run(results: Path, args=JOB, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.run", *args, "print_table=false"], capture_output=True,
                          text=True, timeout=300, env=_env(results, **extra))


def _job_dir(results: Path) -> Path:
    (lock,) = list((results / "runs").glob("*/*/*/*/*/.lock"))  # the first thing a job writes
    return lock.parent


def _records(job: Path) -> list[dict]:
    data = (job / "samples.jsonl").read_bytes()
    assert data.endswith(b"\n"), "a torn last line was left behind"
    return [json.loads(line) for line in data.splitlines()]


def _outcome(job: Path) -> tuple[dict, dict]:
    """What must equal a clean run's: the predictions and scores per sample id, and scores.json without timings."""
    records = {r["id"]: (r["prediction"], r["score"]) for r in _records(job)}
    scores = json.loads((job / "scores.json").read_text())
    return records, {k: v for k, v in scores.items() if "seconds" not in k and "ms" not in k}


def _verify(results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--results", str(results)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def clean_job(tmp_path_factory) -> Path:
    """JOB run once, uninterrupted: its job directory."""
    results = tmp_path_factory.mktemp("clean")
    assert _run(results).returncode == 0
    return _job_dir(results)


@pytest.fixture(scope="module")
def clean(clean_job) -> tuple[dict, dict]:
    return _outcome(clean_job)


#: one job killed at every named point in turn, each kill in the run that resumes the previous one (the counts are
#: per process): (point, n-th visit in that run, the complete records on disk after the kill, a torn last line)
CHAIN = [("model_load", 1, 0, False),    # only the lock file: verify calls the directory orphaned
         ("mid_sample", 3, 2, False),    # the third sample was prefilled: two complete records
         ("record_write", 2, 3, True),   # records 3 and 4 written by this run, the 4th half on disk
         ("scores_write", 1, 6, False)]  # every record, a fsynced temp file, no scores.json


def test_kill_at_each_named_point_then_resume_equals_a_clean_run(tmp_path, clean):
    """SIGKILL at model load, mid-sample, mid-record and mid-scores, each in the run resuming the last kill (so every
    point's leftovers are resumed, a torn line included), then a run to the end: the clean run's records and scores,
    nothing duplicated or torn, no temp file, store verify clean."""
    job = None
    for point, nth, complete, torn in CHAIN:
        assert point in POINTS
        killed = _run(tmp_path, KVBENCH_FAULT=f"{point}:{nth}")
        assert killed.returncode == -9, (point, killed.stderr[-2000:])
        job = job or _job_dir(tmp_path)
        samples = job / "samples.jsonl"
        on_disk = samples.read_bytes() if samples.exists() else b""
        tail_torn = bool(on_disk) and not on_disk.endswith(b"\n")
        assert on_disk.count(b"\n") == complete and tail_torn == torn, (point, on_disk[-300:])
        assert (job / "config.yaml").exists() == (point != "model_load"), point
        assert not (job / "scores.json").exists(), point
        assert bool(list(job.glob(".scores.json.*"))) == (point == "scores_write"), point
        assert _verify(tmp_path).returncode in (0, 1)  # reports, never crashes on a killed job

    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    records = _records(job)
    assert len(records) == len({r["id"] for r in records}) == 6  # nothing duplicated, nothing torn
    assert _outcome(job) == clean
    assert not list(job.glob(".*.json.*")) and not list(job.glob(".config.yaml.*"))
    check = _verify(tmp_path)
    assert check.returncode == 0 and "1 finished" in check.stdout, check.stdout


def test_two_processes_on_one_job_one_runs_the_other_skips(tmp_path, clean):
    procs = [subprocess.Popen([sys.executable, "-m", "kvbench.run", *JOB, "print_table=false"], env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    if codes == [0, 0]:  # the second found the job done (before or after taking its lock) and skipped it; the log
        assert any("finished already" in out + err for out, err in outs), outs  # line is on stdout (Hydra's logging)
    else:
        assert codes == [0, 3], outs
        (busy,) = [err for p, (_, err) in zip(procs, outs) if p.returncode == 3]
        assert "being run by another process" in busy and busy.count("\n") == 1
    assert _outcome(_job_dir(tmp_path)) == clean


def test_a_job_finished_while_waiting_for_its_lock_is_skipped_not_rerun(tmp_path, monkeypatch, caplog):
    """The race the test above can hit under load: a second process finds the job unfinished, the first finishes it
    and drops the lock, the second takes it. The second must skip (its meta, config and scores untouched), not
    rewrite the finished job's meta with a run of zero samples."""
    from helpers import run_job_in
    from kvbench.store import JobDir

    overrides = ["model=tiny-random", "task=passkey", "task.context_lengths=[256]", "task.depths=[10]",
                 "method=snapkv", "budget=64", "task.max_new_tokens=6"]
    run_job_in(tmp_path, overrides)
    job = _job_dir(tmp_path)
    before = {name: (job / name).read_bytes() for name in ("meta.json", "config.yaml", "scores.json")}
    real, calls = JobDir.finished_scores, []

    def racing(self, limit=None):  # the first check (before the lock) sees the job unfinished
        calls.append(1)
        return None if len(calls) == 1 else real(self, limit)

    monkeypatch.setattr(JobDir, "finished_scores", racing)
    with caplog.at_level("INFO"):
        run_job_in(tmp_path, overrides)
    assert len(calls) == 2 and "finished already" in caplog.text
    assert {name: (job / name).read_bytes() for name in before} == before


def test_two_sweeps_sharing_a_store_finish_without_corruption(tmp_path):
    base = ["-m", "model=tiny-random", "task=passkey", "task.context_lengths=[256]", "task.depths=[10,90]",
            "task.max_new_tokens=6", "print_table=false"]
    sweeps = [base + ["method=snapkv,streamingllm", "budget=64,96"], base + ["method=streamingllm,h2o", "budget=64,96"]]
    procs = [subprocess.Popen([sys.executable, "-m", "kvbench.run", *args], env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for args in sweeps]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    jobs = sorted(p.parent for p in (tmp_path / "runs").glob("*/*/*/*/*/scores.json"))
    assert len(jobs) == 6  # streamingllm x 2 budgets shared: each ran once (or was skipped by one sweep)
    for job in jobs:
        records = _records(job)
        assert len(records) == len({r["id"] for r in records}) == 2
    check = _verify(tmp_path)
    assert check.returncode == 0 and "6 finished" in check.stdout, check.stdout


def test_same_job_twice_is_deterministic_and_the_seed_is_recorded(tmp_path, clean, clean_job):
    """A second run of the clean run's job (seed 7) in a store of its own: the same key, records and scores."""
    assert _run(tmp_path).returncode == 0
    job = _job_dir(tmp_path)
    assert _outcome(job) == clean
    assert job.name == clean_job.name  # same key
    config = (job / "config.yaml").read_text()
    assert "seed: 7" in config.split("resolved:")[0] and "seed: 7" in config.split("resolved:")[1]
    meta = json.loads((job / "meta.json").read_text())
    assert meta["seed"] == 7 or meta.get("config", {}).get("seed") == 7, sorted(meta)


def test_a_cuda_oom_fails_its_job_in_a_sweep_and_the_others_run(tmp_path):
    args = ["-m", "model=tiny-random", "task=passkey", "task.context_lengths=[256]", "task.depths=[50]",
            "task.max_new_tokens=6", "print_table=false", "method=snapkv,streamingllm", "budget=64"]
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True, timeout=300,
                          env=_env(tmp_path, KVBENCH_FAULT="oom:1"))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a sweep with a failed job exits 1
    assert time.time() - started < 240
    (failed,) = list((tmp_path / "runs").glob("*/*/*/*/*/failed.json"))
    cause = json.loads(failed.read_text())
    assert cause["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert not (failed.parent / "scores.json").exists()
    finished = list((tmp_path / "runs").glob("*/*/*/*/*/scores.json"))
    assert len(finished) == 1 and finished[0].parent != failed.parent
    assert "1 succeeded" in proc.stdout and "1 failed" in proc.stdout and "OutOfMemoryError" in proc.stdout


def test_a_bad_fault_spec_is_refused():
    from kvbench import faults

    os.environ["KVBENCH_FAULT"] = "prefill:1"
    try:
        with pytest.raises(ValueError, match="model_load, mid_sample, record_write, scores_write, oom"):
            faults.armed("model_load")
    finally:
        del os.environ["KVBENCH_FAULT"]
    assert faults.armed("model_load") is False
