"""OmniKV against the official code: kvbench's filter-layer selections equal, exactly and step by step, what
antgroup/OmniKV at 5c33cb5 (transformers 4.41.2) selects on the same seeded inputs, for all four selectors.

The fixtures ``tests/fixtures/parity/omnikv_<selector>.json`` were written by ``scripts/parity/omnikv/generate.py``
next to the official code (scripts/parity/README.md); this test needs neither: it rebuilds each case's inputs from
its seed (``scripts/parity/omnikv/cases.py``) and hands them to kvbench as the engine would (queries rotated at their
own positions, the module's scale, the model's RoPE frequencies).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from parity_inputs import parity_cases

from helpers import make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.methods.base import DecodeContext
from kvbench.methods.omnikv import OmniKV

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"
SELECTORS = ("last", "softmax_before_last", "uniform", "exp")


CASES = parity_cases("omnikv")


def _fixture(selector: str) -> dict:
    return json.loads((FIXTURES / f"omnikv_{selector}.json").read_text())


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """As transformers computes a default RoPE's frequencies."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` ``(H, T, D)`` rotated at ``positions`` ``(T,)``, as transformers' ``apply_rotary_pos_emb``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = x.shape[-1] // 2
    return x * emb.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * emb.sin()


def kvbench_selections(selector: str, case: dict, **fields) -> list[list[int]]:
    """kvbench's filter layer 0 (of 3) on the case: one prefill, then ``steps`` decode steps."""
    arrays = CASES.inputs(case)
    hkv, d, n, k = case["kv_heads"], case["head_dim"], case["n"], case["k"]
    queries, keys = torch.from_numpy(arrays["queries"]), torch.from_numpy(arrays["keys"])
    inv_freq = _inv_freq(d, case["rope_theta"])
    post = _rope(queries, torch.arange(queries.shape[1]), inv_freq)[None]  # (1, Hq, n + steps, D)
    method = OmniKV(filter_layers=[0], selector=selector, window=case["window"], **fields)
    method.validate(Budget.parse(k))
    layer = make_layer(keys[None], torch.zeros_like(keys)[None])
    method.prefill(layer, replace(prefill_ctx(post[:, :, :n], layer, k, layer_idx=0, num_layers=3),
                                  rope_inv_freq=inv_freq))
    out = []
    for step in range(case["steps"]):
        new_key = torch.from_numpy(arrays["new_keys"][:, step : step + 1])[None]
        layer.update(new_key, torch.zeros_like(new_key))
        ctx = DecodeContext(layer_idx=0, num_layers=3, num_kv_heads=hkv, query=post[:, :, n + step : n + step + 1],
                            probs=None, capacity=torch.tensor([k]), scaling=d**-0.5, rope_inv_freq=inv_freq)
        assert method.select(layer, ctx) is None  # the filter layer attends densely
        out.append(method._selection[0][0].tolist())
    return out


@pytest.mark.parametrize("selector", SELECTORS)
def test_fixture_provenance_and_inputs(selector):
    data = _fixture(selector)
    assert data["selector"] == selector and data["official"]["repository"] == "antgroup/OmniKV"
    assert data["official"]["commit"].startswith("5c33cb5") and data["official"]["transformers"] == "4.41.2"
    assert len(data["cases"]) >= 10
    shapes = {(c["heads"], c["kv_heads"]) for c in data["cases"]}
    assert any(hq > hkv > 1 for hq, hkv in shapes) and any(hkv == 1 for _, hkv in shapes)  # GQA and MQA
    for case in data["cases"]:  # the seeded inputs are still the ones the official code saw
        assert CASES.checksum(CASES.inputs(case)) == pytest.approx(case["checksum"], rel=1e-12)
        assert len(case["selections"]) == case["steps"]


@pytest.mark.parametrize("selector", SELECTORS)
def test_selections_equal_the_official_code(selector):
    mismatches = []
    for case in _fixture(selector)["cases"]:
        ours = kvbench_selections(selector, case)
        for step, (got, official) in enumerate(zip(ours, case["selections"])):
            if got != official:
                mismatches.append(f"seed {case['seed']} step {step}: kvbench {got}, official {official}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("selector", ["uniform", "exp"])
def test_the_paper_reading_is_not_the_official_code(selector):
    """``window_reading=paper`` (softmax over the whole prompt, window queries at their own positions) is a different
    reading, and the fixtures tell them apart."""
    cases = _fixture(selector)["cases"]
    same = total = 0
    for case in cases:
        for got, official in zip(kvbench_selections(selector, case, window_reading="paper"), case["selections"]):
            same += got == official
            total += 1
    assert same < total
