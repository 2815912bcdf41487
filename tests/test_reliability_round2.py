"""Reliability, second round (issue #38): nothing a user types damages a stored result. A smaller ``limit`` never
rewrites a finished job's summary; bad input, a corrupted record, Ctrl-C and an unwritable results directory are one
line each, before any model loads, with nothing created. Every job runs in a subprocess on the tiny random model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = ["model=tiny-random", "task=passkey", "task.context_lengths=[256]", "task.depths=[10,50,90]", "method=h2o",
       "budget=64", "task.max_new_tokens=6"]  # 3 samples


def _env(results: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVBENCH_FAULT"}
    return {**env, "KVBENCH_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1", **extra}


def _run(results: Path, args, timeout: int = 300, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(results, **extra))


def _job_dir(results: Path) -> Path:
    (job,) = [p for p in (results / "runs").glob("*/*/*/*/*") if p.is_dir()]
    return job


def _checksums(results: Path) -> dict[str, str]:
    """sha256 of every file under the results root (the store's checksum: nothing may change)."""
    return {str(p.relative_to(results)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(results.rglob("*")) if p.is_file() and "logs" not in p.relative_to(results).parts}


# ---- 1. a job's summary describes all its stored records -----------------------------------------------------------
def test_a_smaller_limit_reports_its_subset_and_leaves_the_jobs_summary_alone(tmp_path):
    assert _run(tmp_path, [*JOB, "print_table=false"]).returncode == 0
    job = _job_dir(tmp_path)
    before = _checksums(tmp_path)
    full = json.loads((job / "scores.json").read_text())
    assert full["n_samples"] == 3 and full["limit"] is None

    subset = _run(tmp_path, [*JOB, "limit=2"])
    assert subset.returncode == 0, subset.stderr[-2000:]
    assert "2 samples" in subset.stdout  # the subset it was asked for is reported
    after = _checksums(tmp_path)
    for name in ("scores.json", "samples.jsonl", "meta.json", "config.yaml"):
        key = str((job / name).relative_to(tmp_path))
        assert after[key] == before[key], f"{name} was rewritten by a limit=2 run"
    beside = json.loads((job / "scores.limit-2.json").read_text())  # the subset's summary, named, beside
    assert beside["n_samples"] == 2 and beside["limit"] == 2

    plan = _run(tmp_path, [*JOB, "plan=true"], timeout=120)
    assert plan.returncode == 0 and "finished" in plan.stdout and "resumes" not in plan.stdout, plan.stdout
    plan2 = _run(tmp_path, [*JOB, "limit=2", "plan=true"], timeout=120)
    assert plan2.returncode == 0 and "finished" in plan2.stdout and "resumes" not in plan2.stdout, plan2.stdout
    again = _run(tmp_path, [*JOB, "limit=2"], KVBENCH_FAULT="model_load:1")  # skipped before any model loads
    assert again.returncode == 0 and "finished earlier; skipped" in again.stdout, again.stderr[-2000:]
    verify = subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--results", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0 and "1 finished" in verify.stdout, verify.stdout


def test_a_full_run_after_a_limited_one_moves_the_limited_summary_aside(tmp_path):
    """limit=2 first (its scores.json describes all 2 stored records), then a full run that is killed after its
    third record: scores.json must not stay behind describing 2 of the 3 stored records."""
    assert _run(tmp_path, [*JOB, "limit=2", "print_table=false"]).returncode == 0
    job = _job_dir(tmp_path)
    killed = _run(tmp_path, [*JOB, "print_table=false"], KVBENCH_FAULT="scores_write:1")
    assert killed.returncode == -9
    assert len((job / "samples.jsonl").read_text().splitlines()) == 3
    assert not (job / "scores.json").exists()
    assert json.loads((job / "scores.limit-2.json").read_text())["n_samples"] == 2
    plan = _run(tmp_path, [*JOB, "plan=true"], timeout=120)
    assert "resumes" in plan.stdout, plan.stdout


# ---- 2. every bad input: one line naming the value and what is valid, exit 2, nothing created ---------------------
def _assert_one_line_refusal(proc: subprocess.CompletedProcess, message: str, results: Path) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Loading" not in proc.stderr + proc.stdout


UNKNOWN = [
    (["foo=1"], "unknown top-level value 'foo'; valid: "),
    (["+foo=1", "plan=true"], "unknown top-level value 'foo'; valid: "),
    (["engine.nosuch=1"], "unknown top-level value 'engine.nosuch'; valid: "),
    (["+budget=64"], "budget is already set; set it without the '+' (budget=...)"),
]


def test_unknown_top_level_values_are_one_line_and_create_nothing(tmp_path):
    for args, message in UNKNOWN:
        results = tmp_path / "results"
        proc = _run(results, args, timeout=60, KVBENCH_FAULT="model_load:1")
        _assert_one_line_refusal(proc, message, results)
        if "unknown" in message:  # the valid values are listed
            assert "batch_size" in proc.stderr and "engine.compile" in proc.stderr
        assert not results.exists(), sorted(results.rglob("*"))


def test_help_lists_every_top_level_value(tmp_path):
    """--help's list of top-level values is generated from conf/config.yaml: every value there is listed."""
    from omegaconf import OmegaConf

    from kvbench.config import CONF_DIR

    helped = _run(tmp_path / "results", ["--help"], timeout=60)
    assert helped.returncode == 0
    (line,) = [x for x in helped.stdout.splitlines() if x.startswith("Top-level values:")]
    listed = {v.strip() for v in line.partition(":")[2].split(",")}
    root = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))
    expected = {f"{k}.{sub}" if isinstance(v, dict) else k for k, v in root.items() if k != "defaults"
                for sub in (v if isinstance(v, dict) else [None])}
    assert expected == listed, (sorted(expected - listed), sorted(listed - expected))
    for name in ("question", "turns", "turn_history", "sliding_layers", "engine.compile", "strict", "plan"):
        assert name in listed


