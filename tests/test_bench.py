"""kvbench.bench: cells expand from the config, measurements land in the store and resume, targets are judged
against FullKV, memory probes see real allocations, and the max-batch search is exact on a monotone predicate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from kvbench.bench.measure import PeakMemory, largest_fitting
from kvbench.bench.run import _run, expand, judge, targets_markdown
from kvbench.budget import Budget
from kvbench.config import CONF_DIR
from kvbench.errors import ConfigError


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("bench", overrides=["model=tiny-random", "bench=smoke", f"paths.results_dir={tmp_path}",
                                           *overrides])


def test_smoke_bench_measures_stores_resumes_and_judges(tmp_path):
    """The smoke bench at its batch of 2 (three cells: each CPU memory probe is a fresh process of several seconds;
    the batch-1 cells measure the same way)."""
    cfg = _cfg(tmp_path, "bench.grids.0.batch_sizes=[2]")
    rows = _run(cfg)
    assert {(r["method"], r["batch_size"]) for r in rows} == {(m, 2) for m in ("fullkv", "snapkv", "h2o")}
    store = tmp_path / "bench" / "tiny-random" / "smoke" / "cpu"
    assert len((store / "cells.jsonl").read_text().splitlines()) == 3
    per_token = 4 * 2 * 2 * 16 * 4  # tiny-random: 4 layers x 2 KV heads x (K, V) x 16 dims x fp32
    for row in rows:
        tokens = 256 if row["method"] == "fullkv" else 64
        assert row["resident_kv_bytes"] == row["batch_size"] * tokens * per_token
        assert row["prefill_seconds"] > 0 and row["decode_tokens_per_s"] > 0 and row["decode_steps"] == 3
        assert row["prefill_peak_bytes"] is not None
    verdicts = json.loads((store / "targets.json").read_text())["targets"]
    assert all(v["ok"] for v in verdicts if v["metric"] == "resident_kv_bytes")
    assert "| resident KV = the budget's bytes | snapkv@64 | 2 |" in (store / "targets.md").read_text()
    assert (store / "targets.png").exists()  # the decode-ratio target's panel
    assert all(r["memory_probe"] == "fresh process" and r["prefill_peak_bytes"] > 0 for r in rows)  # CPU peaks
    assert _run(cfg) == rows  # resumed: nothing measured again
    assert len((store / "cells.jsonl").read_text().splitlines()) == 3


def test_judge_ratios_against_fullkv():
    rows = [{"method": "fullkv", "budget": "full", "context_length": 8, "batch_size": 1, "prefill_seconds": 2.0},
            {"method": "snapkv", "budget": "4", "context_length": 8, "batch_size": 1, "prefill_seconds": 2.2},
            {"method": "h2o", "budget": "4", "context_length": 8, "batch_size": 1, "prefill_seconds": 2.9}]
    targets = [{"name": "t", "metric": "prefill_seconds", "context_length": 8, "methods": ["snapkv", "h2o"],
                "max_ratio": 1.5}]
    out = judge(rows, targets, None)
    assert [(v["method"], v["ratio"], v["ok"]) for v in out] == [("snapkv", 1.1, True), ("h2o", 1.45, True)]
    targets[0]["max_ratio"] = 1.05
    assert [v["ok"] for v in judge(rows, targets, None)] == [False, False]


def test_resident_bytes_against_a_multiple_of_the_budgets():
    """``max_budget_ratio``: resident bytes at most that many times the budget's (AdaKV's padded heads, ChunkKV's
    whole chunks); ``equals_budget`` stays exact."""
    rows = [{"method": m, "budget": "4", "context_length": 8, "batch_size": 1, "kv_bytes_per_token": 10,
             "resident_kv_bytes": b} for m, b in (("adakv", 42), ("chunkkv", 30), ("kvzip", 41))]
    targets = [{"name": "t", "metric": "resident_kv_bytes", "context_length": 8, "methods": ["adakv", "kvzip"],
                "max_budget_ratio": 1.05},
               {"name": "u", "metric": "resident_kv_bytes", "context_length": 8, "methods": ["chunkkv"],
                "max_budget_ratio": 1.0},
               {"name": "v", "metric": "resident_kv_bytes", "context_length": 8, "methods": ["chunkkv"],
                "equals_budget": True}]
    out = judge(rows, targets, None)
    assert [(v["method"], v.get("ratio"), v["expected"], v["ok"]) for v in out] == [
        ("adakv", 1.05, 40, True), ("kvzip", 1.025, 40, True), ("chunkkv", 0.75, 40, True),
        ("chunkkv", None, 40, False)]
    assert "| 1.05 | <= 1.05 x budget | yes |" in targets_markdown(out)


def test_decode_peak_against_the_budget_plus_an_interval():
    """``max_budget_plus_tokens``: a decode compression's peak at most the budget's bytes plus an interval's tokens,
    at any budget (255 of 128 tokens passes with an interval of 128, 257 does not; 1151 of 1024 passes)."""
    rows = [{"method": "snapkv_decode128", "budget": str(b), "context_length": 64, "batch_size": 2,
             "kv_bytes_per_token": 10, "resident_kv_bytes_decode_max": 2 * peak * 10,
             "budget_kv_bytes_decode": 2 * b * 10} for b, peak in ((128, 255), (128, 257), (1024, 1151))]
    targets = [{"name": "t", "metric": "resident_kv_bytes_decode_max", "context_length": 64,
                "methods": ["snapkv_decode128"], "max_budget_plus_tokens": 128}]
    out = judge(rows, targets, None)
    assert [(v["ratio"], v["ok"]) for v in out] == [(1.992, True), (2.008, False), (1.124, True)]
    assert "<= 2.000 x budget (+128 tokens)" in targets_markdown(out)


def test_paired_prefill_ratio_wins_over_separate_cells():
    """A paired cell's own FullKV timings judge it (drift between cells would read 2.2 / 2.0 = 1.1 here)."""
    rows = [{"method": "fullkv", "budget": "full", "context_length": 8, "batch_size": 1, "prefill_seconds": 2.0},
            {"method": "snapkv", "budget": "4", "context_length": 8, "batch_size": 1, "prefill_seconds": 2.2,
             "prefill_baseline_seconds": 2.15, "prefill_ratio_paired": 1.02}]
    targets = [{"name": "t", "metric": "prefill_seconds", "context_length": 8, "methods": ["snapkv"],
                "max_ratio": 1.05}]
    [verdict] = judge(rows, targets, None)
    assert (verdict["ratio"], verdict["fullkv"], verdict["ok"], verdict["paired"]) == (1.02, 2.15, True, True)
    assert "1.02 (paired)" in targets_markdown([verdict])


