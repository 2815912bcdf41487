"""ThinK against the official code (SalesforceAIResearch/ThinK d200577, ``ThinK_eager``).

tests/fixtures/parity/think_official.json was written by scripts/parity/think/generate.py, which runs the official
``replace_llama("snapkv")`` model (transformers 4.40.0, the LongBench script's settings: SnapKV window 32, kernel 7,
max-pool, ``recent_size`` 32) through ``generate`` on seeded post-RoPE queries/keys/values (tests/parity_inputs.py);
this test feeds kvbench's ThinK the same tensors layer by layer, as the engine does, and needs neither the official
code nor its environment.

The code repeats K/V to the query heads before SnapKV and channel pruning (``repeat_kv`` before ``update_thinkv``), so
it keeps one token set and one channel set per query head. kvbench's reading of that: ``think`` with
``inner={name: snapkv, kernel: 7, granularity: query_head}`` (the cache repeated to the query heads, then ThinK's
``channel_scores`` with one query head per group). Compared exactly: the kept positions and the kept key channels per
query head of every layer; within rtol 1e-5 / atol 1e-6: the channel scores (the tensor the code hands to
``torch.topk``). On MHA a query head is a KV head: there kvbench's default granularity is compared too.

Not the code's reading, by design (docs/method_ambiguities.md, ThinK rows 3-4): the code keeps the last
``recent_size`` = 32 kept entries and every generated key with all channels; kvbench stores every key of the layer
with the kept channels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import digest, from_mask, layer_scale, stream

import kvbench.methods.think as think_module
from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.methods import build_method

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "think_official.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
TOL = FIXTURE["tolerance"]
SETTINGS = FIXTURE["settings"]


def _streams(case):
    n, steps, hq, hkv, d, layers = (case[k] for k in ("n", "steps", "hq", "hkv", "d", "layers"))
    out = [stream(case["seed"], li, n, steps, hq, hkv, d, layer_scale(li, layers), 0.0) for li in range(layers)]
    assert digest(*[a for s in out for a in s]) == case["input_sha"], "the seeded inputs changed"
    return [tuple(torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in s) for s in out]


def _method(case, granularity="query_head"):
    inner = {"name": "snapkv", "window": SETTINGS["window_size"], "kernel": SETTINGS["kernel_size"],
             "pooling": "max", "granularity": granularity}
    return build_method({"name": "think", "key_channel_compression_ratio": case["ratio"], "window": 32,
                         "inner": inner}, Budget.parse(case["budget"]))


def _prefill(method, case):
    n, layers, ctx = case["n"], [], None
    for li, (q, k, v) in enumerate(_streams(case)):
        layer = make_layer(k[:, :, :n].clone(), v[:, :, :n].clone())
        ctx = prefill_ctx(q[:, :, :n], layer, case["budget"], layer_idx=li, num_layers=case["layers"])
        method.prefill(layer, ctx)
        layers.append(layer)
    method.finish_prefill(layers, ctx)
    return layers


def test_fixture_is_the_official_codes():
    assert FIXTURE["official"]["repo"] == "SalesforceAIResearch/ThinK"
    assert FIXTURE["official"]["commit"].startswith("d200577")
    assert FIXTURE["environment"]["transformers"] == "4.40.0"
    assert SETTINGS == {"window_size": 32, "kernel_size": 7, "pooling": "maxpool", "recent_size": 32}
    assert len(CASES) >= 8 and sum(c["hkv"] < c["hq"] for c in CASES.values()) >= 4
    assert any(c["n"] <= c["budget"] for c in CASES.values())  # channels pruned with every token kept


@pytest.mark.parametrize("name", sorted(CASES))
def test_think_keeps_the_official_tokens_and_channels(name, monkeypatch):
    case = CASES[name]
    scores = []
    real = think_module.channel_scores
    monkeypatch.setattr(think_module, "channel_scores", lambda *a: scores.append(real(*a)) or scores[-1])
    layers = _prefill(_method(case), case)
    for li, (layer, official) in enumerate(zip(layers, case["per_layer"])):
        assert kept_positions(layer) == [from_mask(m) for m in official["kept"]], (name, li)
        assert layer.key_channels[0].tolist() == official["channels"], (name, li)
        assert layer.keys.shape[-1] == case["d"] - int(case["d"] * case["ratio"])
        torch.testing.assert_close(scores[li][0].double(), torch.tensor(official["channel_scores"],
                                                                         dtype=torch.float64),
                                   rtol=TOL["scores_rtol"], atol=TOL["scores_atol"])


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c["hq"] == c["hkv"]))
def test_think_default_granularity_is_the_official_code_on_mha(name):
    case = CASES[name]
    for layer, official in zip(_prefill(_method(case, granularity="kv_head"), case), case["per_layer"]):
        assert kept_positions(layer) == [from_mask(m) for m in official["kept"]]
        assert layer.key_channels[0].tolist() == official["channels"]


def test_think_gqa_channels_are_per_query_head_in_the_official_code():
    """On GQA the code's query heads of one KV group keep different channels (and tokens): kvbench's default
    (one channel set per KV head, q^2 averaged over the group) cannot be the code's there."""
    for case in CASES.values():
        group = case["hq"] // case["hkv"]
        if group == 1:
            continue
        channels = case["per_layer"][0]["channels"]
        assert any(channels[h] != channels[h - h % group] for h in range(case["hq"])), case["name"]
        layers = _prefill(_method(case, granularity="kv_head"), case)
        assert layers[0].key_channels.shape[1] == case["hkv"]


def test_think_official_code_keeps_recent_and_generated_keys_whole():
    """The code stores the last ``recent_size`` kept entries (and the generated ones) with every channel; kvbench's
    ``storage=pruned`` stores every key with the kept channels (the difference is the memory reading, not the
    channels)."""
    for case in CASES.values():
        for official in case["per_layer"]:
            kept = len(from_mask(official["kept"][0]))
            assert official["pruned_entries"] == kept - SETTINGS["recent_size"]
            assert official["whole_width_entries"] == SETTINGS["recent_size"] + case["steps"]
    case = CASES["mha_n100_c64"]
    layer = _prefill(_method(case), case)[0]
    assert layer.keys.shape[2] == case["budget"] and layer.keys.shape[-1] == case["d"] - int(case["d"] * 0.4)
