"""D2O ``variant=official_code`` against golden fixtures produced by the official code (AIoT-MLSys-Lab/D2O 12c99d8).

tests/fixtures/parity/d2o.json was written by scripts/parity/d2o/generate.py, which runs the official patched model
``Llama3ForCausalLM_D2O`` (torch 2.1.2, transformers 4.37.2) on seeded post-RoPE queries/keys/values
(tests/parity_inputs.py); these tests feed kvbench's D2O the same tensors layer by layer, as the engine does, and need
neither the official code nor its environment. Compared exactly: kept positions per query head at every decode step,
per-layer (heavy, recent) sizes; within the fixture's stated tolerances: layer densities, allocation ratios, the EMA
threshold tau after every step, checksums of the merged keys/values (per layer each step, per head at the end).

* ``bug_compat=True`` (the code's repeat_kv query-head cache, layers 0/1/last uncompressed, tau carried to the next
  sample): every case (GQA included), both samples, every layer;
* the plain ``variant=official_code`` (KV-head decisions, every layer compressed, tau reset per sample): the MHA cases'
  first sample on the layers the code compresses (there a KV head is a query head); on GQA cases the kept sets differ
  (the named difference is real).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from parity_inputs import digest, layer_scale, stream, to_mask

from helpers import make_layer, prefill_ctx
from kvbench.engine.attention import grouped_attention
from kvbench.methods.base import DecodeContext
from kvbench.methods.d2o import D2O

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "d2o.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
TOL = FIXTURE["tolerance"]


def _streams(case, sample):
    n, steps, hq, hkv, d, layers = (case[k] for k in ("n", "steps", "hq", "hkv", "d", "layers"))
    out = [stream(sample["seed"], li, n, steps, hq, hkv, d, layer_scale(li, layers), case["sink"])
           for li in range(layers)]
    assert digest(*[a for s in out for a in s]) == sample["input_sha"], "the seeded inputs changed"
    return [tuple(torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in s) for s in out]


def _capacity(case) -> int:
    """Tokens per layer whose ratio to the prompt is exactly the code's rho = hh_ratio + recent_ratio."""
    rho = case["hh_ratio"] + case["recent_ratio"]
    cap = round(rho * case["n"])
    assert cap / case["n"] == rho
    return cap


def _run_sample(method, case, sample):
    """Prefill then decode one sample through every layer; yields (step, layers) after the prompt and each step."""
    n, num_layers, cap = case["n"], case["layers"], _capacity(case)
    streams = _streams(case, sample)
    layers, ctx = [], None
    for li, (q, k, v) in enumerate(streams):
        layer = make_layer(k[:, :, :n].clone(), v[:, :, :n].clone())
        ctx = prefill_ctx(q[:, :, :n], layer, cap, layer_idx=li, num_layers=num_layers)
        method.prefill(layer, ctx)
        layers.append(layer)
    method.finish_prefill(layers, ctx)
    yield 0, layers
    for step in range(1, case["steps"] + 1):
        t = n + step - 1
        for li, ((q, k, v), layer) in enumerate(zip(streams, layers)):
            query = q[:, :, t : t + 1]
            layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            _, probs = grouped_attention(query, layer.keys, layer.values, None, query.shape[-1] ** -0.5)
            method.decode(layer, DecodeContext(layer_idx=li, num_layers=num_layers, num_kv_heads=layer.keys.shape[1],
                                               query=query, probs=probs, capacity=torch.full((1,), cap)))
        yield step, layers


def _masks(layer, total):
    return [to_mask(layer.positions[0, h].tolist(), total) for h in range(layer.positions.shape[1])]


def _close(ours, theirs, rel):
    return math.isclose(ours, theirs, rel_tol=rel, abs_tol=rel)


def _check_step(case, sample_idx, rec, layers, step, only=None):
    total = case["n"] + case["steps"]
    for li, layer in enumerate(layers):
        if only is not None and li not in only:
            continue
        entry = rec[str(li)]
        where = f"{case['name']} sample {sample_idx} step {step} layer {li}"
        assert layer.num_entries == entry["len"], where
        if "kept" in entry:
            assert _masks(layer, total) == entry["kept"], where
        elif "kept_sha" in entry:
            assert hashlib.sha256(" ".join(_masks(layer, total)).encode()).hexdigest()[:16] == entry["kept_sha"], where
        if "tau" in entry:
            tau = float(layer.row_state["d2o_tau_key"][0, 0])
            assert (math.isnan(tau) and entry["tau"] is None) or abs(tau - entry["tau"]) <= TOL["tau"], where
        # the code's cache holds the query heads: a KV-head cache's sums count each KV head once per group
        rep = case["hq"] // layer.keys.shape[1]
        assert _close(rep * float(layer.keys.double().sum()), entry["k_sum"], TOL["checksum_rel"]), where
        assert _close(rep * float(layer.values.double().sum()), entry["v_sum"], TOL["checksum_rel"]), where
        if "k_head_sums" in entry and rep == 1:
            for ours, theirs in zip(layer.keys.double().sum((0, 2, 3)).tolist(), entry["k_head_sums"]):
                assert _close(ours, theirs, TOL["checksum_rel"]), where
            for ours, theirs in zip(layer.values.double().sum((0, 2, 3)).tolist(), entry["v_head_sums"]):
                assert _close(ours, theirs, TOL["checksum_rel"]), where


