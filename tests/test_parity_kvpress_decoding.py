"""kvbench's compression during decode (``method.decode_compression``) equals kvpress 0.5.5's ``DecodingPress`` on the
same seeded generation: the kept positions per KV head at every compression step.

The fixture (tests/fixtures/parity/kvpress_decoding.json) was written by scripts/parity/kvpress/generate_decoding.py
running kvpress itself in its side environment (scripts/parity/README.md). Here the engine's own per-layer loop
(``engine.decode_compression.DecodeCompressor`` and ``decode_context``, what ``CompressionSession`` runs after every
decode step of a layer) drives each method's ``compress_decoded`` over a ``KVLayer`` fed the same keys, values and
queries.

SnapKV: kvpress stores a compressed cache in descending-score order (``ScorerPress.compress`` gathers the top-k
indices as ``topk`` returns them); its next compression pools the scores over that order, kvbench over positions
(kept entries stay in position order). The first compression of each case is equal; the later ones are compared only
for the order-free scores (K-norm, KeyDiff, TOVA), and the test checks kvpress's stored order really is not positional
there, so the exemption is needed rather than assumed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "parity" / "kvpress"))

import cases as C  # noqa: E402

from kvbench.budget import parse_budget  # noqa: E402
from kvbench.engine.cache import KVLayer  # noqa: E402
from kvbench.engine.decode_compression import DecodeCompressor, decode_context  # noqa: E402
from kvbench.methods import build_method  # noqa: E402

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "kvpress_decoding.json").read_text())
CASES = FIXTURE["cases"]
ORDER_FREE = {"knorm", "keydiff", "tova"}


def method_for(case: dict):
    dc = {"interval": case["interval"], "target_size": case["target_size"], "query_buffer": case["query_buffer"]}
    window, kernel = C.DECODING_SNAPKV
    fields = {
        "knorm": {"name": "knorm"},
        "keydiff": {"name": "keydiff", "mode": "whole_prompt"},
        "tova": {"name": "tova", "variant": "kvpress_prefill"},
        "snapkv": {"name": "snapkv", "window": window, "kernel": kernel, "pooling": "avg"},
    }[case["press"]]
    return build_method({**fields, "decode_compression": dc}, parse_budget(case["target_size"]))


def kvbench_steps(case: dict, kvpress_order: bool = False, method=None, queries=None,
                  rope_inv_freq=None) -> list[dict]:
    """The engine's compressions of the case: step and kept positions per KV head. ``kvpress_order``: before each
    compression after the first, the layer's older entries are put in the order kvpress stored them (the fixture's
    ``order`` of the previous compression), the appended ones after them, as in kvpress's cache. ``method``,
    ``queries`` and ``rope_inv_freq``: another method than the case's press names, the queries as the model's
    attention buffers them (default: the case's), the model's RoPE frequencies in the decode context."""
    arrays = C.decoding_inputs(case)
    keys, values = torch.from_numpy(arrays["keys"]), torch.from_numpy(arrays["values"])
    queries = torch.from_numpy(arrays["queries"]) if queries is None else queries
    n, d = case["n"], case["head_dim"]
    method = method_for(case) if method is None else method
    layer = KVLayer()
    layer.update(keys[:, :, :n], values[:, :, :n])
    compressor = DecodeCompressor(method.decode_compression_spec())
    budget = parse_budget(case["target_size"])
    out = []
    for t in range(case["steps"]):
        layer.update(keys[:, :, n + t : n + t + 1], values[:, :, n + t : n + t + 1])

        def compress(buffered, target):
            if kvpress_order and out:
                stored = case["compressions"][len(out) - 1]["order"]
                now = layer.positions[0].tolist()  # (H, entries), kvbench's position order
                index = [[now[h].index(p) for p in stored[h]] + list(range(len(stored[h]), len(now[h])))
                         for h in range(len(now))]
                index = torch.tensor([index])  # laid out as kvpress holds them (KVLayer.gather would sort)
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    setattr(layer, name, torch.gather(t, 2, index.unsqueeze(-1).expand(*index.shape, t.shape[-1])))
                layer.positions = torch.gather(layer.positions, -1, index)
            ctx = decode_context(layer, buffered, target, 0, 1, case["q_heads"], d ** -0.5,
                                 rope_inv_freq=rope_inv_freq)
            method.compress_decoded(layer, ctx)

        if compressor.after_step(0, queries[:, :, t : t + 1], lambda: compressor.spec.target(layer.seen, budget),
                                 compress, t + 1):
            out.append({"step": t + 1, "kept": [sorted(int(p) for p in layer.positions[0, h].tolist())
                                                for h in range(case["kv_heads"])]})
    return out


def test_fixture_provenance():
    assert FIXTURE["reference"].startswith("kvpress 0.5.5 DecodingPress")
    assert {c["press"] for c in CASES} == set(C.DECODING_PRESSES)
    for case in CASES:
        arrays = C.decoding_inputs(case)
        assert C.digest_arrays(arrays["keys"], arrays["values"], arrays["queries"]) == case["inputs_sha256"]
        assert len(case["compressions"]) >= 2  # each case compresses more than once


@pytest.mark.parametrize("case", CASES, ids=[f"{c['press']}-{c['index']}" for c in CASES])
def test_kept_sets_equal_kvpress_decoding_press(case):
    ours = kvbench_steps(case)
    ref = case["compressions"]
    assert [s["step"] for s in ours] == [s["step"] for s in ref]  # the same steps compress
    compared = ref if case["press"] in ORDER_FREE else ref[:1]
    for mine, theirs in zip(ours, compared):
        assert mine["kept"] == theirs["kept"], f"step {theirs['step']}"
    for theirs in ref:  # every compression keeps exactly the target
        assert all(len(kept) == case["target_size"] for kept in theirs["kept"])


@pytest.mark.parametrize("case", [c for c in CASES if c["press"] not in ORDER_FREE],
                         ids=[f"{c['press']}-{c['index']}" for c in CASES if c["press"] not in ORDER_FREE])
def test_later_compressions_differ_by_the_stored_order_only(case):
    """With the older entries laid out in kvpress's stored order, SnapKV's every compression equals kvpress's: the
    exemption above is the storage order and nothing else."""
    ours = kvbench_steps(case, kvpress_order=True)
    assert [s["kept"] for s in ours] == [s["kept"] for s in case["compressions"]]


def test_kvpress_stores_compressed_caches_out_of_position_order():
    """Why SnapKV's later compressions are exempt: kvpress's stored order after a compression is not positional."""
    orders = [step["order"][0] for case in CASES if case["press"] == "snapkv" for step in case["compressions"]]
    assert any(order != sorted(order) for order in orders)
    assert np.all([len(o) == len(set(o)) for o in orders])


# ---- Expected Attention (scripts/parity/kvpress/generate_decoding_expected_attention.py) ---------------------------
EA_FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" /
                         "kvpress_decoding_expected_attention.json").read_text())
EA = C.DECODING_EXPECTED_ATTENTION


def expected_attention_steps(case: dict, **fields) -> list[dict]:
    """The engine's compressions of an Expected Attention case: the case's queries (before RoPE, as kvpress's identity
    ``q_proj`` hands them over) rotated to their positions ``n + t`` first, as the model's attention buffers them;
    the model's RoPE frequencies in the decode context."""
    from kvbench.engine.rope import rotate_keys

    n, d, steps = case["n"], case["head_dim"], case["steps"]
    inv_freq = 1.0 / (EA["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    at = torch.arange(n, n + steps).view(1, 1, steps).expand(1, case["q_heads"], steps)
    queries = rotate_keys(torch.from_numpy(C.decoding_inputs(case)["queries"]), at.float(), inv_freq)
    dc = {"interval": case["interval"], "target_size": case["target_size"], "query_buffer": case["query_buffer"]}
    method = build_method({"name": "expected_attention", "n_sink": EA["n_sink"], **fields, "decode_compression": dc},
                          parse_budget(case["target_size"]))
    return kvbench_steps(case, method=method, queries=queries, rope_inv_freq=inv_freq)


def test_expected_attention_fixture_provenance():
    assert EA_FIXTURE["reference"].startswith("kvpress 0.5.5 DecodingPress.forward_hook around ExpectedAttentionPress")
    assert len(EA_FIXTURE["cases"]) == 2  # the cases whose buffer holds more queries than the 4 sinks
    for case in EA_FIXTURE["cases"]:
        arrays = C.decoding_inputs(case)
        assert C.digest_arrays(arrays["keys"], arrays["values"], arrays["queries"]) == case["inputs_sha256"]
        assert len(case["compressions"]) >= 2


@pytest.mark.parametrize("case", EA_FIXTURE["cases"], ids=[f"expected_attention-{c['index']}"
                                                           for c in EA_FIXTURE["cases"]])
def test_expected_attention_kept_sets_equal_kvpress_decoding_press(case):
    """Every compression (Expected Attention's score is order-free: no stored-order exemption): the buffer's queries'
    statistics, the first n_sink of them dropped, RoPE averaged over the positions after the buffer's length."""
    ours = expected_attention_steps(case)
    ref = case["compressions"]
    assert [s["step"] for s in ours] == [s["step"] for s in ref]
    assert [s["kept"] for s in ours] == [s["kept"] for s in ref]


@pytest.mark.parametrize("case", EA_FIXTURE["cases"], ids=[f"expected_attention-{c['index']}"
                                                           for c in EA_FIXTURE["cases"]])
def test_expected_attention_fixture_tells_the_readings_apart(case):
    """The fixture would catch another reading: without covariance, or with far fewer future positions, some
    compression keeps another set."""
    ref = [s["kept"] for s in case["compressions"]]
    assert [s["kept"] for s in expected_attention_steps(case, use_covariance=False)] != ref
    assert [s["kept"] for s in expected_attention_steps(case, n_future_positions=1)] != ref