def test_paired_cells_alternate_with_fullkv(tmp_path):
    rows = _run(_cfg(tmp_path, "bench.grids.0.metrics=[prefill]", "+bench.grids.0.paired=true",
                     "+bench.grids.0.repeats=3", "bench.grids.0.batch_sizes=[1]", "bench.targets=[]"))
    by_method = {r["method"]: r for r in rows}
    assert by_method["fullkv"]["prefill_ratio_paired"] is None  # the baseline itself is not paired
    for name in ("snapkv", "h2o"):
        row = by_method[name]
        assert len(row["prefill_seconds_all"]) == len(row["prefill_baseline_seconds_all"]) == 3
        ratios = sorted(m / b for m, b in zip(row["prefill_seconds_all"], row["prefill_baseline_seconds_all"]))
        assert row["prefill_ratio_paired"] == round(ratios[1], 4)  # recomputable from the stored timings


def test_plots_follow_the_cells(tmp_path):
    """targets.png from the ratio targets (a miss hatched); curves only for metrics measured at >= 2 lengths."""
    pytest.importorskip("matplotlib")
    from kvbench.bench.plots import plot_bench

    rows = [{"method": m, "budget": b, "context_length": n, "batch_size": 1, "prefill_seconds": t * n / 1000,
             "decode_ms_per_token": None, "max_batch": mb, "memory_limit_gb": 80}
            for m, b, t, mb in (("fullkv", "full", 1.0, 4), ("snapkv", "64", 1.02, 9)) for n in (1024, 2048)]
    verdicts = judge(rows, [{"name": "prefill", "metric": "prefill_seconds", "context_length": 2048,
                             "methods": ["snapkv"], "max_ratio": 1.01}], None)
    assert verdicts[0]["ok"] is False
    paths = plot_bench(rows, verdicts, tmp_path, "test")
    assert sorted(p.name for p in paths) == sorted(f"{n}.{e}" for n in ("targets", "prefill_seconds_vs_context",
                                                                      "max_batch") for e in ("png", "pdf"))
    assert all(p.stat().st_size > 1000 for p in paths)
    again = tmp_path / "again"
    plot_bench(rows, verdicts, again, "test")
    assert (again / "targets.png").read_bytes() == (tmp_path / "targets.png").read_bytes()  # deterministic


