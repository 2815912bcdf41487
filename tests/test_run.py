"""The command line: composition of the real configs, one-line errors before any model loads, a real job on the
tiny random model, skipping finished jobs, and resuming a job killed with SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.config import CONF_DIR, register_resolvers
from kvbench.errors import ConfigError
from kvbench.jobs import plan_job

TINY = ["model=tiny-random", "task=passkey", "task.context_lengths=[256]", "task.depths=[10,50,90]"]


def _run(args, tmp_path, timeout=600, **kw):
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path / "results")}
    return subprocess.run([sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, **kw)


def _compose(overrides, hydra_config=False):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_config)


# ---- composition --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fullkv", "streamingllm", "snapkv", "pyramidkv", "h2o"])
@pytest.mark.parametrize("task", ["needle", "passkey", "2stageretr"])
def test_every_implemented_method_and_task_plans(method, task):
    job = plan_job(_compose([f"method={method}", f"task={task}", "budget=128"]))
    assert job.parts == ("smollm2-135m", job.task.name, method, "full" if method == "fullkv" else "128")


def test_every_model_config_plans():
    from kvbench.models import spec_from_config

    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        cfg = _compose([f"model={path.stem}"])
        assert spec_from_config(dict(cfg.model)).name


def test_results_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_RESULTS_DIR", str(tmp_path))
    assert _compose([]).paths.results_dir == str(tmp_path)


def test_job_key_ignores_limit_and_paths_but_not_protocol():
    a = plan_job(_compose(["limit=2"]))
    b = plan_job(_compose(["limit=5", "paths.results_dir=/elsewhere"]))
    c = plan_job(_compose(["task.max_new_tokens=7"]))
    assert a.key == b.key and a.key != c.key


def test_experiment_and_launchers_compose():
    cfg = _compose(["+experiment=cpu_baselines"], hydra_config=True)
    assert cfg.hydra.sweeper.params.method.startswith("fullkv")
    expected = {"basic": "BasicLauncher", "local": "LocalLauncher", "slurm": "SlurmLauncher"}
    for launcher, target in expected.items():
        assert _compose([f"launcher={launcher}"], hydra_config=True).hydra.launcher._target_.endswith(target)


# ---- bad input: one line, exit 2, nothing written, fast ------------------------------------------------------------
BAD = [
    (["method=snapkvv"], "unknown method 'snapkvv'"),
    (["task=neddle"], "unknown task 'neddle'"),
    (["model=llama9"], "unknown model 'llama9'"),
    (["budget=0"], "budget=0"),
    (["budget=-3"], "budget=-3"),
    (["budget=1.5"], "budget=1.5"),
    (["budget=16"], "budget=16 is below the minimum 33"),
    # every malformed form names the value and the valid forms (kvbench.budget.parse_budget, the one parse)
    (["budget=abc"], "budget='abc' is not a number; valid: tokens per layer as an integer >= 1 (e.g. 128), a ratio "
                     "of the prompt length in (0, 1) (e.g. 0.2), or full"),
    (["budget=1.0"], "budget=1.0 is a ratio >= 1 (tokens per layer are written as an integer); valid: "),
    (["method=streamingllm", "method.sink_size=64", "budget=64"],
     "budget=64 is below the minimum 65 tokens per layer of method 'streamingllm' (sink_size=64 sinks + at least one "
     "recent token)"),
    (["method=streamingllm", "method.variant=kvfactory", "method.window=64", "budget=64"],
     "budget=64 is below the minimum 65 tokens per layer of method 'streamingllm'"),
    (["-m", "budget=64,abc"], "budget='abc' is not a number; valid: "),
    (["-m", "budget=abc,0,64,1.5"], "budget='abc' is not a number; valid: tokens per layer as an integer >= 1 "
                                    "(e.g. 128), a ratio of the prompt length in (0, 1) (e.g. 0.2), or full; "
                                    "budget=0 must be > 0; valid: "),
    (["method=pyramidkv", "budget=4"], "budget=4 is below"),
    (["method=sirllm", "method.decay_ratio=0"], "method 'sirllm': decay_ratio=0 must be in (0, 1]"),
    (["task=infinitebench", "task.data_dir=/nonexistent/infinitebench"], "/nonexistent/infinitebench"),
    (["task=infinitebench", "task.datasets=[passkey,kv_retrival]"], "kv_retrival"),
    (["method=snapkvv", "model=llama9"], "unknown method 'snapkvv'; valid methods: "),
    (["task=longbench", "task.data_dir=/nonexistent/longbench"], "/nonexistent/longbench"),
    (["method=cam", "method.variant=decode"], "variant='decode' is not valid; valid: paper, prefill_only"),
    (["method=d2o", "method.beta=1.5"], "beta"),
    (["method.pooling=median"], "pooling='median'"),
    (["+method.windw=3"], "windw"),
    (["model.dtype=float8"], "float8"),
    (["model.source=gguf", "model.path=/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["batch_size=0"], "batch_size=0"),
    (["task.haystack_dir=/nonexistent/essays"], "haystack_dir='/nonexistent/essays'"),
    (["limit=0"], "limit=0"),
    (["position_mode=shifted"], "position_mode='shifted'"),
    (["method=omnikv", "batch_size=2"], "method 'omnikv' is defined per sequence; use batch_size=1 (got 2)"),
    (["method=offload"], "method 'offload' needs the model on a CUDA device"),
    (["model.source=hf", "model.path=/nonexistent/ckpt"], "model path '/nonexistent/ckpt' does not exist"),
    (["task=leval", "task.datasets=[nope]"], "datasets ['nope'] are not LEval datasets (valid: coursera"),
    (["method=pod", "method.block_map=/nonexistent/map.json"], "block_map='/nonexistent/map.json' cannot be read"),
    (["method=lococo"], "method 'lococo'"),
    (["task=zeroscrolls", "task.data_dir=/nonexistent/zs"], "data_dir='/nonexistent/zs' is not a directory"),
    (["method=h2o", "method.recent_ratio=1.5"], "recent_ratio=1.5 must be in (0, 1)"),
    (["seed=abc"], "seed='abc' must be an integer"),
    # decode compression inside the captured step takes fixed targets only (a ratio grows with the tokens seen)
    (["engine.decode=graph", "budget=0.2", "method.decode_compression.interval=64"],
     "engine.decode=graph: method 'snapkv' compresses during decode (decode_compression) and budget=0.2 is a ratio"),
    # a field the chosen method/model/task lacks: Hydra's multi-line struct error (exit 1) without the precheck
    (["method.nosuchfield=3"], "method 'snapkv' has no field nosuchfield; valid fields: decode_compression, "
                               "granularity, group_agg, kernel, pooling, window"),
    (["+method.nosuchfield=3"], "method 'snapkv' has no field(s) nosuchfield; valid fields: decode_compression, "
                                "granularity, group_agg, kernel, pooling, window"),
    (["method=h2o", "~method.nosuch"], "method 'h2o' has no field nosuch; valid fields: "),
    (["+method.window=3"], "method 'snapkv' already has field window; set it without the '+' (method.window=...)"),
    (["-m", "method=h2o,fullkv", "method.window=16"], "method 'fullkv' has no field window; valid fields: (none)"),
    (["model.nosuchkey=1"], "model 'smollm2-135m' has no field nosuchkey; valid fields: attn_implementation, "),
    (["model=tiny-random", "model.tiny.nosuch=1"], "model 'tiny-random' has no field tiny.nosuch; valid fields of "
                                                   "tiny: head_dim, heads, "),
    (["task.nosuchkey=1"], "task 'needle_chat' has no field nosuchkey; valid fields: buffer_tokens, "),
    (["task=passkey", "+task.nosuchkey=1"], "task 'passkey' has no field(s) nosuchkey; valid fields: "),
    (["-m", "+experiment=cpu_baselines", "task.nosuch=1"], "task 'needle_chat' has no field nosuch; valid fields: "),
    # a value of the wrong type names the field and its type (issue #38: window=abc compared str with int, window=1.5
    # ran and failed on every sample)
    (["method.window=abc"], "method 'snapkv': window='abc' must be an integer (window: int)"),
    (["method.window=1.5"], "method 'snapkv': window=1.5 must be an integer (window: int)"),
    (["method=h2o", "method.recent_ratio=abc"], "method 'h2o': recent_ratio='abc' must be a number (recent_ratio: "
                                                "float)"),
    (["method=cla", "method.allow_untrained=yes"], "allow_untrained='yes' must be true or false"),
    (["task=passkey", "task.max_new_tokens=2.5"], "task 'passkey': max_new_tokens=2.5 must be an integer"),
    # a ratio below the method's minimum even on the model's longest prompt, refused like budget=16 (no model loads)
    (["budget=0.0000001"], "budget=1e-07 resolves to 1 token per layer even on the longest prompt model "
                           "'smollm2-135m' takes (8192 tokens), below the minimum 33 tokens per layer of method "
                           "'snapkv' (the observation window of 32 tokens is part of the budget)"),
]


#: runs ``kvbench.run`` as ``python -m kvbench.run`` does (``runpy``, fresh module globals) for each single-job case of
#: BAD in one process, one after another, each with its own results directory and captured stdout / stderr: one Python
#: start-up and one import of torch for all of them instead of one each (55 processes took ~170 s of the suite).
#: Before each case the warnings' "already shown" registries are reset (a filter mutation), so a case prints a
#: warning as it would in a process of its own. Sweeps (-m, experiments) still run in their own process.
BATCH_DRIVER = r"""
import contextlib, io, json, os, runpy, sys, warnings

