"""AdaKV against the official code (FFY0/AdaKV efe4e2e: ``AdaptiveSnapKVCluster`` through the patched Llama).

tests/fixtures/parity/adakv_official.json was written by scripts/parity/adakv/generate.py, which runs the official
``replace_llama_adaptive`` model (transformers 4.44.2, pred.py's settings: window 32, kernel 7, max-pool; FlashAttention
stubbed, prefill only) on seeded post-RoPE queries/keys/values (tests/parity_inputs.py); these tests feed kvbench's
AdaKV over SnapKV the same tensors layer by layer and need neither the official code nor its environment.

The code's scores are SnapKV's (window means, pooled; per query head with K/V repeated, or per KV head averaged before
pooling with ``gqa_support``): kvbench's ``snapkv`` scorer with ``kernel=7`` and ``granularity=query_head`` or
``group_agg=mean_before_pool``. Compared:

* ``allocation=official_code``: the per-head budgets and kept positions of every head of every layer, exactly;
* the scorer's scores (window sums in kvbench, divided by the window) against the code's, rtol 1e-5 / atol 1e-7;
* the default ``allocation=kvpress`` (kvpress ``AdaKVPress``'s safeguard) allocates differently: named differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import digest, from_mask, layer_scale, stream

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.methods import METHODS

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "adakv_official.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
TOL = FIXTURE["tolerance"]
WINDOW = FIXTURE["settings"]["window_size"]


def _arrays(case, li):
    return stream(case["seed"], li, case["n"], 0, case["hq"], case["hkv"], case["d"], layer_scale(li, case["layers"]),
                  0.0)


def _inputs(case, li):
    return tuple(torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in _arrays(case, li))


def _method(case, allocation="official_code"):
    fields = {"window": WINDOW, "kernel": FIXTURE["settings"]["kernel_size"], "pooling": "max"}
    fields.update({"group_agg": "mean_before_pool"} if case["gqa_support"] else {"granularity": "query_head"})
    return METHODS.build("adakv", {"scorer": "snapkv", "scorer_fields": fields,
                                   "alpha_safeguard": case["floor_alpha"], "allocation": allocation})


def _run(case, allocation="official_code"):
    """Each layer's kept positions per head after kvbench's AdaKV prefill."""
    out = []
    for li in range(case["layers"]):
        q, k, v = _inputs(case, li)
        layer = make_layer(k.clone(), v.clone())
        _method(case, allocation).prefill(layer, prefill_ctx(q, layer, case["budget"], li, case["layers"]))
        out.append(kept_positions(layer))
    return out


def test_fixture_is_the_official_codes():
    assert FIXTURE["official"]["repo"] == "FFY0/AdaKV" and FIXTURE["official"]["commit"].startswith("efe4e2e")
    assert FIXTURE["environment"]["transformers"] == "4.44.2"
    assert FIXTURE["settings"] == {"window_size": 32, "kernel_size": 7, "pooling": "maxpool", "gqa_func": "mean"}
    assert len(CASES) >= 10 and sum(c["gqa_support"] for c in CASES.values()) >= 3
    for case in CASES.values():
        arrays = [a for li in range(case["layers"]) for a in _arrays(case, li)]
        assert digest(*arrays) == case["input_sha"], f"{case['name']}: the seeded inputs changed"


@pytest.mark.parametrize("name", sorted(CASES))
def test_adakv_official_code_allocation_equals_the_code(name):
    case = CASES[name]
    for li, ours in enumerate(_run(case)):
        official = case["per_layer"][li]
        assert [len(p) for p in ours] == official["budgets"], (name, li)
        assert ours == [from_mask(m) for m in official["kept"]], (name, li)


@pytest.mark.parametrize("name", sorted(CASES))
def test_adakv_scorer_scores_equal_the_codes(name):
    case = CASES[name]
    q, k, v = _inputs(case, 0)
    layer = make_layer(k.clone(), v.clone())
    ctx = prefill_ctx(q, layer, case["budget"], 0, case["layers"])
    scores = _method(case).scorer_scores(layer, ctx)[0].double()
    n = case["n"]
    assert bool(torch.isinf(scores[:, n - WINDOW :]).all())  # the window: outside the allocation, as in the code
    torch.testing.assert_close(scores[:, : n - WINDOW] / WINDOW,
                               torch.tensor(case["per_layer"][0]["scores"], dtype=torch.float64),
                               rtol=TOL["scores_rtol"], atol=TOL["scores_atol"])


def test_adakv_default_allocation_is_kvpress_not_the_code():
    """kvpress's safeguard counts SnapKV's +inf window as each head's top ``int(alpha * C)`` (so it guards nothing
    beyond the window when ``alpha * C <= 32``) and keeps exactly ``heads x C``; the code guards ``int(alpha (C - 32))``
    past tokens per head, gives the rest by share, and rounds (the total can be off by a few entries)."""
    compressed = [c for c in CASES.values() if c["n"] > c["budget"]]
    differ = sum(_run(c, "kvpress") != [[from_mask(m) for m in layer["kept"]] for layer in c["per_layer"]]
                 for c in compressed)
    assert differ == len(compressed)
    mqa = CASES["mqa_n120_c40"]  # one head: the code keeps round(8 * 0.8 + 1) + 32 = 39 of the budget's 40
    assert mqa["per_layer"][0]["budgets"] == [39] and [len(p) for p in _run(mqa, "kvpress")[0]] == [40]
    gqa = CASES["gqa_n200_c48_a05"]  # alpha 0.5: the code guards 8 past tokens per head, kvpress only the window
    ours = [len(p) for p in _run(gqa, "kvpress")[0]]
    assert min(ours) == WINDOW and min(gqa["per_layer"][0]["budgets"]) >= WINDOW + 8


def test_the_default_allocation_is_the_authors_and_old_keys_read_as_kvpress():
    """The default is the authors' code and enters the result key; kvpress's, which every AdaKV result stored before
    the option ran, stays out of it (those results keep their hash) and reports read a key without the field as it."""
    from kvbench.report.store import method_label

    assert METHODS.build("adakv", {}).describe()["allocation"] == "official_code"
    assert "allocation" not in METHODS.build("adakv", {"allocation": "kvpress"}).describe()
    assert method_label({"name": "adakv-snapkv", "layout": "ragged"}) == "adakv-snapkv[allocation=kvpress]"
    assert method_label({"name": "adakv-snapkv", "allocation": "official_code"}) == "adakv-snapkv"