def test_memory_probe_runs_in_a_fresh_process_and_fails_loudly(tmp_path):
    from kvbench.bench.probe import probe_in_subprocess, request
    from kvbench.errors import KVBenchError
    from kvbench.models import spec_from_config

    spec = spec_from_config(_cfg(tmp_path).model)
    got = probe_in_subprocess(request(spec, {"name": "snapkv"}, "64", 256, 1))
    assert got["resident_kv_bytes"] == 64 * 4 * 2 * 2 * 16 * 4 and got["peak_bytes"] > 0
    gen = probe_in_subprocess(request(spec, {"name": "snapkv"}, "64", 256, 2, "generate", new_tokens=2))
    assert gen["resident_kv_bytes"] == 2 * got["resident_kv_bytes"]
    with pytest.raises(KVBenchError, match=r"memory probe for snapkv@64, 256 tokens x 1 failed \(exit 2\)"):
        probe_in_subprocess(request(spec, {"name": "snapkv", "window": -3}, "64", 256, 1))


def test_max_batch_with_an_external_probe():
    from kvbench.bench.measure import max_batch

    peaks = []
    assert max_batch(None, None, None, 256, 100, probe=lambda b: peaks.append(b) or 30 * b) == 3
    assert peaks[:3] == [1, 2, 4]


