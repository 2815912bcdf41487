"""Kill a job N times at random moments, resume it each time, and compare the result with a clean run (issue #8).

    python scripts/kill_resume_loop.py                                  # 20 kills, tiny random model, ~2 min
    python scripts/kill_resume_loop.py --kills 5 --out loop.json -- model=smollm2-135m task=passkey ...

Each round starts ``python -m kvbench.run <job>`` and sends it SIGKILL after a uniformly random delay in
``[--min-delay, --max-delay]`` seconds (default: from just before a clean run's first record to its end, so model
load, prefill, decode, record and score writing are all hit over the rounds); the next round resumes the killed job.
When a round reaches the end of the job, that run is checked and the next round starts it again from scratch. After
the last round the job is run to completion. Each resumed run is compared with one clean run of the same job: the same
sample ids, no duplicate or torn record, identical predictions and per-sample scores, identical ``scores.json`` apart
from timings, and ``python -m kvbench.store verify`` clean. Prints one verdict line and writes the rounds as JSON
(``--out``).
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


def run(job: list[str], results: Path, kill_after: float | None = None) -> dict:
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(results)}
    env.pop("KVBENCH_FAULT", None)
    cmd = [sys.executable, "-m", "kvbench.run", *job, "print_table=false"]
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_record = None
    try:
        if kill_after is None:  # a full run: note when the first record appears (the end of start-up)
            while proc.poll() is None:
                job = job_dir(results)
                if first_record is None and job is not None and (job / "samples.jsonl").exists():
                    first_record = time.time() - started
                time.sleep(0.02)
        proc.wait(timeout=kill_after)
        killed = False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = True
    stderr = proc.stderr.read() if proc.stderr else ""
    return {"killed": killed, "returncode": proc.returncode, "seconds": round(time.time() - started, 2),
            "first_record_s": first_record,
            "stderr_tail": stderr[-500:] if proc.returncode not in (0, -9) else ""}


def job_dir(results: Path) -> Path | None:
    found = list((results / "runs").glob("*/*/*/*/*/.lock"))
    return found[0].parent if found else None


def state(results: Path) -> dict:
    job = job_dir(results)
    if job is None:
        return {"records": 0, "torn_tail": False, "scores": False}
    samples = job / "samples.jsonl"
    data = samples.read_bytes() if samples.exists() else b""
    return {"records": data.count(b"\n"), "torn_tail": bool(data) and not data.endswith(b"\n"),
            "scores": (job / "scores.json").exists()}


def outcome(results: Path) -> dict:
    job = job_dir(results)
    data = (job / "samples.jsonl").read_bytes()
    records = [json.loads(line) for line in data.splitlines()]
    scores = json.loads((job / "scores.json").read_text())
    return {
        "hash": job.name,
        "ids": [r["id"] for r in records],
        "torn": not data.endswith(b"\n"),
        "per_sample": {r["id"]: [r["prediction"], r["score"]] for r in records},
        "scores": {k: v for k, v in scores.items() if "seconds" not in k and "ms" not in k},
    }


def check(clean: dict, results: Path) -> dict:
    """The resumed job in ``results`` against the clean run."""
    resumed = outcome(results)
    verify = subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--results", str(results)],
                            capture_output=True, text=True)
    return {
        "same_job_hash": clean["hash"] == resumed["hash"],
        "no_duplicates": len(resumed["ids"]) == len(set(resumed["ids"])),
        "same_ids": sorted(clean["ids"]) == sorted(resumed["ids"]),
        "no_torn_line": not resumed["torn"],
        "same_predictions_and_sample_scores": clean["per_sample"] == resumed["per_sample"],
        "same_scores_json": clean["scores"] == resumed["scores"],
        "store_verify_clean": verify.returncode == 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--min-delay", type=float, default=None,
                        help="seconds; default: 0.8 x the clean run's time to its first record (start-up)")
    parser.add_argument("--max-delay", type=float, default=None,
                        help="seconds; default: the clean run's duration (measured first)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the rounds and the verdict as JSON")
    parser.add_argument("job", nargs="*", help="kvbench.run overrides (after --); default: a tiny-random H2O job")
    args = parser.parse_args(argv)
    job = args.job or DEFAULT_JOB
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvbench-killloop-") as tmp:
        clean_dir, killed_dir = Path(tmp) / "clean", Path(tmp) / "killed"
        clean_run = run(job, clean_dir)
        if clean_run["returncode"] != 0:
            print(f"error: the clean run failed: {clean_run['stderr_tail']}", file=sys.stderr)
            return 2
        max_delay = args.max_delay or clean_run["seconds"]
        min_delay = args.min_delay if args.min_delay is not None else 0.8 * (clean_run["first_record_s"] or 0.0)
        clean = outcome(clean_dir)
        rounds, cycles = [], []
        for i in range(args.kills):
            delay = rng.uniform(min_delay, max_delay)
            result = run(job, killed_dir, kill_after=delay)
            rounds.append({"round": i + 1, "cycle": len(cycles) + 1, "kill_after_s": round(delay, 3), **result,
                           **state(killed_dir)})
            print(f"round {i + 1:2}: kill after {delay:6.2f} s -> {'killed' if result['killed'] else 'finished'}, "
                  f"{rounds[-1]['records']} records{', torn tail' if rounds[-1]['torn_tail'] else ''}", flush=True)
            if result["returncode"] not in (0, -9):
                print(f"error: round {i + 1} exited {result['returncode']}: {result['stderr_tail']}", file=sys.stderr)
                return 1
            if rounds[-1]["scores"]:  # the job got to the end: check this cycle, start the next one from scratch
                cycles.append(check(clean, killed_dir))
                shutil.rmtree(killed_dir)
        final = run(job, killed_dir)
        cycles.append({**check(clean, killed_dir), "final_run_ok": final["returncode"] == 0})
        checks = {name: all(c[name] for c in cycles if name in c) for name in cycles[-1]}
    killed = sum(r["killed"] for r in rounds)
    summary = {
        "job": job, "kills_requested": args.kills, "killed_rounds": killed,
        "rounds_that_finished_first": len(rounds) - killed,
        "torn_tails_seen": sum(r["torn_tail"] for r in rounds), "min_delay_s": round(min_delay, 2),
        "max_delay_s": round(max_delay, 2),
        "clean_run_s": clean_run["seconds"], "cycles": len(cycles), "checks": checks,
        "identical": all(checks.values()), "score": clean["scores"].get("score"),
        "rounds": rounds,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    verdict = "IDENTICAL to a clean run" if summary["identical"] else "DIFFERENT: " + ", ".join(
        k for k, v in checks.items() if not v)
    print(f"{killed} kills over {len(cycles)} resumed run(s) ({len(rounds) - killed} rounds finished before their "
          f"kill, {summary['torn_tails_seen']} torn tails seen): {verdict}")
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