def test_fixture_is_the_official_codes():
    assert FIXTURE["official"] == {"repo": "AIoT-MLSys-Lab/D2O", "commit": "12c99d8", "files": [
        "LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py",
        "LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_new.py"]}
    assert FIXTURE["environment"]["transformers"] == "4.37.2" and FIXTURE["environment"]["torch"].startswith("2.1.2")
    assert len(CASES) >= 10 and sum(c["hkv"] < c["hq"] for c in CASES.values()) >= 5


@pytest.mark.parametrize("name", sorted(CASES))
def test_bug_compat_equals_the_official_code(name):
    case = CASES[name]
    split = case["recent_ratio"] / (case["hh_ratio"] + case["recent_ratio"])
    method = D2O(variant="official_code", bug_compat=True, **({} if split == 0.5 else {"recent_fraction": split}))
    assert (method.beta, method.recent_fraction) == (case["belta"], split)  # 0.5 / 0.5: the README's run
    assert (method.granularity, method.keep_edge_layers, method.carry_tau) == ("query_head", True, True)
    num_layers = case["layers"]
    for sample_idx, sample in enumerate(case["samples"]):
        for step, layers in _run_sample(method, case, sample):
            if step == 0:  # the allocation: densities, ratios and the (heavy, recent) split of every layer
                for ours, theirs in zip(method.last_density[0], sample["density"]):
                    assert abs(ours - theirs) <= TOL["density"]
                continue
            if step == 1:  # the code sized each compressed layer at this step: (heavy, recent) exactly
                for li, layer in enumerate(layers):
                    entry = sample["steps"][0][str(li)]
                    if li in (0, 1, num_layers - 1):
                        assert layer.num_entries == case["n"] + 1
                        continue
                    recent = int(layer.row_state["d2o_recent"][0])
                    assert entry["sizes"] == [int(layer.capacity[0]) - recent, recent]
            _check_step(case, sample_idx, sample["steps"][step - 1], layers, step)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c["hkv"] == c["hq"]))
def test_official_code_without_bug_compat_equals_the_code_on_mha(name):
    """KV-head decisions are query-head decisions without GQA; layers 0/1/last are compressed here (the code skips
    them), so only the code's compressed layers compare; the first sample's tau starts fresh in both."""
    case = CASES[name]
    split = case["recent_ratio"] / (case["hh_ratio"] + case["recent_ratio"])
    method = D2O(variant="official_code", recent_fraction=split)
    assert (method.granularity, method.keep_edge_layers, method.carry_tau) == ("kv_head", False, False)
    middle = set(range(2, case["layers"] - 1))
    sample = case["samples"][0]
    for step, layers in _run_sample(method, case, sample):
        if step:
            _check_step(case, 0, sample["steps"][step - 1], layers, step, only=middle)
    assert all(layer.num_entries < case["n"] for layer in layers)  # the edge layers compress too


def test_kv_head_decisions_differ_from_the_code_on_gqa():
    case = next(c for c in CASES.values() if c["hkv"] < c["hq"])
    sample = case["samples"][0]
    *_, (_, layers) = _run_sample(D2O(variant="official_code"), case, sample)
    last = sample["steps"][-1]["2"]
    ours = _masks(layers[2], case["n"] + case["steps"])
    assert len(ours) == case["hkv"] and any(ours[kv] != last["kept"][kv * case["hq"] // case["hkv"]]
                                            for kv in range(case["hkv"]))


def test_tau_is_carried_only_with_carry_tau():
    """The code's threshold outlives the sample: the second sample's first tau is an EMA step from the first's last,
    not the fresh mean of its maxima; carry_tau=False starts fresh."""
    case = CASES["mha_n120"]
    official = case["samples"][1]["steps"][0]["2"]["tau"]
    taus = {}
    for carry in (True, False):
        method = D2O(variant="official_code", keep_edge_layers=True, carry_tau=carry)
        for sample in case["samples"]:
            for step, layers in _run_sample(method, case, sample):
                if step == 1:
                    taus[carry] = float(layers[2].row_state["d2o_tau_key"][0, 0])
    assert abs(taus[True] - official) <= TOL["tau"]
    assert abs(taus[False] - official) > 10 * TOL["tau"]