def test_bad_bench_configs(tmp_path):
    cfg = _cfg(tmp_path, "bench.grids.0.metrics=[speed]")
    with pytest.raises(ConfigError, match="metrics.*prefill, memory, decode, max_batch, throughput"):
        expand(cfg.bench)
    cfg = _cfg(tmp_path, "bench.grids.0.methods=[snapkvv]")
    with pytest.raises(ConfigError, match="unknown method 'snapkvv'"):
        _run(cfg)
    out = subprocess.run([sys.executable, "-m", "kvbench.bench", "bench=fast"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown bench 'fast'; valid benches: " in out.stderr
    assert "Traceback" not in out.stderr


def test_a_grid_budget_is_parsed_and_checked_before_the_model_loads(tmp_path, monkeypatch):
    """The grid's budgets go through the job plan's parse (same wording) and its check on each cell's prompt."""
    import kvbench.models

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(kvbench.models, "load_model", no_load)
    with pytest.raises(ConfigError, match="^budget='abc' is not a number; valid: tokens per layer"):
        expand(_cfg(tmp_path, "bench.grids.0.budgets=[abc]").bench)
    # SnapKV needs 33 tokens; 0.05 of the 256-token prompt is 13
    with pytest.raises(ConfigError, match=r"^budget=0.05 resolves to 13 tokens per layer for a prompt of 256 tokens, "
                                          r"below the minimum 33 tokens per layer of method 'snapkv'"):
        _run(_cfg(tmp_path, "bench.grids.0.budgets=[0.05]"))
    with pytest.raises(ConfigError, match="^budget=16 is below the minimum 33"):
        _run(_cfg(tmp_path, "bench.grids.0.budgets=[16]"))
    assert not (tmp_path / "bench").exists()


def test_peak_memory_sees_an_allocation():
    with PeakMemory(torch.device("cpu")) as peak:
        block = torch.ones(16 * 2**20)  # 64 MiB, touched
        del block
    if not PeakMemory.supported(torch.device("cpu")):
        pytest.skip("no /proc/self/clear_refs on this OS")
    assert 60 * 2**20 <= peak.bytes <= 200 * 2**20


@pytest.mark.parametrize("limit", [0, 1, 5, 8, 13, 100])
def test_largest_fitting_search(limit):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= limit

    assert largest_fitting(fits, upper=64) == min(limit, 64)
    assert len(calls) <= 16


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "bench").glob("*.yaml")))
def test_every_bench_config_expands(tmp_path, name):
    """Each paper bench composes and expands to cells with known methods (nothing is measured)."""
    from kvbench.methods import METHODS

    cfg = _cfg(tmp_path, f"bench={name}")
    cells = expand(cfg.bench)
    assert cells and all(c["config"] in METHODS.names() for c in cells if not c.get("peer"))  # a variant's method
    assert all(c["method"].startswith("transformers_") for c in cells if c.get("peer"))  # the peers: plain generate
    if name == "d2o_table12":  # 256+512 ... 2048+4096: generation twice the prompt
        assert [(c["context_length"], c["new_tokens"]) for c in cells] == [(256, 512), (512, 1024), (1024, 2048),
                                                                            (2048, 4096)]
    if name == "long_generation":  # 1k + 8k, FullKV beside methods compressing during decode (issue #40)
        assert {c["method"] for c in cells} == {"fullkv", "snapkv_decode128", "knorm_decode128", "rkv"}
        assert all((c["context_length"], c["new_tokens"]) == (1024, 8192) for c in cells)
        assert {c["overrides"]["decode_compression"]["interval"] for c in cells if c["method"].endswith("128")} == {128}
        assert cfg.bench.compile is True  # decoded captured, the compressions between blocks (engine/graph.py)
    if name == "d2o_table13":
        assert {(c["method"], c["context_length"]) for c in cells} == {(m, n) for m in ("h2o", "d2o")
                                                                        for n in (512, 2048)}


def test_only_grids_selects_grids_and_rejects_bad_indices(tmp_path):
    cfg = _cfg(tmp_path, "bench=d2o_table5")
    everything = expand(cfg.bench)
    picked = expand(cfg.bench, [4, 5])
    assert [(c["method"], c["batch_size"], c["new_tokens"]) for c in picked] == [("fullkv", 8, 1024),
                                                                                 ("h2o", 32, 1024), ("d2o", 32, 1024)]
    assert len(everything) > len(picked)
    for bad in ([12], [-1], [], ["4"], [True]):
        with pytest.raises(ConfigError, match=r"only_grids=.*grids 0\.\.11"):
            expand(cfg.bench, bad)
    out = subprocess.run([sys.executable, "-m", "kvbench.bench", "bench=d2o_table5", "only_grids=[99]",
                          f"paths.results_dir={tmp_path}"], capture_output=True, text=True)
    assert out.returncode == 2 and "only_grids=[99]" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "bench").exists()  # refused before any model loads


def test_decode_warmup_tokens_shortens_only_the_warmup(tmp_path, monkeypatch):
    import kvbench.bench.measure as measure

    steps = []
    real = measure.greedy_generate

    def spy(model, prompts, new_tokens, *args, **kwargs):
        steps.append(new_tokens)
        return real(model, prompts, new_tokens, *args, **kwargs)

    monkeypatch.setattr(measure, "greedy_generate", spy)
    rows = _run(_cfg(tmp_path, "bench.grids.0.metrics=[decode]", "bench.grids.0.methods=[h2o]",
                     "bench.grids.0.batch_sizes=[1]", "bench.new_tokens=6", "bench.warmup=2", "bench.repeats=2",
                     "+bench.decode_warmup_tokens=2"))
    assert steps == [2, 2, 6, 6]
    assert rows[0]["decode_steps"] == 5  # the measured runs: 6 tokens, the first from the prefill