# ---- a corrupted record: one line pointing at store verify --clean, which sets it aside --------------------------
def test_a_corrupted_record_stops_the_run_in_one_line_and_verify_clean_sets_it_aside(tmp_path):
    assert _run(tmp_path, [*JOB, "print_table=false"]).returncode == 0
    job = _job_dir(tmp_path)
    (job / "scores.json").unlink()  # an unfinished job: the next run reads its records
    lines = (job / "samples.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:40] + "\x00garbage" + lines[1][60:]  # the middle record, corrupted in place
    (job / "samples.jsonl").write_text("".join(lines))
    before, logs_before = _checksums(tmp_path), sorted((tmp_path / "logs").rglob("*"))

    proc = _run(tmp_path, JOB, KVBENCH_FAULT="model_load:1")
    _assert_one_line_refusal(proc, "samples.jsonl line 2 is not a record", tmp_path)
    assert "python -m kvbench.store verify --clean" in proc.stderr
    assert _checksums(tmp_path) == before and sorted((tmp_path / "logs").rglob("*")) == logs_before
    plan = _run(tmp_path, [*JOB, "plan=true"], timeout=120)
    assert plan.returncode == 0 and "line 2 is not a record" in plan.stdout, plan.stdout + plan.stderr

    cleaned = subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--clean", "--results", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert "samples.corrupt.jsonl" in cleaned.stdout
    assert (job / "samples.corrupt.jsonl").read_text() == lines[1]  # set aside, not deleted
    assert len((job / "samples.jsonl").read_text().splitlines()) == 2
    resumed = _run(tmp_path, [*JOB, "print_table=false"])  # redoes the sample whose record was corrupted
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len((job / "samples.jsonl").read_text().splitlines()) == 3
    assert json.loads((job / "scores.json").read_text())["n_samples"] == 3


# ---- Ctrl-C: one line with the records kept, exit 130 ------------------------------------------------------------
def test_ctrl_c_during_a_run_is_one_line_saying_what_was_kept(tmp_path):
    import re
    import signal
    import time

    args = ["model=tiny-random", "task=passkey", "task.context_lengths=[256,384,512]",
            "task.depths=[0,10,20,30,40,50,60,70,80,90]", "method=h2o", "budget=64", "task.max_new_tokens=32",
            "print_table=false"]  # 30 samples: seconds of work after the first record
    # the run gets Ctrl-C's default disposition, as at a terminal: a test session started in the background of a
    # non-interactive shell (`.ci/run &`) ignores SIGINT, and an ignored SIGINT is inherited (Python then installs
    # no KeyboardInterrupt handler: the run finished all 30 samples and exited 0, twice, before this)
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.run", *args], env=_env(tmp_path), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline, samples = time.time() + 240, None
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").glob("*/*/*/*/*/samples.jsonl"))
        if found and found[0].read_text().count("\n") >= 1:
            samples = found[0]
            break
        time.sleep(0.02)
    assert samples is not None, "the job never wrote a record"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("h2o@64", "\r"))]
    lines = [line for line in lines if "sample/s" not in line and "it/s" not in line]  # tqdm's bar, when shown
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    kept = samples.read_text().count("\n")
    match = re.search(r"interrupted: (\d+) of 30 records are kept .* run the same command again to resume", lines[0])
    assert match and int(match.group(1)) == kept and kept < 30, lines[0]
    assert not (samples.parent / "scores.json").exists()


# ---- 5. report commands on a directory without runs ---------------------------------------------------------------
def test_report_commands_without_runs_say_so_and_exit_2(tmp_path, capsys):
    from kvbench.report.cli import main as report_main

    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    for results in (empty, missing):
        for command in (["tables"], ["figures"], ["all"], []):
            argv = [*command, "--results", str(results)]
            assert report_main(argv) == 2, argv
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert len(err) == 1 and err[0].startswith("error: ") and str(results) in err[0], (argv, err)
            assert "--paper-only" in err[0] or command in (["figures"], ["all"]), err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"], "a report created a directory"
        assert list(empty.iterdir()) == []
    # the papers' tables alone stay one explicit flag away
    assert report_main(["tables", "--paper-only", "--tables", "DynamicKV:2"]) == 0
    assert "DynamicKV" in capsys.readouterr().out


# ---- 3. a results directory that cannot be written: one line before anything -------------------------------------
def test_an_unwritable_results_directory_is_one_line_before_anything(tmp_path):
    """/sys refuses new files even to root (a read-only mount is the same to kvbench: the probe write fails)."""
    results = Path("/sys/kvbench-results-test")
    for args in (JOB, [*JOB, "plan=true"], ["-m", *JOB[:-2], "budget=64,96"]):
        proc = _run(results, args, timeout=60, KVBENCH_FAULT="model_load:1")
        _assert_one_line_refusal(proc, f"results directory {results} ", results)
        assert "KVBENCH_RESULTS_DIR" in proc.stderr


def test_the_write_probe_names_a_read_only_or_full_results_directory(tmp_path, monkeypatch):
    import errno
    import tempfile

    from kvbench.errors import DataError
    from kvbench.store import check_results_writable

    check_results_writable(tmp_path / "not" / "yet")  # a directory that does not exist yet: its parent is probed
    assert not (tmp_path / "not").exists() and list(tmp_path.iterdir()) == []
    for code, words in ((errno.EROFS, "is on a read-only file system"), (errno.ENOSPC, "has no space left")):
        def refuse(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
        with pytest.raises(DataError, match=f"results directory {tmp_path} {words}"):
            check_results_writable(tmp_path)


def test_store_verify_reads_a_store_it_cannot_write(tmp_path, monkeypatch, capsys):
    """verify only reads: probing a job's lock must not need write access (it opened .lock with 'a+': EROFS)."""
    import builtins
    import errno

    from kvbench.store import config_hash
    from kvbench.store.verify import main as verify_main

    job = tmp_path / "runs" / "m" / "t" / "me" / "64" / config_hash({"k": 1})[:12]
    job.mkdir(parents=True)
    (job / ".lock").touch()
    (job / "config.yaml").write_text("key: {k: 1}\n")
    (job / "samples.jsonl").write_text('{"id": "a"}\n')
    real_open = builtins.open

    def read_only(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    assert verify_main(["verify", "--results", str(tmp_path)]) == 0
    assert "incomplete" in capsys.readouterr().out  # records, no scores: resumable


# ---- 4. refusals that need no model happen before it loads -------------------------------------------------------
def test_a_locked_job_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import fcntl

    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import plan_job
    from kvbench.store import JobDir

    monkeypatch.setenv("KVBENCH_RESULTS_DIR", str(tmp_path))
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        job = plan_job(compose(config_name="config", overrides=JOB))
    jobdir = JobDir(tmp_path, job.parts, job.key)
    jobdir.path.mkdir(parents=True)
    with open(jobdir.path / ".lock", "a+") as held:  # another process's run of the same job
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = _run(tmp_path, JOB, timeout=60, KVBENCH_FAULT="model_load:1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "being run by another process" in lines[0], proc.stderr
    assert not (tmp_path / "logs").exists()


REFUSED_BEFORE_LOAD = [
    (["model=falcon-7b"], "is a 'falcon' model"),
    (["model=internlm2.5-7b-chat-1m"], "is a 'internlm2' model"),
    (["engine.compile=true", "method=sirllm", "method.entropy=official_code"],
     "engine.compile=true: method 'sirllm' has no captured decode step"),
]


def test_refusals_that_need_no_model_come_before_it_and_before_the_network(tmp_path):
    for args, message in REFUSED_BEFORE_LOAD:
        results = tmp_path / "results"
        # no network: a refusal that reached the hub would print retries and a connection error, not this line
        proc = _run(results, args, timeout=60, KVBENCH_FAULT="model_load:1", HF_HUB_OFFLINE="1",
                    HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
        _assert_one_line_refusal(proc, message, results)
        assert not results.exists(), sorted(results.rglob("*"))


def test_missing_task_data_without_the_hub_is_one_line_before_anything(tmp_path):
    """task=longbench with no local copy and no hub: one line, at once (no retries), before Hydra and the model."""
    import time

    results = tmp_path / "results"
    started = time.time()
    proc = _run(results, ["model=tiny-random", "task=longbench"], timeout=120, KVBENCH_FAULT="model_load:1",
                KVBENCH_CACHE_DIR=str(tmp_path / "cache"), HF_ENDPOINT="http://127.0.0.1:9")
    _assert_one_line_refusal(proc, "task 'longbench': could not download data.zip", results)
    assert "task.data_dir" in proc.stderr and "Retry" not in proc.stderr + proc.stdout
    assert time.time() - started < 30
    assert not results.exists(), sorted(results.rglob("*"))


HUB_TASKS = [("leval", "LEval/Exam/coursera.jsonl of the hub dataset L4NLP/LEval"),
             ("zeroscrolls", "gov_report.zip of the hub dataset tau/zero_scrolls"),
             ("infinitebench", "passkey.jsonl of the hub dataset xinrongzhang2022/InfiniteBench"),
             ("pg19", "the PG-19 test split from the hub dataset emozilla/pg19")]


@pytest.mark.parametrize(("task", "what"), HUB_TASKS, ids=[t for t, _ in HUB_TASKS])
def test_the_other_hub_tasks_without_the_hub_are_one_line_before_anything(tmp_path, task, what):
    """LEval, ZeroSCROLLS, InfiniteBench and PG-19 without local files and without the hub (an endpoint that refuses
    connections, an empty hub cache): kvbench's one line naming the task and task.data_dir, exit 2, at once (no hub
    retries), before Hydra and the model; nothing is created under the results root or in the caches."""
    import time

    results = tmp_path / "results"
    started = time.time()
    proc = _run(results, ["model=tiny-random", f"task={task}"], timeout=120, KVBENCH_FAULT="model_load:1",
                KVBENCH_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_CACHE=str(tmp_path / "hub"),
                HF_ENDPOINT="http://127.0.0.1:9")
    _assert_one_line_refusal(proc, f"task {task!r}: could not download {what} (127.0.0.1:9 cannot be reached", results)
    assert "task.data_dir" in proc.stderr and "Retry" not in proc.stderr + proc.stdout
    assert time.time() - started < 30
    assert sorted(tmp_path.iterdir()) == [], sorted(tmp_path.rglob("*"))


# ---- 7. the kill loop at sweep scale -------------------------------------------------------------------------------
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kill_resume_loop.py"


def _kill_loop():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kill_resume_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kill_loop_kills_the_whole_process_group(tmp_path):
    """A round's SIGKILL takes the process and everything it started (a sweep's submitit controller and workers):
    here a shell and its background sleep; none survives, and the round says so."""
    loop = _kill_loop()
    child = tmp_path / "child.pid"
    result = loop.run(["sh", "-c", f"sleep 120 & echo $! > {child}; wait"], tmp_path / "results", kill_after=2)
    assert result["killed"] and result["returncode"] == -9 and result["survivors"] == 0, result
    pid = int(child.read_text())
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the child survived the kill"
    assert loop.command(["task=passkey"], 2)[3:7] == ["-m", "launcher=local", "hydra.sweeper.max_workers=2",
                                                      "hydra.sweeper.jobs_per_worker=1"]
    assert "-m" not in loop.command(["task=passkey"], None)[3:]


@pytest.mark.slow
def test_the_kill_loop_on_a_two_worker_sweep(tmp_path):
    """scripts/kill_resume_loop.py --sweep --workers 2 --kills 1 on 2 tiny jobs end to end (minutes on 2 busy cores):
    the killed sweep resumed equals a clean sweep job by job, nothing survives the kill, store verify is clean."""
    out = tmp_path / "loop.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--sweep", "--workers", "2", "--kills", "1", "--out", str(out),
                           "--", "model=tiny-random", "task=passkey", "task.context_lengths=[256]",
                           "task.depths=[10,50]", "method=h2o,snapkv", "budget=64", "task.max_new_tokens=6"],
                          capture_output=True, text=True, timeout=1500, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["sweep"] and summary["workers"] == 2 and len(summary["jobs"]) == 2
    assert summary["killed_rounds"] == 1 and summary["identical"] and all(summary["checks"].values())
    assert summary["checks"]["no_process_survived_a_kill"] and summary["checks"]["same_records"]
    assert "1 kills of 2 jobs of a 2-worker sweep" in proc.stdout.splitlines()[-1]


# ---- the task's data is read once per run ---------------------------------------------------------------------------
COUNT_PREPARE = """
import sys
from kvbench.tasks.base import Task
calls = []
Task.prepare_data = lambda self: calls.append(id(self))
import runpy
sys.argv = ["kvbench.run", *sys.argv[1:]]
try:
    runpy.run_module("kvbench.run", run_name="__main__", alter_sys=True)  # as python -m kvbench.run
finally:
    print(f"prepare_data calls: {len(calls)}")
"""


def test_one_run_prepares_the_task_data_once(tmp_path):
    """kvbench.run's preflight prepares the job's data before Hydra (so missing data is refused before anything);
    the job it runs next uses that task instead of reading the data again (a passkey job: Task.prepare_data counted)."""
    proc = subprocess.run([sys.executable, "-c", COUNT_PREPARE, *JOB, "print_table=false"], capture_output=True,
                          text=True, timeout=300, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prepare_data calls: 1" in proc.stdout.splitlines(), proc.stdout[-2000:]
    assert json.loads((_job_dir(tmp_path) / "scores.json").read_text())["n_samples"] == 3


def test_run_job_prepares_again_for_another_task_config(tmp_path, monkeypatch):
    """run_job takes the caller's prepared task only for the same job and task config."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR
    from kvbench.jobs import plan_job, run_job
    from kvbench.jobs.runner import same_task
    from kvbench.tasks.base import Task

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*JOB, "print_table=false", f"paths.results_dir={tmp_path}"])
        other = compose(config_name="config", overrides=[*JOB, "task.seed=7", f"paths.results_dir={tmp_path}"])
    assert same_task(plan_job(cfg), plan_job(cfg)) and not same_task(plan_job(other), plan_job(cfg))
    calls = []
    monkeypatch.setattr(Task, "prepare_data", lambda self: calls.append(id(self)))
    run_job(cfg, prepared=plan_job(other))
    assert len(calls) == 1  # not the other job's task: prepared here
