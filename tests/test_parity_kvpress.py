"""kvbench's kvpress-equivalent readings against kvpress 0.5.5: scores and kept sets of KnormPress, KeyDiffPress
(alone and in BlockPress), TOVAPress, ExpectedAttentionPress, and AdaKVPress / ChunkKVPress around KnormPress and
ExpectedAttentionPress, on seeded MHA and GQA inputs of 40, 100 and 257 tokens at compression ratios 0.5 and 0.75.

The fixtures ``tests/fixtures/parity/kvpress_<press>.json`` were written by ``scripts/parity/kvpress/generate.py``
next to kvpress (scripts/parity/README.md); this test needs neither: it rebuilds each case's inputs from its seed
(``scripts/parity/kvpress/cases.py``) and hands them to kvbench as the engine would (queries rotated at their own
positions, the model's RoPE frequencies in the context).

Compared: kept sets exactly (every head of every case); scores within ``rtol=1e-5, atol=1e-6`` (float32 arithmetic
in a different order), except the entries kvpress forces with ``max + 1`` (TOVA's last token, Expected Attention's
sinks), which kvbench marks ``+inf``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from parity_inputs import parity_cases

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"
CASES = parity_cases("kvpress")

#: fixture -> the kvbench method (and fields) that is its kvpress reading
READINGS = {
    "knorm": {"name": "knorm"},
    "keydiff": {"name": "keydiff", "mode": "whole_prompt"},
    "keydiff_block16": {"name": "keydiff", "mode": "block", "block_size": 16},
    "keydiff_block128": {"name": "keydiff", "mode": "block", "block_size": 128},
    "tova": {"name": "tova", "variant": "kvpress_prefill"},
    "expected_attention": {"name": "expected_attention"},
    "adakv_knorm": {"name": "adakv", "scorer": "knorm", "allocation": "kvpress"},
    "adakv_expected_attention": {"name": "adakv", "scorer": "expected_attention", "allocation": "kvpress"},
    "chunkkv_knorm": {"name": "chunkkv", "scorer": "knorm", "variant": "kvpress"},
    "chunkkv_expected_attention": {"name": "chunkkv", "scorer": "expected_attention", "variant": "kvpress"},
}
#: kvpress pads these entries with max + 1; kvbench gives them +inf
FORCED = {"tova": lambda n: [n - 1], "expected_attention": lambda n: list(range(4))}


def _inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (CASES.ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _rope(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` ``(H, n, D)`` rotated at positions 0..n-1, as transformers' ``apply_rotary_pos_emb``."""
    freqs = torch.arange(x.shape[1]).float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = x.shape[-1] // 2
    return x * emb.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * emb.sin()


def _setup(case: dict, capacity: int):
    arrays = CASES.inputs(case)
    assert CASES.digest(arrays) == case["inputs_sha256"]
    inv_freq = _inv_freq(case["d"])
    queries = _rope(torch.from_numpy(arrays["queries"]).transpose(0, 1), inv_freq)[None]  # (1, Hq, n, D)
    keys = torch.from_numpy(arrays["keys"]).transpose(0, 1)[None]
    values = torch.from_numpy(arrays["values"]).transpose(0, 1)[None]
    layer = make_layer(keys, values)
    ctx = replace(prefill_ctx(queries, layer, capacity), rope_inv_freq=inv_freq)
    return layer, ctx


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"kvpress_{name}.json").read_text())


def _method(name: str):
    cfg = dict(READINGS[name])
    return METHODS.build(cfg.pop("name"), cfg)


@pytest.mark.parametrize("press", list(READINGS))
def test_kvpress_kept_sets_are_equal(press):
    fixture = _fixture(press)
    assert fixture["kvpress"] == "0.5.5" and len(fixture["cases"]) == 12
    for case in fixture["cases"]:
        layer, ctx = _setup(case, case["n_kept"])
        method = _method(press)
        method.prefill(layer, ctx)
        assert kept_positions(layer) == case["kept"], (press, case["seed"], case["n"], case["ratio"])


@pytest.mark.parametrize("press", [p for p in READINGS if not p.startswith(("keydiff_block", "adakv", "chunkkv"))])
def test_kvpress_scores_are_equal_within_tolerance(press):
    for case in _fixture(press)["cases"]:
        layer, ctx = _setup(case, case["n_kept"])
        ours = _method(press).prefill_scores(layer, ctx)[0].double()
        ref = torch.tensor(case["scores"], dtype=torch.float64)
        forced = FORCED.get(press, lambda n: [])(case["n"])
        assert bool(torch.isinf(ours[:, forced]).all()) and bool((ours[:, forced] > 0).all())
        free = [i for i in range(case["n"]) if i not in forced]
        torch.testing.assert_close(ours[:, free], ref[:, free], rtol=1e-5, atol=1e-6)
        if forced:  # kvpress's pad is above every other score, as +inf is
            assert bool((ref[:, forced] > ref[:, free].max()).all())


def test_kvpress_wrapper_scores_are_the_scorers():
    """AdaKV and ChunkKV select over their scorer's ``prefill_scores``: the scores the fixtures of the scorers pin."""
    case = _fixture("expected_attention")["cases"][3]
    layer, ctx = _setup(case, case["n_kept"])
    wrapper = _method("adakv_expected_attention")
    torch.testing.assert_close(wrapper.scorer_scores(layer, ctx),
                               _method("expected_attention").prefill_scores(layer, ctx))


def test_kvpress_fixtures_cover_the_paper_defaults_too():
    """The paper readings are not kvpress's: TOVA's paper variant keeps no forced last token, KeyDiff's default is
    block-wise, ChunkKV's paper variant never chunks the must-keep entries; on these inputs they differ from the
    kvpress reading in at least one case (so the fixtures tell the readings apart)."""
    differs = 0
    for case in _fixture("tova")["cases"]:
        layer, ctx = _setup(case, case["n_kept"])
        METHODS.build("tova", {}).prefill(layer, ctx)
        differs += kept_positions(layer) != case["kept"]
    assert differs > 0