def test_rerun_measures_only_the_selected_cells_again(tmp_path):
    no_probe = "bench.grids.0.metrics=[prefill,decode]"  # the fresh-process memory probes: the smoke test's concern
    first = _run(_cfg(tmp_path, no_probe))
    again = _run(_cfg(tmp_path, no_probe, "rerun=true", "bench.grids.0.methods=[fullkv]",
                      "bench.grids.0.batch_sizes=[2]"))
    store = tmp_path / "bench" / "tiny-random" / "smoke" / "cpu" / "cells.jsonl"
    rows = [json.loads(line) for line in store.read_text().splitlines()]
    assert len(rows) == 6 and len(again) == 6  # the other five cells are kept, not wiped
    key = lambda r: (r["method"], r["batch_size"])  # noqa: E731
    assert [key(r) for r in rows][-1] == ("fullkv", 2)  # measured again, appended last
    before = {key(r): r for r in first}
    assert all(r == before[key(r)] for r in rows if key(r) != ("fullkv", 2))


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
def test_budget_bytes_follow_the_layer_types(family):
    """The budget target's bytes are what SnapKV leaves after prefill, layer type by layer type: on hybrid Gemma 3 the
    sliding layers keep their window (``window - 1``) and only the full layer holds the budget; on Mistral (every layer
    sliding) the method compresses inside the window; on Llama every layer holds the budget."""
    from types import SimpleNamespace

    from helpers import WINDOW, tiny_family
    from kvbench.bench.run import budget_bytes
    from kvbench.budget import Budget
    from kvbench.engine import CompressionSession, KVCache
    from kvbench.engine.compat import cache_kwargs
    from kvbench.methods import build_method

    model = tiny_family(family)
    loaded = SimpleNamespace(model=model, num_layers=4, num_kv_heads=2,
                             kv_bytes_per_token=lambda: 2 * 16 * 4)  # K and V, head_dim 16, fp32
    n, budget = 200, Budget.parse(48)
    cache = KVCache()
    prompt = torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(0))
    with CompressionSession(model, build_method({"name": "snapkv"}, budget), budget), torch.inference_mode():
        model(prompt, **cache_kwargs(model, cache), use_cache=True)
    assert cache.resident_bytes() == budget_bytes(loaded, budget, n, 1)
    per_layer = {"llama": [48] * 4, "gemma3": [WINDOW - 1, WINDOW - 1, 48, WINDOW - 1], "mistral": [48] * 4}[family]
    assert budget_bytes(loaded, budget, n, 2) == 2 * sum(per_layer) * 2 * 2 * 16 * 4


def test_throughput_at_the_batch_and_at_the_largest_batch(tmp_path, monkeypatch):
    """``throughput``: a job's samples per minute (prefill + decode) at the cell's batch, and again at the largest
    batch that fits when ``max_batch`` is measured too (the batch where compression pays)."""
    import kvbench.bench.measure as measure

    calls = []
    real = measure.samples_per_minute

    def spy(loaded, method, budget, length, batch, *args, **kwargs):
        calls.append((method.name, batch))
        return real(loaded, method, budget, length, batch, *args, **kwargs)

    monkeypatch.setattr(measure, "samples_per_minute", spy)
    monkeypatch.setattr(measure, "max_batch", lambda loaded, method, *a, **k: 3 if method.name == "snapkv" else 1)
    rows = _run(_cfg(tmp_path, "bench.grids.0.metrics=[max_batch,throughput]", "+bench.grids.0.memory_limit_gb=1",
                     "bench.grids.0.batch_sizes=[1]", "bench.grids.0.methods=[fullkv,snapkv]", "bench.targets=[]"))
    by_method = {r["method"]: r for r in rows}
    assert calls == [("fullkv", 1), ("snapkv", 1), ("snapkv", 3)]
    assert by_method["fullkv"]["samples_per_minute_at_max_batch"] == by_method["fullkv"]["samples_per_minute"] > 0
    assert by_method["snapkv"]["max_batch"] == 3 and by_method["snapkv"]["samples_per_minute_at_max_batch"] > 0