cases, results = json.loads(sys.argv[1]), []
for index, (args, results_dir) in enumerate(cases):
    print(f"case {index}: {' '.join(args)}", file=sys.__stderr__, flush=True)
    os.environ["KVBENCH_RESULTS_DIR"] = results_dir
    sys.argv = ["kvbench.run", *args]
    warnings.simplefilter("default", Warning, append=True)  # mutates the filters: shown-once registries reset
    warnings.onceregistry.clear()
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("kvbench.run", run_name="__main__", alter_sys=True)  # as python -m kvbench.run
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def _sweep(args) -> bool:
    return any(a in ("-m", "--multirun") or a.lstrip("+").startswith("experiment=") for a in args)


@pytest.fixture(scope="module")
def bad_outcomes(tmp_path_factory) -> dict[str, dict]:
    """``{case id: {code, stdout, stderr, results}}`` for every single-job case of BAD, all run in one process with
    ``KVBENCH_FAULT=model_load:1`` (a case that reached the model's loading kills the whole process: exit -9, and the
    last ``case N`` line on stderr names it)."""
    root = tmp_path_factory.mktemp("bad")
    cases = [(a, str(root / str(i) / "results")) for i, (a, _) in enumerate(BAD) if not _sweep(a)]
    env = {**os.environ, "KVBENCH_FAULT": "model_load:1"}
    proc = subprocess.run([sys.executable, "-c", BATCH_DRIVER, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = json.loads(proc.stdout.splitlines()[-1])
    return {" ".join(a): {**o, "results": Path(r)} for (a, r), o in zip(cases, outcomes)}


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_clear_line(tmp_path, args, message, monkeypatch, bad_outcomes):
    if _sweep(args):  # a process of its own
        # a process that reached the model's loading would SIGKILL itself there (exit -9, not 2): no timing needed
        monkeypatch.setenv("KVBENCH_FAULT", "model_load:1")
        proc = _run(args, tmp_path, timeout=60)
        code, stdout, stderr, results = proc.returncode, proc.stdout, proc.stderr, tmp_path / "results"
    else:
        got = bad_outcomes[" ".join(args)]
        code, stdout, stderr, results = got["code"], got["stdout"], got["stderr"], got["results"]
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert "Traceback" not in stderr and "Loading" not in stderr + stdout  # no model loaded
    assert not results.exists()  # nothing at all, not even Hydra's log directory (issue #38)


def test_the_batched_bad_input_driver_reports_what_a_process_of_its_own_reports(tmp_path, bad_outcomes):
    """The batch driver against ``python -m kvbench.run`` itself on three cases (a config error, a method's field,
    a refusal after planning): the same exit code, stderr and stdout."""
    for args in (["budget=abc"], ["method=h2o", "method.recent_ratio=1.5"], ["method=offload"]):
        alone = subprocess.run([sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "KVBENCH_FAULT": "model_load:1",
                                                 "KVBENCH_RESULTS_DIR": str(tmp_path / "results")})
        got = bad_outcomes[" ".join(args)]
        assert (got["code"], got["stderr"], got["stdout"]) == (alone.returncode, alone.stderr, alone.stdout)


def test_dotted_overrides_list_the_dataclass_fields():
    """The fields a ``method.x=`` / ``task.x=`` override may name (the composed config's keys, what the precheck
    lists) are the method's or task's dataclass fields."""
    import dataclasses

    from hydra import compose, initialize_config_dir

    from kvbench.methods import METHODS
    from kvbench.tasks import TASKS

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for group, registry in (("method", METHODS), ("task", TASKS)):
            for path in sorted((CONF_DIR / group).glob("*.yaml")):
                node = compose(config_name="config", overrides=[f"{group}={path.stem}"])[group]
                fields = {f.name for f in dataclasses.fields(registry.get_class(node.name)) if f.init}
                assert set(node) - {"name"} == fields - {"name"}, path.stem


def test_a_ratio_budget_is_checked_against_the_longest_prompt():
    with pytest.raises(ConfigError, match=r"budget=0.003 resolves to 25 tokens per layer even on the longest prompt "
                                          r"model 'smollm2-135m' takes \(8192 tokens\), below the minimum 33"):
        plan_job(_compose(["budget=0.003"]))
    assert plan_job(_compose(["budget=0.005"])).budget_label == "0.005"  # 41 tokens at 8192
    # the longest prompt: the truncation length, or the window a task's truncate_to reaches (8192 > 7950)
    plan_job(_compose(["model=llama3-8b-instruct", "method=d2o", "budget=0.00068"]))  # 6 at 8192 (5 at 7950)
    with pytest.raises(ConfigError, match="budget=0.0007 resolves to 6 tokens per layer .* the minimum 7 tokens .* "
                                          "method 'h2o'"):
        plan_job(_compose(["method=h2o", "method.variant=prefill_only", "method.window=6", "budget=0.0007"]))
    # a method whose own fields, not the budget, set what it keeps takes any ratio
    plan_job(_compose(["method=pyramidinfer", "method.allocation=paper", "budget=0.0000001"]))
    plan_job(_compose(["method=infllm", "method.n_init=4", "method.n_local=512", "method.topk=2", "budget=0.0000001"]))
    plan_job(_compose(["method=pod", "budget=0.0000001"]))


def test_a_ratio_below_the_minimum_on_a_later_prompt_stops_the_job_and_keeps_earlier_records(tmp_path):
    """budget=0.1 holds 39 tokens of the 390-token prompt (SnapKV needs 33) but 12 of the 119-token one: the job
    stops there with one line and exit 2; the first sample's record stays and a rerun does not redo it."""
    args = ["model=tiny-random", "task=passkey", "task.context_lengths=[400,128]", "task.depths=[50]",
            "method=snapkv", "budget=0.1", "task.max_new_tokens=4", "print_table=false"]
    proc = _run(args, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "error: budget=0.1 resolves to 12 tokens per layer for a prompt of 119 tokens, below the minimum 33 tokens "
        "per layer of method 'snapkv' (the observation window of 32 tokens is part of the budget)")
    (job,) = _job_dirs(tmp_path)
    (record,) = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert record["id"].startswith("L400") and record["layer_entries"] == [39] * 4
    assert not (job / "scores.json").exists()


# ---- real jobs on the tiny random model ----------------------------------------------------------------------------
def _job_dirs(tmp_path):
    return sorted((tmp_path / "results" / "runs").glob("*/*/*/*/*"))


def test_job_runs_stores_and_skips_when_finished(tmp_path):
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    proc = _run([*TINY, "method=h2o", "budget=64"], tmp_path, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert list(workdir.iterdir()) == []  # nothing is written into the working directory
    assert "resident KV bytes" in proc.stdout and "h2o" in proc.stdout
    (job,) = _job_dirs(tmp_path)
    assert job.relative_to(tmp_path / "results" / "runs").parts[:4] == ("tiny-random", "passkey", "h2o", "64")
    records = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert all(r["resident_kv_bytes"] == 4 * 2 * 64 * 16 * 2 * 4 for r in records)  # tiny: 4 layers, 2 kv heads
    meta = json.loads((job / "meta.json").read_text())
    assert meta["versions"]["transformers"] and meta["peak_memory"]["max_rss_bytes"] > 0
    scores = json.loads((job / "scores.json").read_text())
    assert scores["n_samples"] == 3 and scores["method"] == "h2o"
    again = _run([*TINY, "method=h2o", "budget=64"], tmp_path)
    assert again.returncode == 0 and "finished earlier; skipped" in again.stdout


def test_help_lists_the_groups_and_cfg_job_prints_the_config(tmp_path):
    helped = _run(["--help"], tmp_path, timeout=60)
    assert helped.returncode == 0
    for group in ("model:", "method:", "task:", "launcher:", "logger:"):
        assert group in helped.stdout
    assert "snapkv" in helped.stdout and "budget" in helped.stdout
    cfg = _run(["--cfg", "job", "method=h2o", "budget=0.2"], tmp_path, timeout=60)
    assert cfg.returncode == 0 and "name: h2o" in cfg.stdout and "budget: 0.2" in cfg.stdout
    assert not (tmp_path / "results" / "runs").exists()


def test_batched_job_gives_the_same_predictions(tmp_path):
    """batch_size=3 left-pads prompts of different lengths; every prediction equals the batch_size=1 run's."""
    args = ["model=tiny-random", "task=passkey", "task.context_lengths=[256,320,400]", "task.depths=[20,80]",
            "method=snapkv", "budget=64", "task.max_new_tokens=12"]
    single = _run(args, tmp_path / "single")
    batched = _run([*args, "batch_size=3"], tmp_path / "batched")
    assert single.returncode == 0 and batched.returncode == 0, batched.stderr

    def predictions(root):
        (job,) = _job_dirs(root)
        return {r["id"]: r["prediction"] for r in map(json.loads, (job / "samples.jsonl").read_text().splitlines())}

    assert predictions(tmp_path / "single") == predictions(tmp_path / "batched")


def test_wandb_logger_offline(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvbench.run", *TINY, "method=snapkv", "budget=64", "logger=wandb", "limit=2"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path / "results"), "WANDB_MODE": "offline",
             "WANDB_SILENT": "true"},
    )
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "results" / "logs").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    logged = runs[0].read_bytes()  # protobuf records: keys and JSON values appear as plain bytes
    for key in (b"scores/score", b"efficiency/resident_kv_bytes_mean", b"efficiency/decode_ms_per_token"):
        assert key in logged, key
    (scores_file,) = (tmp_path / "results" / "runs").rglob("scores.json")
    score = json.loads(scores_file.read_text())["score"]
    assert json.dumps(score).encode() in logged  # the summary's value_json of the job's score
    (table,) = runs[0].parent.glob("files/media/table/samples_*.table.json")
    rows = json.loads(table.read_text())["data"]
    records = [json.loads(line) for line in (scores_file.parent / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(records) == 2


def test_per_sample_generation_limits_in_one_batch(tmp_path, monkeypatch):
    """Rows of one batch stop at their own max_new_tokens (LongBench mixes sub-datasets with different limits)."""
    from omegaconf import OmegaConf

    from kvbench.jobs import run_job
    from kvbench.tasks import TASKS

    monkeypatch.setitem(TASKS.entries, "per_sample_limits", "helpers:PerSampleLimitsTask")
    cfg = _compose(["model=tiny-random", "method=fullkv", "batch_size=3", "print_table=false",
                    f"paths.results_dir={tmp_path}"])
    OmegaConf.set_struct(cfg, False)
    cfg.task = {"name": "per_sample_limits"}
    run_job(cfg)
    (job,) = sorted((tmp_path / "runs").glob("*/*/*/*/*"))
    records = {r["id"]: r for r in map(json.loads, (job / "samples.jsonl").read_text().splitlines())}
    assert [records[i]["new_tokens"] for i in ("s0", "s1", "s2")] == [3, 9, 5]  # the random model never says eos


def test_longbench_from_local_files_end_to_end(tmp_path):
    """LongBench read from task.data_dir (the official jsonl format), per-dataset protocol, aggregate by dataset."""
    fixtures = Path(__file__).parent / "fixtures" / "longbench"
    proc = _run(["model=tiny-random", "task=longbench", f"task.data_dir={fixtures}", "method=snapkv", "budget=64",
                 "task.datasets=[hotpotqa,trec,samsum,passage_retrieval_en,lcc]"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (job,) = _job_dirs(tmp_path)
    scores = json.loads((job / "scores.json").read_text())
    assert set(scores["datasets"]) == {"hotpotqa", "trec", "samsum", "passage_retrieval_en", "lcc"}
    records = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    by_dataset = {r["id"].split("/")[0]: r for r in records}
    assert by_dataset["samsum"]["new_tokens"] <= 128 and by_dataset["trec"]["new_tokens"] <= 64  # dataset2maxlen


def test_pod_jobs_are_keyed_by_their_window_not_the_unused_budget():
    a = plan_job(_compose(["method=pod", "budget=64"]))
    b = plan_job(_compose(["method=pod", "budget=0.5"]))
    c = plan_job(_compose(["method=pod", "method.n_r=256"]))
    assert a.key == b.key and a.parts[3] == "window16+4080" and c.parts[3] == "window16+256" and c.key != a.key


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_failing_sample_is_recorded_and_the_job_goes_on(tmp_path, monkeypatch, batch_size):
    from kvbench.jobs import run_job
    from kvbench.tasks import TASKS

    monkeypatch.setitem(TASKS.entries, "flaky_scorer", "helpers:FlakyScorerTask")
    cfg = _compose(["model=tiny-random", "method=fullkv", f"batch_size={batch_size}", "print_table=false",
                    f"paths.results_dir={tmp_path}"])
    OmegaConf.set_struct(cfg, False)
    cfg.task = {"name": "flaky_scorer"}
    scores = run_job(cfg)
    (job,) = sorted((tmp_path / "runs").glob("*/*/*/*/*"))
    records = [json.loads(x) for x in (job / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["s0", "s2"]
    (error,) = [json.loads(x) for x in (job / "errors.jsonl").read_text().splitlines()]
    assert error["id"] == "s1" and error["error"] == "ValueError: cannot score s1" and "Traceback" in error["traceback"]
    assert scores["n_failed"] == 1 and scores["failed_ids"] == ["s1"] and scores["n_samples"] == 2
    # not finished: a rerun (scorer fixed) retries only the failed sample
    cfg2 = _compose(["model=tiny-random", "method=fullkv", f"batch_size={batch_size}", "print_table=false",
                     f"paths.results_dir={tmp_path}"])
    OmegaConf.set_struct(cfg2, False)
    cfg2.task = {"name": "flaky_scorer"}
    import helpers

    monkeypatch.setattr(helpers.FlakyScorerTask, "score", lambda self, p, s: 1.0)
    scores = run_job(cfg2)
    assert scores["n_failed"] == 0 and scores["n_samples"] == 3 and not (job / "errors.jsonl").exists()
    assert len((job / "samples.jsonl").read_text().splitlines()) == 3


def test_strict_stops_at_the_first_failing_sample(tmp_path, monkeypatch):
    from kvbench.jobs import run_job
    from kvbench.tasks import TASKS

    monkeypatch.setitem(TASKS.entries, "flaky_scorer", "helpers:FlakyScorerTask")
    cfg = _compose(["model=tiny-random", "method=fullkv", "strict=true", "print_table=false",
                    f"paths.results_dir={tmp_path}"])
    OmegaConf.set_struct(cfg, False)
    cfg.task = {"name": "flaky_scorer"}
    with pytest.raises(ValueError, match="cannot score s1"):
        run_job(cfg)
    (job,) = sorted((tmp_path / "runs").glob("*/*/*/*/*"))
    assert [json.loads(x)["id"] for x in (job / "samples.jsonl").read_text().splitlines()] == ["s0"]
    assert not (job / "scores.json").exists()


def test_a_full_disk_is_one_clear_error_and_keeps_earlier_records(tmp_path, monkeypatch):
    import errno

    from kvbench.errors import DataError
    from kvbench.jobs import run_job
    from kvbench.store import JobDir
    from kvbench.tasks import TASKS

    monkeypatch.setitem(TASKS.entries, "flaky_scorer", "helpers:FlakyScorerTask")
    real = JobDir.append_record

    def append(self, record):
        if record["id"] == "s1":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, record)

    monkeypatch.setattr(JobDir, "append_record", append)
    cfg = _compose(["model=tiny-random", "method=fullkv", "print_table=false", f"paths.results_dir={tmp_path}"])
    OmegaConf.set_struct(cfg, False)
    cfg.task = {"name": "flaky_scorer", "bad": []}
    with pytest.raises(DataError, match="no space left on the device writing .*samples.jsonl; the records written"):
        run_job(cfg)
    (job,) = sorted((tmp_path / "runs").glob("*/*/*/*/*"))
    assert [json.loads(x)["id"] for x in (job / "samples.jsonl").read_text().splitlines()] == ["s0"]
