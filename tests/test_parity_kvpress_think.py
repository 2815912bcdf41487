"""ThinK against kvpress: the key channels kvbench keeps per (row, KV head) equal, exactly, the channels kvpress 0.5.5's
``ThinKPress`` leaves unzeroed on the same seeded inputs (MHA, GQA, MQA, two rows, a prompt shorter than the window).

The fixture ``tests/fixtures/parity/kvpress_think.json`` was written by ``scripts/parity/kvpress/generate_think.py``
in the kvpress side environment (scripts/parity/README.md); this test needs neither kvpress nor that environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import parity_cases

from helpers import make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.methods import build_method
from kvbench.methods.think import channel_scores, kept_channels

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "parity" / "kvpress_think.json").read_text())


CASES = parity_cases("kvpress")


def _inputs(case):
    q, k = CASES.think_inputs(case)
    assert CASES.digest_arrays(q, k) == case["inputs_sha256"], "the seeded inputs changed"
    return torch.from_numpy(q), torch.from_numpy(k)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"case{c['index']}")
def test_kvpress_think_channel_selection(case):
    queries, keys = _inputs(case)
    scores = channel_scores(queries[..., -case["window"]:, :], keys)
    assert kept_channels(scores, case["ratio"]).tolist() == case["kept"]


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"case{c['index']}")
def test_kvpress_think_method_stores_the_kept_channels(case):
    """The method, with SnapKV keeping the whole prompt (budget >= n): keys stored with kvpress's kept channels only,
    the kept columns unchanged, values whole."""
    queries, keys = _inputs(case)
    budget = Budget.parse(case["n"] + 40)
    method = build_method({"name": "think", "window": case["window"],
                           "key_channel_compression_ratio": case["ratio"]}, budget)
    values = torch.randn(*keys.shape[:3], case["head_dim"])
    layer = make_layer(keys.clone(), values)
    ctx = prefill_ctx(queries, layer, case["n"] + 40)
    method.prefill(layer, ctx)
    method.finish_prefill([layer], ctx)
    assert layer.key_channels.tolist() == case["kept"]
    kept = torch.tensor(case["kept"])
    assert torch.equal(layer.keys, torch.gather(keys, -1, kept.unsqueeze(2).expand(-1, -1, case["n"], -1)))
    assert layer.values.shape == values.shape and torch.equal(layer.values, values)


def test_kvpress_think_zero_reading_zeroes_the_same_channels():
    case = FIXTURE["cases"][1]
    queries, keys = _inputs(case)
    method = build_method({"name": "think", "storage": "kvpress_zero", "key_channel_compression_ratio": case["ratio"]},
                          Budget.parse(case["n"]))
    layer = make_layer(keys.clone(), torch.zeros_like(keys))
    ctx = prefill_ctx(queries, layer, case["n"])
    method.prefill(layer, ctx)
    method.finish_prefill([layer], ctx)
    assert layer.key_channels is None and layer.keys.shape == keys.shape
    nonzero = (layer.keys != 0).any(dim=2)
    assert [[torch.nonzero(nonzero[r, h]).flatten().tolist() for h in range(nonzero.shape[1])]
            for r in range(nonzero.shape[0])] == case["kept"]