def test_a_cell_in_two_grids_is_measured_once_with_both_grids_metrics(tmp_path):
    """gemma3_hybrid times prefill at 8k in one grid and memory/decode at 4k and 8k in another: the shared 8k cells
    must carry the second grid's metrics too, not be dropped as already seen."""
    cfg = _cfg(tmp_path, "bench=gemma3_hybrid")
    cells = {(c["method"], c["context_length"]): c["metrics"] for c in expand(cfg.bench)}
    assert cells[("snapkv", 8192)] == ["prefill", "memory", "decode"]
    assert cells[("snapkv", 4096)] == ["memory", "decode"]


def test_the_targets_plot_reads_every_kind_of_bound(tmp_path):
    """``<= r``, ``>= r`` and ``<= r x budget`` (a resident-bytes bound at a multiple of the budget's) each draw their
    line at r (the last kind used to stop the plot after the data files were written)."""
    pytest.importorskip("matplotlib")
    from kvbench.bench.plots import targets_plot

    verdicts = [{"target": t, "method": "snapkv", "budget": "128", "batch_size": 1, "ratio": 0.9, "bound": bound,
                 "ok": True} for t, bound in (("a", "<= 1.1"), ("b", ">= 0.5"), ("c", "<= 1.05 x budget"))]
    paths = targets_plot(verdicts, tmp_path, "t")
    assert paths and all(p.exists() for p in paths)


def test_a_named_variant_is_its_own_row_with_its_config_merged_key_by_key(tmp_path):
    """A grid's methods item ``{name, method, overrides}`` is a cell of its own name (a decode-compressing SnapKV
    beside plain SnapKV), built from the method's yaml with the overrides merged key by key."""
    from kvbench.bench.run import method_config

    cfg = _cfg(tmp_path, "bench.grids.0.methods=[snapkv,{name:snapkv_w8,method:snapkv,overrides:{window:8}}]",
               "bench.grids.0.context_lengths=[64]", "bench.grids.0.batch_sizes=[1]")
    cells = {c["method"]: c for c in expand(cfg.bench)}
    assert cells["snapkv_w8"]["config"] == "snapkv" and cells["snapkv_w8"]["overrides"] == {"window": 8}
    assert cells["snapkv"]["overrides"] is None
    built = method_config("snapkv", {"window": 8})
    assert built["window"] == 8 and built["kernel"] == method_config("snapkv", None)["kernel"]
    merged = method_config("adakv", {"scorer_fields": {"window": 64}})  # a nested mapping: merged, not replaced
    assert merged["scorer_fields"] == {"window": 64} and "scorer" in merged
    for bad in ("bench.grids.0.methods=[{name:x}]", "bench.grids.0.methods=[{name:x,method:snapkv,extra:1}]"):
        with pytest.raises(ConfigError, match="must be a method's name or a mapping"):
            expand(_cfg(tmp_path, bad).bench)


def test_kernels_metric_names_what_one_decode_step_runs(toy_llama):
    """``decode_kernels``: the difference of two profiled generations per step. FullKV's step runs the fused SDPA
    operator and no softmax; H2O's (which accumulates probabilities) materialises its softmax; both count the same
    operators per step as a longer difference would (the prompt and the first step cancel)."""
    from types import SimpleNamespace

    from kvbench.bench.measure import decode_kernels
    from kvbench.methods import build_method

    budget = Budget.parse(32)
    prompts = [list(range(3, 67))]
    tok = SimpleNamespace(pad_token_id=0)
    full = decode_kernels(toy_llama, build_method({"name": "fullkv"}, Budget.full()), Budget.full(), prompts, tok)
    h2o = decode_kernels(toy_llama, build_method({"name": "h2o"}, budget), budget, prompts, tok)
    assert full["device"] == "cpu" and full["steps"] == 8 and full["per_step"] > 0
    names = {row[0] for row in full["attention"]}
    assert any("scaled_dot_product" in n for n in names) and not any("softmax" in n for n in names)
    assert any("softmax" in row[0] for row in h2o["attention"])
    again = decode_kernels(toy_llama, build_method({"name": "fullkv"}, Budget.full()), Budget.full(), prompts, tok,
                           short=2, long=6)
    assert again["steps"] == 4 and again["per_step"] == full["per_step"]
    assert all(calls == int(calls) for _, calls, _ in full["top"])  # whole operators per step


