"""A real single-node Slurm (scripts/slurm/start_local_slurm.sh: Debian's 22.05 packages, MariaDB + slurmdbd
accounting, KillWait=5): a sweep goes out as one array job through hydra-submitit-launcher, its results land in the
store, the same sweep submitted again runs nothing, and a running array task cancelled with scancel is reported as
failed (cause in failed.json) without hanging. Every sweep runs under a wall-clock timeout.

Needs root and dpkg/apt (CI's Debian machine); elsewhere the tests are skipped with the reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
PREFIX = os.environ.get("SLURM_LOCAL_PREFIX", "/tmp/kvbench-slurm")
SWEEP_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def slurm_env():
    if os.geteuid() != 0:
        pytest.skip("the local Slurm runs its daemons and jobs as root")
    if shutil.which("dpkg-query") is None or shutil.which("apt-get") is None:
        pytest.skip("the local Slurm is installed from Debian packages (dpkg/apt not found)")
    env = {**os.environ, "SLURM_LOCAL_PREFIX": PREFIX}
    slurm = {"SLURM_CONF": f"{PREFIX}/etc/slurm.conf"}
    was_up = Path(slurm["SLURM_CONF"]).exists() and shutil.which("scontrol") is not None and subprocess.run(
        ["scontrol", "ping"], capture_output=True, timeout=30, env={**env, **slurm}).returncode == 0
    started = time.time()
    proc = subprocess.run(["bash", str(REPO / "scripts/slurm/start_local_slurm.sh")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"local Slurm ready in {time.time() - started:.1f} s")
    yield slurm
    if not was_up:  # leave the machine as it was
        subprocess.run(["bash", str(REPO / "scripts/slurm/stop_local_slurm.sh")], timeout=120, env=env)


def _sweep(args, results: Path, slurm_env, popen=False):
    env = {**os.environ, **slurm_env, "KVBENCH_RESULTS_DIR": str(results), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "kvbench.run", "-m", "model=tiny-random", "task=needle_chat",
           "task.context_lengths=[400]", "task.max_new_tokens=4", "print_table=false", "launcher=slurm",
           "hydra.launcher.partition=debug", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1",
           "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10", *args]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=SWEEP_TIMEOUT_S)


def _squeue(slurm_env) -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **slurm_env}).stdout


def test_array_sweep_skip_and_cancel(tmp_path, slurm_env):
    """8 jobs in one array of 2 tasks: task 0 runs the small sweep (needle at 400 tokens, 1 depth, 2 methods x 2
    budgets), task 1 the same with 80 depths, and is cancelled (scancel of the running array task) once its first
    job has a sample. Then the small sweep is submitted again: nothing runs."""
    results = tmp_path / "results"
    started = time.time()
    proc = _sweep(["task.n_depths=1,80", "method=snapkv,streamingllm", "budget=64,96",
                   "hydra.sweeper.jobs_per_worker=4"], results, slurm_env, popen=True)
    long_jobs = results / "runs" / "tiny-random" / "needle"
    task1 = None
    try:
        deadline = time.time() + SWEEP_TIMEOUT_S
        while time.time() < deadline and proc.poll() is None:
            records = list((results / "logs" / "multiruns").glob("*/.kvbench/workers/0001.json"))
            if records:
                record = json.loads(records[0].read_text())
                current = record.get("current")
                samples = [p for p in long_jobs.glob("*/*/*/samples.jsonl") if current and p.parent.name in current]
                if samples and samples[0].stat().st_size > 0:
                    task1 = record["slurm_job_id"]
                    break
            time.sleep(0.2)
        assert task1 and "_" in task1, f"array task 1 never wrote a sample; squeue: {_squeue(slurm_env)}"
        subprocess.run(["scancel", task1], check=True, timeout=30, env={**os.environ, **slurm_env})
        cancelled_at = time.time()
        out, _ = proc.communicate(timeout=SWEEP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reacted = time.time() - cancelled_at
    assert proc.returncode == 1, out
    assert "8 planned jobs (8 to run)" in out and "launching 2 worker(s) for 8 job(s)" in out
    assert "sweep summary: 4 succeeded, 0 skipped (finished earlier), 1 failed, 3 not run" in out, out
    assert "WorkerCancelled: SIGTERM" in out
    assert reacted < 60, reacted

    # task 0: the small sweep's 4 jobs, finished in the store; task 1: its running job failed as cancelled
    scores = [json.loads(p.read_text()) for p in long_jobs.glob("*/*/*/scores.json")]
    assert sorted((s["method"], s["budget"]) for s in scores) == [("snapkv", "64"), ("snapkv", "96"),
                                                                   ("streamingllm", "64"), ("streamingllm", "96")]
    assert all(s["n_samples"] == 1 for s in scores)
    (failure,) = [json.loads(p.read_text()) for p in long_jobs.glob("*/*/*/failed.json")]
    assert failure["kind"] == "cancelled" and failure["slurm_job_id"] == task1 and failure["samples_done"] >= 1
    (task0,) = [json.loads(p.read_text())["slurm_job_id"] for p in
                (results / "logs" / "multiruns").glob("*/.kvbench/workers/0000.json")]
    assert task0.split("_")[0] == task1.split("_")[0]  # one array job, two tasks
    print(f"array sweep with a cancelled task: {time.time() - started:.1f} s (exit {reacted:.1f} s after scancel)")

    again = _sweep(["task.n_depths=1", "method=snapkv,streamingllm", "budget=64,96"], results, slurm_env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "4 planned jobs (4 finished)" in again.stdout and "launching" not in again.stdout
    assert "0 succeeded, 4 skipped (finished earlier)" in again.stdout
    assert not [line for line in _squeue(slurm_env).splitlines() if line.strip()]
    print(f"whole slurm test: {time.time() - started:.1f} s")


def test_a_refused_submission_is_one_line_and_writes_nothing(tmp_path, slurm_env):
    """sbatch refuses a GPU request on the GPU-less node: exit 2, one line naming the refusal, no job in the store."""
    results = tmp_path / "results"
    proc = _sweep(["task.n_depths=1", "method=snapkv", "budget=64", "hydra.launcher.gpus_per_node=1"], results,
                  slurm_env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [row for row in proc.stderr.splitlines() if row.startswith("error:")]
    assert "could not submit" in line and "gres" in line and "gpus_per_node" in line
    assert not (results / "runs").exists() or not list((results / "runs").rglob("samples.jsonl"))
