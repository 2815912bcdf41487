"""The sweeper (kvbench/sweep, hydra_plugins/kvbench_sweep): expansion, factorised composition equal to Hydra's,
worker chunks, store states and the listing, failure records; a real sweep through submitit's local executor; W&B
offline logging. The Slurm path is tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf, open_dict

from kvbench.config import CONF_DIR, register_resolvers
from kvbench.store import JobDir
from kvbench.sweep.plan import (
    NODE_GROUPS,
    SweepJob,
    expand,
    format_listing,
    make_chunks,
    override_value,
    store_state,
)

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model=tiny-random", "task=needle_chat", "task.context_lengths=[300]", "task.depths=[50]",
         "task.max_new_tokens=4", "print_table=false"]


def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


# ---- expansion -----------------------------------------------------------------------------------------------------
def test_override_values_in_hydra_syntax():
    assert override_value([2, 8, 18]) == "[2,8,18]"
    assert override_value(["lcc", "repobench-p"]) == "[lcc,repobench-p]"
    assert override_value(["a b"]) == "['a b']"
    assert override_value(0.9765625) == "0.9765625" and override_value(None) == "null"
    assert override_value(False) == "false" and override_value("a,b") == "a,b"


def test_blocks_are_products_of_params_and_the_command_line_wins():
    params = {"model": "m1,m2", "budget": "64"}
    blocks = [{"method": "fullkv"}, {"method": "snapkv", "method.kernel": 7, "budget": "64,128"}]
    jobs = expand(params, blocks, ["limit=2"], _parser())
    assert jobs == [
        ["model=m1", "budget=64", "method=fullkv", "limit=2"], ["model=m2", "budget=64", "method=fullkv", "limit=2"],
        ["model=m1", "budget=64", "method=snapkv", "method.kernel=7", "limit=2"],
        ["model=m1", "budget=128", "method=snapkv", "method.kernel=7", "limit=2"],
        ["model=m2", "budget=64", "method=snapkv", "method.kernel=7", "limit=2"],
        ["model=m2", "budget=128", "method=snapkv", "method.kernel=7", "limit=2"],
    ]
    assert expand(params, None, ["model=tiny"], _parser()) == [["model=tiny", "budget=64"]]


# ---- composition ---------------------------------------------------------------------------------------------------
def test_model_method_task_configs_stay_in_their_package():
    """The factorised composition relies on it (kvbench.sweep.plan.NODE_GROUPS)."""
    for group in NODE_GROUPS:
        for path in (CONF_DIR / group).glob("*.yaml"):
            text = path.read_text()
            assert "@package" not in text, path
            for entry in (yaml.safe_load(text) or {}).get("defaults", []):
                assert entry == "_self_" or (isinstance(entry, str) and (CONF_DIR / group / f"{entry}.yaml").exists())


@pytest.fixture(scope="module")
def hydra_loader(tmp_path_factory):
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kvbench.sweep.pending import register_pending_placeholders

    register_resolvers()
    register_pending_placeholders()
    os.environ["KVBENCH_RESULTS_DIR"] = str(tmp_path_factory.mktemp("store"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def test_factorised_composition_equals_hydras(hydra_loader):
    """Every kind of job the experiments hold (inherited params, per-block method fields, list values, a body that
    sets model fields, pending placeholders, ++ on a placeholder) composes exactly as Hydra's load_sweep_config."""
    from kvbench.sweep.plan import Composer

    composer = Composer(hydra_loader, "config")
    for name, picks in (("pod_table1", (0, 7, 14, 19)), ("pod_table3", (29,)), ("d2o_table7", (0, 5)),
                        ("omnikv_table6", (0, 4, 7))):
        frame = [f"+experiment={name}"]
        master = composer.full_config(frame)
        jobs = expand(master.hydra.sweeper.params, master.hydra.sweeper.blocks, frame, composer.parser)
        composer.prefetch([jobs[i] for i in picks])
        for overrides in (jobs[i] for i in picks):
            mine = OmegaConf.to_container(composer.compose(overrides), resolve=True)
            theirs = hydra_loader.load_sweep_config(master, list(overrides))
            with open_dict(theirs):
                del theirs["hydra"]
            theirs = OmegaConf.to_container(theirs, resolve=True)
            assert mine == theirs, (name, overrides)