def test_kernels_metric_needs_the_decode_metric(tmp_path):
    grid = "bench.grids=[{metrics:[memory,kernels],methods:[fullkv],budgets:[64],context_lengths:[256]}]"
    with pytest.raises(ConfigError, match="kernels profiles the decode step"):
        expand(_cfg(tmp_path, grid).bench)


def test_prefill_kernels_say_where_a_prefill_goes(toy_llama):
    """``prefill_kernels``: one profiled prefill. SnapKV's scoring adds its observation window's softmax and pooling to
    FullKV's operators; both attend the prompt with the fused SDPA operator."""
    from kvbench.bench.measure import prefill_kernels
    from kvbench.methods import build_method

    ids = torch.arange(3, 131).view(1, -1)
    full = prefill_kernels(toy_llama, build_method({"name": "fullkv"}, Budget.full()), Budget.full(), ids)
    snap = prefill_kernels(toy_llama, build_method({"name": "snapkv"}, Budget.parse(48)), Budget.parse(48), ids)
    assert full["device"] == "cpu" and 0 < full["calls"] < snap["calls"]
    assert any("scaled_dot_product" in row[0] for row in full["attention"])
    assert any("softmax" in row[0] for row in snap["attention"]) and not any("softmax" in r[0] for r in full["top"])
    assert all(len(row) == 3 and row[1] >= 1 for row in snap["top"])


def test_prefill_kernels_metric_needs_the_prefill_metric(tmp_path):
    grid = "bench.grids=[{metrics:[memory,prefill_kernels],methods:[fullkv],budgets:[64],context_lengths:[256]}]"
    with pytest.raises(ConfigError, match="prefill_kernels profiles a prefill"):
        expand(_cfg(tmp_path, grid).bench)


def test_a_profiler_failure_is_stored_as_its_error_not_the_cells_end(caplog):
    from kvbench.bench.measure import _profiled

    def decode_kernels(*args, **kwargs):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nmore")

    assert _profiled(decode_kernels, 1, x=2) == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}
    assert "decode_kernels failed" in caplog.text
    assert _profiled(lambda *a: {"calls": len(a)}, 1, 2) == {"calls": 2}


