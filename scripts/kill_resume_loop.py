"""Kill a job (or a sweep) N times at random moments, resume it each time, and compare the result with a clean run
(issues #8 and #38).

    python scripts/kill_resume_loop.py                                  # 20 kills, tiny random model, ~2 min
    python scripts/kill_resume_loop.py --kills 5 --out loop.json -- model=smollm2-135m task=passkey ...
    python scripts/kill_resume_loop.py --sweep --workers 2 --kills 5    # a 2-worker local sweep, SmolLM2, minutes

Each round starts ``python -m kvbench.run <job>`` in its own process group and sends the whole group SIGKILL after a
uniformly random delay in ``[--min-delay, --max-delay]`` seconds (default: from just before a clean run's first
record to its end, so model load, prefill, decode, record and score writing are all hit over the rounds); the next
round resumes the killed job. When a round reaches the end of the job, that run is checked and the next round starts
it again from scratch. After the last round the job is run to completion. Each resumed run is compared with one
clean run of the same job: the same job directories, the same sample ids, no duplicate or torn record, identical
records and ``scores.json`` apart from timings (``*seconds*`` keys), the same files in each job directory, and
``python -m kvbench.store verify`` clean. Prints one verdict line and writes the rounds as JSON (``--out``).

``--sweep`` runs the overrides as a sweep (``python -m kvbench.run -m launcher=local
hydra.sweeper.max_workers=<--workers> hydra.sweeper.jobs_per_worker=1 ...``; default: 4 methods x 3 passkey samples
on the embedded SmolLM2, one thread per worker): the kill takes the driver, submitit's controller and every worker
(they share the driver's process group, and the round checks that none survives), and every job of the sweep is
compared. A resumed sweep often finishes before its drawn moment, so with ``--sweep`` the loop runs until ``--kills``
kills have landed (at most 3 x ``--kills`` rounds); without it ``--kills`` counts rounds, as before.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_JOB = ["model=tiny-random", "task=passkey", "task.context_lengths=[256,384,512]",
               "task.depths=[0,20,40,60,80,100]", "method=h2o", "budget=64", "task.max_new_tokens=16"]
DEFAULT_SWEEP = ["model=smollm2-135m", "task=passkey", "task.context_lengths=[256]", "task.depths=[0,50,100]",
                 "method=h2o,snapkv,streamingllm,fullkv", "budget=64", "task.max_new_tokens=8"]


def command(job: list[str], workers: int | None) -> list[str]:
    """``python -m kvbench.run`` for one job, or (``workers``) for a local sweep of that many workers."""
    sweep = ["-m", "launcher=local", f"hydra.sweeper.max_workers={workers}", "hydra.sweeper.jobs_per_worker=1"]
    return [sys.executable, "-m", "kvbench.run", *(sweep if workers else []), *job, "print_table=false"]


def run(cmd: list[str], results: Path, kill_after: float | None = None) -> dict:
    """One round: ``cmd`` in a new process group, killed (the whole group, SIGKILL) after ``kill_after`` seconds."""
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(results)}
    env.pop("KVBENCH_FAULT", None)
    if "-m" in cmd[3:]:  # kvbench.run's own -m (a sweep), not python's -m before the module name
        env.setdefault("OMP_NUM_THREADS", "1")  # one thread per worker: workers x threads <= cores
    started = time.time()
    first_record = None
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: a chatty run never blocks on it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                start_new_session=True)
        try:
            if kill_after is None:  # a full run: note when the first record appears (the end of start-up)
                while proc.poll() is None:
                    if first_record is None and any((j / "samples.jsonl").exists() for j in job_dirs(results)):
                        first_record = time.time() - started
                    time.sleep(0.02)
            proc.wait(timeout=kill_after)
            killed = False
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group ended just now
                pass
            proc.wait()
            killed = True
        survivors = wait_group_gone(proc.pid) if killed else 0
        stderr.seek(0)
        text = stderr.read()
    return {"killed": killed, "returncode": proc.returncode, "seconds": round(time.time() - started, 2),
            "first_record_s": first_record, "survivors": survivors,
            "stderr_tail": text[-500:] if proc.returncode not in (0, -9) else ""}


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, read from /proc (empty where there is none)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def wait_group_gone(pgid: int, timeout: float = 30.0) -> int:
    """How many processes of the killed group are still alive after ``timeout`` s (0: the workers died too)."""
    deadline = time.time() + timeout
    while (members := group_members(pgid)) and time.time() < deadline:
        time.sleep(0.1)
    return len(members)


def survived(count: int) -> str:
    return f", {count} processes survived the kill" if count else ""


def job_dirs(results: Path) -> list[Path]:
    return sorted(p.parent for p in (results / "runs").glob("*/*/*/*/*/.lock"))


def state(results: Path) -> dict:
    jobs = job_dirs(results)
    data = [(j / "samples.jsonl").read_bytes() if (j / "samples.jsonl").exists() else b"" for j in jobs]
    return {"records": sum(d.count(b"\n") for d in data), "torn_tail": any(d and not d.endswith(b"\n") for d in data),
            "finished_jobs": sum((j / "scores.json").exists() for j in jobs)}


def untimed(row: dict) -> dict:
    """A record or scores.json without its timings (the only values two runs of a job may differ in)."""
    return {k: v for k, v in row.items() if "seconds" not in k and "ms" not in k}


def outcome(job: Path) -> dict:
    data = (job / "samples.jsonl").read_bytes()
    records = [json.loads(line) for line in data.splitlines()]
    scores = json.loads((job / "scores.json").read_text()) if (job / "scores.json").exists() else None
    return {
        "ids": [r["id"] for r in records],
        "torn": not data.endswith(b"\n"),
        "per_sample": {r["id"]: [r["prediction"], r["score"]] for r in records},
        "records": [untimed(r) for r in records],
        "scores": untimed(scores) if scores is not None else None,
        "files": sorted(p.name for p in job.iterdir()),
    }


def outcomes(results: Path) -> dict[str, dict]:
    """Every job of ``results`` by its directory under ``runs/`` (model/task/method/budget/hash)."""
    return {str(job.relative_to(results / "runs")): outcome(job) for job in job_dirs(results)}


def check(clean: dict[str, dict], results: Path) -> dict:
    """The resumed jobs in ``results`` against the clean run's."""
    resumed = outcomes(results)
    pairs = [(clean[k], resumed[k]) for k in clean if k in resumed]
    verify = subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--results", str(results)],
                            capture_output=True, text=True)
    return {
        "same_jobs": sorted(clean) == sorted(resumed),
        "no_duplicates": all(len(r["ids"]) == len(set(r["ids"])) for _, r in pairs),
        "same_ids": all(sorted(c["ids"]) == sorted(r["ids"]) for c, r in pairs),
        "no_torn_line": not any(r["torn"] for _, r in pairs),
        "same_predictions_and_sample_scores": all(c["per_sample"] == r["per_sample"] for c, r in pairs),
        "same_records": all(c["records"] == r["records"] for c, r in pairs),
        "same_scores_json": all(c["scores"] == r["scores"] for c, r in pairs),
        "same_files": all(c["files"] == r["files"] for c, r in pairs),
        "store_verify_clean": verify.returncode == 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="run the overrides as a local multi-worker sweep")
    parser.add_argument("--workers", type=int, default=2, help="with --sweep: hydra.sweeper.max_workers")
    parser.add_argument("--min-delay", type=float, default=None,
                        help="seconds; default: 0.8 x the clean run's time to its first record (start-up)")
    parser.add_argument("--max-delay", type=float, default=None,
                        help="seconds; default: the clean run's duration (measured first)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the rounds and the verdict as JSON")
    parser.add_argument("job", nargs="*", help="kvbench.run overrides (after --); default: a tiny-random H2O job, "
                        "or with --sweep 4 methods on SmolLM2")
    args = parser.parse_args(argv)
    if args.kills < 1 or args.workers < 1:
        print(f"error: --kills and --workers must be >= 1; got {args.kills} and {args.workers}", file=sys.stderr)
        return 2
    job = args.job or (DEFAULT_SWEEP if args.sweep else DEFAULT_JOB)
    cmd = command(job, args.workers if args.sweep else None)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvbench-killloop-") as tmp:
        clean_dir, killed_dir = Path(tmp) / "clean", Path(tmp) / "killed"
        clean_run = run(cmd, clean_dir)
        if clean_run["returncode"] != 0:
            print(f"error: the clean run failed: {clean_run['stderr_tail']}", file=sys.stderr)
            return 2
        max_delay = args.max_delay or clean_run["seconds"]
        min_delay = args.min_delay if args.min_delay is not None else 0.8 * (clean_run["first_record_s"] or 0.0)
        clean = outcomes(clean_dir)
        rounds, cycles = [], []

        def more() -> bool:
            if not args.sweep:
                return len(rounds) < args.kills
            return sum(r["killed"] for r in rounds) < args.kills and len(rounds) < 3 * args.kills

        while more():
            i = len(rounds)
            delay = rng.uniform(min_delay, max_delay)
            result = run(cmd, killed_dir, kill_after=delay)
            rounds.append({"round": i + 1, "cycle": len(cycles) + 1, "kill_after_s": round(delay, 3), **result,
                           **state(killed_dir)})
            done = rounds[-1]["finished_jobs"] == len(clean)
            print(f"round {i + 1:2}: kill after {delay:6.2f} s -> {'killed' if result['killed'] else 'finished'}, "
                  f"{rounds[-1]['records']} records, {rounds[-1]['finished_jobs']}/{len(clean)} jobs finished"
                  f"{', torn tail' if rounds[-1]['torn_tail'] else ''}"
                  f"{survived(result['survivors'])}", flush=True)
            if result["returncode"] not in (0, -9):
                print(f"error: round {i + 1} exited {result['returncode']}: {result['stderr_tail']}", file=sys.stderr)
                return 1
            if done:  # the job (every job of the sweep) got to the end: check it, start again from scratch
                cycles.append(check(clean, killed_dir))
                shutil.rmtree(killed_dir)
        final = run(cmd, killed_dir)
        cycles.append({**check(clean, killed_dir), "final_run_ok": final["returncode"] == 0})
        checks = {name: all(c[name] for c in cycles if name in c) for name in cycles[-1]}
        checks["no_process_survived_a_kill"] = not any(r["survivors"] for r in rounds)
    killed = sum(r["killed"] for r in rounds)
    summary = {
        "job": job, "command": cmd[1:], "sweep": args.sweep, "workers": args.workers if args.sweep else None,
        "jobs": sorted(clean), "kills_requested": args.kills, "killed_rounds": killed,
        "rounds_that_finished_first": len(rounds) - killed,
        "torn_tails_seen": sum(r["torn_tail"] for r in rounds), "min_delay_s": round(min_delay, 2),
        "max_delay_s": round(max_delay, 2),
        "clean_run_s": clean_run["seconds"], "cycles": len(cycles), "checks": checks,
        "identical": all(checks.values()),
        "scores": {name: (o["scores"] or {}).get("score") for name, o in clean.items()},
        "rounds": rounds,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    verdict = "IDENTICAL to a clean run" if summary["identical"] else "DIFFERENT: " + ", ".join(
        k for k, v in checks.items() if not v)
    what = f"{len(clean)} jobs of a {args.workers}-worker sweep" if args.sweep else "1 job"
    print(f"{killed} kills of {what} over {len(cycles)} resumed run(s) ({len(rounds) - killed} rounds finished "
          f"before their kill, {summary['torn_tails_seen']} torn tails seen): {verdict}")
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