# ---- chunks --------------------------------------------------------------------------------------------------------
def _job(model: str, n: int) -> SweepJob:
    return SweepJob([f"x={n}"], model, "snapkv", "128", "needle", status="missing", model_key=model)


def test_chunks_share_a_model_and_fold_into_workers():
    jobs = [_job("a", 0), _job("b", 1), _job("a", 2), _job("a", 3), _job("b", 4)]
    ids = lambda chunks: [[j.overrides[0] for j in c] for c in chunks]  # noqa: E731
    assert ids(make_chunks(jobs, None, None)) == [["x=0", "x=2", "x=3"], ["x=1", "x=4"]]
    assert ids(make_chunks(jobs, 2, None)) == [["x=0", "x=2"], ["x=3"], ["x=1", "x=4"]]
    # one worker (launcher=local on a CPU): everything, each model's jobs together, the biggest chunk first
    assert ids(make_chunks(jobs, 2, 1)) == [["x=0", "x=2", "x=1", "x=4", "x=3"]]
    assert ids(make_chunks(jobs, 1, 2)) == [["x=0", "x=3", "x=4"], ["x=2", "x=1"]]
    with pytest.raises(ValueError, match="jobs_per_worker"):
        make_chunks(jobs, 0, None)


# ---- store states, listing, failure records --------------------------------------------------------------------------
def test_store_states_and_the_listing(tmp_path):
    def jobdir(n):
        return JobDir(tmp_path, ("m", "t", "meth", "128"), {"n": n})

    missing, finished, other_limit, failed, partial, running = (jobdir(i) for i in range(6))
    finished.path.mkdir(parents=True)
    finished.write_scores({"limit": 2, "score": 1.0})
    other_limit.path.mkdir(parents=True)
    other_limit.write_scores({"limit": None, "score": 1.0})
    failed.write_failure({"kind": "exception", "error": "RuntimeError: boom", "host": "h", "time": "t0"})
    partial.path.mkdir(parents=True)
    partial.append_record({"id": "a"})
    partial.append_record({"id": "b"})
    states = {name: store_state(d, 2)[:2] for name, d in
              (("missing", missing), ("finished", finished), ("other", other_limit), ("failed", failed),
               ("partial", partial))}
    assert states == {"missing": ("missing", ""), "finished": ("finished", ""), "other": ("missing", ""),
                      "failed": ("failed", "exception: RuntimeError: boom on h at t0"),
                      "partial": ("partial", "2 samples done; resumes")}
    with running:
        assert store_state(running, 2)[0] == "running"
    assert store_state(running, 2)[0] == "missing"
    failed.write_scores({"limit": 2, "score": 0.5})
    assert failed.read_failure() is None and store_state(failed, 2)[0] == "finished"

    jobs = [SweepJob(["method=cam"], "m", "cam", "0.2", "needle", status="unavailable",
                     detail="method 'cam' is configured but not implemented yet"),
            SweepJob(["method=snapkv"], "m", "snapkv", "128", "needle", status="failed", hash="ab" * 32,
                     detail="exception: RuntimeError: boom")]
    listing = format_listing(jobs, "t")
    assert listing.splitlines()[0] == "t: 2 planned jobs (1 failed (will rerun), 1 not available yet)"
    assert "not available yet: method 'cam'" in listing and "abababababab" in listing and "RuntimeError" in listing


def test_a_job_plans_from_its_composed_config(hydra_loader):
    """What ``plan=true`` prints for a single run (kvbench.run._hydra_main): the job's row, nothing run."""
    from kvbench.sweep.plan import Composer, plan_config

    cfg = Composer(hydra_loader, "config").compose([*SMALL, "method=h2o", "budget=64", "plan=true"])
    job = plan_config(cfg)
    assert (job.model, job.method, job.budget, job.task) == ("tiny-random", "h2o", "64", "needle")
    assert job.status == "missing"
    assert job.path.parent == Path(os.environ["KVBENCH_RESULTS_DIR"]) / "runs/tiny-random/needle/h2o/64"
    assert "1 planned jobs (1 to run)" in format_listing([job]) and not job.path.exists()