def test_a_bench_stopped_by_sigterm_judges_what_it_stored(tmp_path):
    """``timeout`` (a GPU session's step budget) sends SIGTERM: the bench loses the cell under way, writes cells.csv,
    targets.json / .md from every stored cell, says which target cells were not measured, and exits 143; a run after
    it resumes from the stored cells. A last line cut short by a SIGKILL is skipped with a warning when resuming."""
    import os
    import signal
    import time

    store = tmp_path / "bench" / "tiny-random" / "smoke" / "cpu"
    args = [sys.executable, "-m", "kvbench.bench", "model=tiny-random", "bench=smoke", f"paths.results_dir={tmp_path}",
            "bench.grids.0.metrics=[prefill,decode]", "bench.repeats=40"]  # about a second per cell, six cells
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((store / "cells.jsonl").exists() and (store / "cells.jsonl").read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stored = [json.loads(line) for line in (store / "cells.jsonl").read_text().splitlines()]
    assert 1 <= len(stored) < 6 and "cells not measured" in out + err and "stopped: SIGTERM" in err  # (hydra logs
    # to stdout)
    assert all(r["cell_seconds"] > 0 for r in stored)
    assert len((store / "cells.csv").read_text().splitlines()) == 1 + len(stored)
    verdicts = json.loads((store / "targets.json").read_text())["targets"]
    missing = {v["method"] for v in verdicts if v.get("note") == "not measured"}
    measured = {r["method"] for r in stored}
    assert missing == {"snapkv", "h2o"} - measured and missing  # fullkv runs first
    assert "not measured" in (store / "targets.md").read_text()
    with (store / "cells.jsonl").open("a") as f:
        f.write('{"model": "tiny-random", "dev')  # a SIGKILL while writing
    done = subprocess.run([*args, "bench.repeats=1"], capture_output=True, text=True, timeout=600)  # (the cells'
    # keys do not hold the repeats)
    assert done.returncode == 0, done.stderr
    assert "is not a whole cell" in done.stdout + done.stderr
    assert len([json.loads(line) for line in (store / "cells.jsonl").read_text().splitlines()]) == 6
    verdicts = json.loads((store / "targets.json").read_text())["targets"]
    assert verdicts and not any(v.get("note") == "not measured" for v in verdicts)


def test_a_captured_cell_counts_the_tokens_equal_to_the_host_driven_path(monkeypatch):
    """With the captured decode a cell generates its prompts once more host-driven after the timed runs and stores the
    leading tokens the two share (the fewest over its rows) and whether their final bytes agree: issue #36's "tokens
    equal to the eager path" measured where the GPU runs it. A captured run that parts at token 5 stores 5, and a
    ``min_value`` target of 8 judges it."""
    from omegaconf import OmegaConf

    import kvbench.bench.measure as measure
    from kvbench.methods import build_method
    from kvbench.models import load_model, spec_from_config

    loaded = load_model(spec_from_config(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml")))
    budget = Budget.parse(64)
    method = build_method({"name": "h2o"}, budget)
    kwargs = dict(metrics=["decode"], new_tokens=8, warmup=0, repeats=1, compile="eager")
    result = measure.measure_cell(loaded, method, budget, 128, 2, **kwargs)
    assert (result.decode_eager_equal_tokens, result.decode_eager_equal_bytes) == (8, True)
    # fed to the host-driven path, every captured token is its argmax (fp32: the two paths agree to 1e-7)
    assert (result.decode_eager_forced_gap, result.decode_eager_forced_argmax) == (0.0, 1.0)
    real, calls = measure.greedy_generate, []

    def parting(*args, **kw):  # the timed (captured) run's second row parts from the host-driven path at token 5
        out = real(*args, **kw)
        calls.append(1)
        if len(calls) == 1:
            out.tokens[1][5] = (out.tokens[1][5] + 1) % 100
        return out

    monkeypatch.setattr(measure, "greedy_generate", parting)
    result = measure.measure_cell(loaded, method, budget, 128, 2, **kwargs)
    assert result.decode_eager_equal_tokens == 5 and len(calls) == 2
    # fed to the host-driven path, the parted token is below its choice at that step (and the tokens after it were
    # chosen after another token): a gap, and not every token the argmax
    assert result.decode_eager_forced_gap > 0 and result.decode_eager_forced_argmax < 1
    rows = [{"method": "h2o", "budget": "64", "context_length": 128, "batch_size": 2, **result.as_dict()}]
    [verdict] = judge(rows, [{"name": "t", "metric": "decode_eager_equal_tokens", "context_length": 128,
                              "methods": ["h2o"], "min_value": 8}], None)
    assert (verdict["value"], verdict["bound"], verdict["ok"]) == (5, ">= 8", False)
    [verdict] = judge(rows, [{"name": "t", "metric": "decode_eager_forced_gap", "context_length": 128,
                              "methods": ["h2o"], "max_value": 0.5}], None)
    assert verdict["value"] == result.decode_eager_forced_gap and verdict["ok"] == (verdict["value"] <= 0.5)
