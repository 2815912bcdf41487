"""TOVA's default reading (``variant=paper``) against the official code (schwartz-lab-NLP/TOVA 9c7d09b).

tests/fixtures/parity/tova_official.json was written by scripts/parity/tova/generate.py, which runs the official
``TOVACache`` + ``enable_tova_caching`` (transformers 4.36.2) through ``model.generate`` on seeded post-RoPE
queries/keys/values (tests/parity_inputs.py); this test feeds kvbench's TOVA the same tensors layer by layer, as the
engine does, and needs neither the official code nor its environment.

Compared exactly: the positions each layer holds after the prompt's reduction and after every decode step (one set
per layer: the code gathers every KV head with one index; kvbench keeps it for every KV head). Within
``rtol=1e-5, atol=1e-6``: the scores of the prompt's reduction (``prefill_scores``) and of the last decode step (what
the decode hook ranks), per position. The kvpress reading (``variant=kvpress_prefill``) never evicts while decoding
and differs from the code after the first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import digest, from_mask, layer_scale, stream

import kvbench.methods.tova as tova_module
from helpers import decode_step, kept_positions, make_layer, prefill_ctx
from kvbench.methods.tova import TOVA

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "tova_official.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
TOL = FIXTURE["tolerance"]


def _streams(case):
    n, steps, hq, hkv, d, layers = (case[k] for k in ("n", "steps", "hq", "hkv", "d", "layers"))
    out = [stream(case["seed"], li, n, steps, hq, hkv, d, layer_scale(li, layers), case["sink"])
           for li in range(layers)]
    assert digest(*[a for s in out for a in s]) == case["input_sha"], "the seeded inputs changed"
    return [tuple(torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in s) for s in out]


def _run(method, case, on_step=None):
    """Prefill then decode every layer; yields (layer index, step, layer) after the prompt (step 0) and each step."""
    n, cap = case["n"], case["cache_size"]
    for li, (q, k, v) in enumerate(_streams(case)):
        layer = make_layer(k[:, :, :n].clone(), v[:, :, :n].clone())
        ctx = prefill_ctx(q[:, :, :n], layer, cap, layer_idx=li, num_layers=case["layers"])
        method.prefill(layer, ctx)
        yield li, 0, layer, ctx
        for step in range(1, case["steps"] + 1):
            t = n + step - 1
            decode_step(method, layer, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], cap)
            yield li, step, layer, None


def test_fixture_is_the_official_codes():
    assert FIXTURE["official"]["repo"] == "schwartz-lab-NLP/TOVA"
    assert FIXTURE["official"]["commit"].startswith("9c7d09b")
    assert FIXTURE["environment"]["transformers"] == "4.36.2"
    assert len(CASES) >= 8 and sum(c["hkv"] < c["hq"] for c in CASES.values()) >= 4
    assert any(c["n"] <= c["cache_size"] for c in CASES.values())  # a prompt that fits: eviction while decoding only


@pytest.mark.parametrize("name", sorted(CASES))
def test_tova_paper_reading_keeps_what_the_official_code_keeps(name):
    case = CASES[name]
    method = TOVA()
    assert method.variant == "paper"
    for li, step, layer, _ in _run(method, case):
        official = from_mask(case["per_layer"][li]["kept"][step])
        ours = kept_positions(layer)
        assert all(h == official for h in ours), (name, li, step)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tova_scores_equal_the_official_codes(name, monkeypatch):
    """The prompt's scores (``prefill_scores``) and the last decode step's (the scores the decode hook hands to
    ``keep_top``), per position, within the fixture's tolerance."""
    case = CASES[name]
    ranked = []
    real_keep_top = tova_module.keep_top
    monkeypatch.setattr(tova_module, "keep_top", lambda layer, scores, cap: (
        ranked.append((layer.positions[0, 0].tolist(), scores[0, 0].double())), real_keep_top(layer, scores, cap)))
    method = TOVA()
    for li, step, _layer, ctx in _run(method, case):
        theirs = case["per_layer"][li]
        if step == 0:
            ours = method.prefill_scores(_fresh(case, li), ctx)[0].double()
            assert bool((ours == ours[:1]).all())  # one score per position, the same for every KV head
            torch.testing.assert_close(ours[0], torch.tensor(theirs["prefill_scores"], dtype=torch.float64),
                                       rtol=TOL["scores_rtol"], atol=TOL["scores_atol"])
        if step == case["steps"]:
            positions, scores = ranked[-1]
            by_pos = dict(zip(positions, scores.tolist()))
            official = dict(zip(theirs["last_positions"], theirs["last_scores"]))
            assert sorted(by_pos) == sorted(official)
            torch.testing.assert_close(torch.tensor([by_pos[p] for p in sorted(official)], dtype=torch.float64),
                                       torch.tensor([official[p] for p in sorted(official)], dtype=torch.float64),
                                       rtol=TOL["scores_rtol"], atol=TOL["scores_atol"])


def _fresh(case, li):
    """Layer ``li``'s whole prompt (``prefill_scores`` reads the keys before any eviction)."""
    _, k, v = _streams(case)[li]
    return make_layer(k[:, :, : case["n"]].clone(), v[:, :, : case["n"]].clone())


def test_kvpress_prefill_reading_is_not_the_official_code():
    """kvpress's TOVAPress selects once at prefill (last token forced) and never evicts while decoding: the cache
    grows past the code's size at the first step."""
    case = CASES["mha_n100_c50"]
    for li, step, layer, _ in _run(TOVA(variant="kvpress_prefill"), case):
        if step == 1:
            assert layer.num_entries == case["cache_size"] + 1
            assert kept_positions(layer)[0] != from_mask(case["per_layer"][li]["kept"][1])
