"""SnapKV, PyramidKV, H2O, StreamingLLM and CaM against KVCache-Factory: the tokens kvbench keeps equal, exactly and
head by head, what ``pyramidkv/pyramidkv_utils.py`` of Zefan-Cai/KVCache-Factory keeps on the same seeded inputs, at
the three pinned commits (57e1c26 of 2024-06-25, 7ee6be0 of 2024-12-03, c97f9d7 of 2026-07-02), for each reading
kvbench names after that code; PyramidKV's per-layer capacities equal the code's at every layer.

The fixtures ``tests/fixtures/parity/kvfactory_<commit>.json`` were written by
``scripts/parity/kvcache_factory/generate.py`` next to the reference (scripts/parity/README.md); this test needs
neither: it rebuilds each case's post-RoPE queries and keys from its seed (``scripts/parity/kvcache_factory/cases.py``)
and hands them to kvbench's method as the engine would at one layer's prefill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import parity_cases

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.methods.cam import CaM
from kvbench.methods.h2o import H2O
from kvbench.methods.pyramidkv import PyramidKV, pyramid_capacity
from kvbench.methods.snapkv import SnapKV
from kvbench.methods.streamingllm import StreamingLLM

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"


CASES = parity_cases("kvcache_factory")
COMMITS = tuple(CASES.COMMITS)
#: kvbench's reading of each period of the code
PYRAMID_SCHEDULE = {"57e1c26": "kvfactory_2406", "7ee6be0": "kvfactory_2409", "c97f9d7": "kvfactory_2409"}
H2O_VARIANT = {"57e1c26": "kvfactory_2406", "7ee6be0": "kvfactory_2410", "c97f9d7": "prefill_only"}


def _fixture(commit: str) -> dict:
    return json.loads((FIXTURES / f"kvfactory_{commit}.json").read_text())


def kvbench_method(reading: str, commit: str, mode: str, **override):
    """The kvbench method (and fields) that names the reference's code of ``reading`` at ``commit`` in GQA ``mode``:
    ``query_head`` = K/V repeated to the query heads (the reference's default), ``kv_head`` = its group-averaging
    mode (MHA cases are ``query_head``: one query head per KV head)."""
    cluster, settings = CASES.READINGS[reading]
    granularity = "query_head" if mode == "query_head" else "kv_head"
    window = settings["window"]
    if cluster in ("snapkv", "pyramidkv"):
        fields = {"window": window, "kernel": settings["kernel"], "pooling": "max", "granularity": granularity,
                  "group_agg": "mean_before_pool" if mode == "kv_head" else "mean"}
        if cluster == "pyramidkv":
            return PyramidKV(**{**fields, "beta": settings["beta"], "schedule": PYRAMID_SCHEDULE[commit], **override})
        return SnapKV(**{**fields, **override})
    if cluster == "h2o":
        return H2O(**{"variant": H2O_VARIANT[commit], "window": window, "granularity": granularity, **override})
    if cluster == "streamingllm":
        window = None if window == "C-4" else window
        return StreamingLLM(**{"variant": "kvfactory", "window": window, "sink_size": 4, "granularity": granularity,
                               **override})
    return CaM(**{"variant": "prefill_only", "window": window, "start_budget_ratio": settings["start_budget_ratio"],
                  "granularity": granularity, **override})


def kvbench_kept(method, case: dict) -> list[list[int]]:
    """The token indices ``method`` keeps per head at one layer's prefill of ``case``."""
    arrays = CASES.inputs(case)
    queries = torch.from_numpy(arrays["queries"])[None]
    keys = torch.from_numpy(arrays["keys"])[None]
    layer = make_layer(keys, keys)  # values play no part in which tokens stay
    ctx = prefill_ctx(queries, layer, case["budget"], layer_idx=case.get("layer", 0), num_layers=CASES.NUM_LAYERS)
    method.prefill_attend(layer, ctx)
    method.prefill(layer, ctx)
    return kept_positions(layer)


def _mismatches(commit: str, cluster: str, where=lambda case: True, **override) -> tuple[list[str], int]:
    cases = [c for c in _fixture(commit)["cases"] if CASES.READINGS[c["reading"]][0] == cluster and where(c)]
    out = []
    for case in cases:
        got = CASES.digests(kvbench_kept(kvbench_method(case["reading"], commit, case["mode"], **override), case))
        heads = [h for h, (a, b) in enumerate(zip(got, case["kept"])) if a != b]
        if heads or len(got) != len(case["kept"]):
            out.append(f"{case['reading']} {case['mode']} {case['shape']} n={case['n']} C={case['budget']} "
                       f"seed={case['seed']} layer={case.get('layer')}: heads {heads or 'count'} differ")
    return out, len(cases)


# ---- the fixtures are what they say ----------------------------------------------------------------------------------
@pytest.mark.parametrize("commit", COMMITS)
def test_parity_fixture_provenance_and_inputs(commit):
    data = _fixture(commit)
    assert data["reference"]["repository"] == "Zefan-Cai/KVCache-Factory"
    assert data["reference"]["commit"].startswith(commit) and data["reference"]["transformers"] == "4.44.2"
    seen = {(c["reading"], c["mode"], c["shape"]) for c in data["cases"]}
    for reading, (cluster, _) in CASES.READINGS.items():
        if commit not in CASES.AVAILABLE.get(cluster, COMMITS):
            assert not any(r == reading for r, _, _ in seen)
            continue
        assert (reading, "query_head", "mha") in seen and (reading, "query_head", "gqa") in seen
        assert ((reading, "kv_head", "gqa") in seen) == (commit == "c97f9d7")
    assert {c["n"] for c in data["cases"]} == set(CASES.LENGTHS)
    assert {c["budget"] for c in data["cases"]} == set(CASES.BUDGETS)
    for case in data["cases"][:: max(1, len(data["cases"]) // 40)]:  # the seeded inputs are still what it saw
        assert CASES.checksum(CASES.inputs(case)) == pytest.approx(case["checksum"], rel=1e-12)


# ---- every named reading equals the code it names --------------------------------------------------------------------
@pytest.mark.parametrize("commit", COMMITS)
def test_snapkv_parity_with_kvcache_factory(commit):
    """Window 8 and 32, kernel 7, max-pool: kvbench keeps the reference's tokens on every case, ties included."""
    bad, total = _mismatches(commit, "snapkv")
    assert total >= 72 and not bad, "\n".join(bad)


@pytest.mark.parametrize("commit", COMMITS)
def test_pyramidkv_parity_with_kvcache_factory(commit):
    bad, total = _mismatches(commit, "pyramidkv")
    assert total >= 72 and not bad, "\n".join(bad)


@pytest.mark.parametrize("commit", COMMITS)
def test_pyramidkv_parity_capacities_every_layer(commit):
    """``pyramid_capacity`` under the commit's schedule equals the code's per-layer list (32 and 28 layers, every n
    and C of the grid, C 64 and 512 at n 2047 among them)."""
    for row in _fixture(commit)["capacities"]:
        ours = pyramid_capacity(row["budget"], row["n"], row["window"], row["beta"], row["layers"],
                                PYRAMID_SCHEDULE[commit])
        assert ours == row["past"], (row["n"], row["budget"], row["layers"])


def test_pyramidkv_parity_the_exact_schedule_is_no_version_of_the_code():
    """``schedule=exact`` is kvbench's own reading; the two dated schedules differ from each other."""
    rows = {c: {(r["n"], r["budget"], r["layers"]): r["past"] for r in _fixture(c)["capacities"]} for c in COMMITS}
    for n, budget, layers in rows["57e1c26"]:
        if n >= 2 * (budget - 8):  # where the pyramid applies
            exact = pyramid_capacity(budget, n, 8, 20, layers, "exact")
            assert all(exact != r[(n, budget, layers)] for r in rows.values()), (n, budget, layers)
    assert rows["57e1c26"][(2047, 512, 32)][-1] == 84 and rows["7ee6be0"][(2047, 512, 32)][-1] == 53


@pytest.mark.parametrize("commit", COMMITS)
def test_h2o_parity_with_kvcache_factory(commit):
    bad, total = _mismatches(commit, "h2o")
    assert total >= 72 and not bad, "\n".join(bad)


@pytest.mark.parametrize(("commit", "other"), [("57e1c26", "prefill_only"), ("7ee6be0", "prefill_only"),
                                               ("c97f9d7", "kvfactory_2410"), ("7ee6be0", "kvfactory_2406")])
def test_h2o_parity_each_period_is_its_own_reading(commit, other):
    """Another period's reading does not reproduce the commit's kept sets (the fixtures tell the readings apart)."""
    bad, total = _mismatches(commit, "h2o", lambda c: c["n"] == 1000, variant=other)  # every C compresses
    assert len(bad) > total // 2, f"{other} reproduces {commit} on {total - len(bad)} of {total} cases"


@pytest.mark.parametrize("commit", COMMITS)
def test_streamingllm_parity_with_kvcache_factory(commit):
    bad, total = _mismatches(commit, "streamingllm")
    assert total >= 72 and not bad, "\n".join(bad)


@pytest.mark.parametrize("commit", ("7ee6be0", "c97f9d7"))
def test_cam_parity_with_kvcache_factory(commit):
    bad, total = _mismatches(commit, "cam")
    assert total >= 36 and not bad, "\n".join(bad)


# ---- what the fixtures catch -----------------------------------------------------------------------------------------
def test_snapkv_parity_needs_the_references_selection_form():
    """Top-C over every token with the window at +inf (kvbench's earlier selection) breaks max-pooling's ties
    differently from the reference's top-(C - w) over the past: the fixtures see it."""
    import kvbench.methods.scorer as scorer  # SnapKV selects through the scorer base

    original = scorer.keep_top
    try:
        scorer.keep_top = lambda layer, scores, keep, window=0: original(layer, scores, keep)
        bad, total = _mismatches("57e1c26", "snapkv", lambda c: c["reading"] == "snapkv_w8")
    finally:
        scorer.keep_top = original
    assert bad, f"the old selection form matched all {total} cases"


def test_snapkv_parity_kv_head_order_matters():
    """At c97f9d7 the reference's kv_head mode averages the group before pooling; kvbench's ``group_agg=mean``
    (after pooling) is a different reading."""
    bad, _ = _mismatches("c97f9d7", "snapkv", lambda c: c["mode"] == "kv_head", group_agg="mean")
    assert any(" kv_head gqa " in line for line in bad)