# ---- a real sweep through submitit's local executor ------------------------------------------------------------------
def _kvbench(args, tmp_path, timeout=300, env=None):
    """python -m kvbench.run from the repository root (so this checkout's kvbench and hydra_plugins are found)."""
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path / "results"), "PYTHONPATH": str(REPO), **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def test_local_launcher_sweep_loads_once_and_isolates_failures(tmp_path):
    """4 jobs (2 methods x a good and a corrupt haystack) on CPU: one worker runs them all serially with one model
    load; the corrupt ones fail with their cause recorded, the others finish; the sweep exits 1 and says so."""
    bad = tmp_path / "bad-haystack"
    bad.mkdir()
    (bad / "essay.txt").write_bytes(b"\xff\xfe not utf-8 \xfa")
    sweep = ["-m", *SMALL, "launcher=local", "method=snapkv,streamingllm", "budget=64", "limit=1"]
    started = time.time()
    first = _kvbench([*sweep, f"task.haystack_dir=null,{bad}"], tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    out = first.stdout
    assert "4 planned jobs (4 to run)" in out and "launching 1 worker(s) for 4 job(s)" in out
    assert "sweep summary: 2 succeeded, 0 skipped (finished earlier), 2 failed, 0 not run" in out
    assert out.count("failed: tiny-random needle") == 2 and "UnicodeDecodeError" in out

    runs = tmp_path / "results" / "runs" / "tiny-random" / "needle"
    finished = sorted(runs.glob("*/64/*/scores.json"))
    failures = [json.loads(p.read_text()) for p in sorted(runs.glob("*/64/*/failed.json"))]
    assert len(finished) == 2 and len(failures) == 2
    assert all(f["kind"] == "exception" and f["error"].startswith("UnicodeDecodeError") and f["host"]
               and "Traceback" in f["traceback"] for f in failures)
    (record_path,) = (tmp_path / "results" / "logs" / "multiruns").glob("*/.kvbench/workers/0000.json")
    record = json.loads(record_path.read_text())
    assert [m["model"] for m in record["models"]] == ["tiny-random"]  # loaded once for the 4 jobs
    assert [o["status"] for o in record["outcomes"]].count("succeeded") == 2
    meta = json.loads((finished[0].parent / "meta.json").read_text())
    assert meta["model"]["shared_load"] is True
    print(f"local launcher sweep: {time.time() - started:.1f} s")  # resubmission: tests/test_slurm.py


# ---- W&B -------------------------------------------------------------------------------------------------------------
def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (run-*.wandb): a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks (4-byte checksum, 2-byte length, 1-byte type: full / first / middle / last) carry protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            pos += left - 7 - length
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_logger_offline_logs_scores_efficiency_and_samples(tmp_path, hydra_loader, monkeypatch):
    from kvbench.jobs import run_job
    from kvbench.sweep.plan import Composer

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # and no API key: offline
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = Composer(hydra_loader, "config").compose(
        ["model=tiny-random", "task=passkey", "task.context_lengths=[256]", "task.depths=[10,50]", "method=snapkv",
         "budget=64", "logger=wandb", "sweep_name=table9", "print_table=false", f"paths.results_dir={tmp_path}"])
    assert cfg.logger.mode == "offline"
    run_job(cfg)
    (run_file,) = (tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    (scores_file,) = (tmp_path / "runs").glob("*/*/*/*/*/scores.json")
    scores = json.loads(scores_file.read_text())
    records = wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "table9" and run.display_name == "tiny-random/passkey/snapkv/64"
    logged = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            logged.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    assert logged["scores/score"] == scores["score"] and logged["scores/n_samples"] == 2
    assert logged["scores/grid/256/10"] == scores["grid"]["256"]["10"]
    assert logged["efficiency/resident_kv_bytes_mean"] == scores["resident_kv_bytes_mean"] == 4 * 2 * 64 * 16 * 2 * 4
    assert logged["efficiency/decode_ms_per_token"] == pytest.approx(scores["decode_ms_per_token"])
    assert logged["samples/nrows"] == 2 and logged["samples/ncols"] >= 8
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["job_hash"] == json.loads((scores_file.parent / "meta.json").read_text())["job_hash"]
    assert config["key"]["method"]["name"] == "snapkv" and config["resolved"]["sweep_name"] == "table9"
