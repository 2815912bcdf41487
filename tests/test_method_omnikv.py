"""OmniKV: selection against a slow reference, layer roles, the Mem% formula, and decoding through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_layer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext
from kvbench.methods.omnikv import OmniKV


def _omni(budget, **fields):
    method = OmniKV(**fields)
    method.validate(Budget.parse(budget))
    return method


def test_mem_formula_matches_the_paper_table():
    # Llama-3-8B: L=32, filters {2, 8, 18}: f = 8/32, Mem 30 % -> r = 0.0667 (methods.md A3.2)
    method = _omni(0.3, filter_layers=[2, 8, 18])
    assert method.selected_tokens(100_000, 32) == math.floor((0.3 - 0.25) / 0.75 * 100_000)
    # Llama-3.1-70B: L=80, {4, 19, 41}: f = 10/80, Mem 20 % -> r = 0.0857
    assert _omni(0.2, filter_layers=[4, 19, 41]).selected_tokens(70_000, 80) == math.floor(0.075 / 0.875 * 70_000)
    assert _omni(128).selected_tokens(5000, 32) == 128
    assert _omni(0.3, mem_formula=False).selected_tokens(1000, 32) == 300
    with pytest.raises(ConfigError, match="below the dense fraction"):
        _omni(0.2, filter_layers=[2, 8, 18]).selected_tokens(1000, 32)


def test_layer_roles():
    method = _omni(128, filter_layers=[2, 8, 18])
    roles = [method._segment_filter(i, 32) for i in range(32)]
    assert roles[:4] == [None, None, None, None]  # 0-1 dense, 2 filter, 3 wait layer
    assert roles[4:8] == [2] * 4 and roles[8:10] == [None, None] and roles[10:18] == [8] * 8
    assert roles[18:20] == [None, None] and roles[20:] == [18] * 12
    assert _omni(128).filters(30) == [2, 8, 17]  # Llama-3-8B's filters scaled to 30 layers


def _reference_selection(query, keys, k, selector, window_queries=None, total=None):
    """Slow OmniKV selection for one row: loops over heads and prompt positions."""
    hq = query.shape[0]
    hkv, n, d = keys.shape
    g = hq // hkv
    if selector in ("last", "softmax_before_last"):
        scores = []
        for j in range(n):
            per_head = []
            for h in range(hq):
                logits = torch.tensor([float(query[h] @ keys[h // g, x]) / math.sqrt(d) for x in range(n)])
                per_head.append(float(logits[j]) if selector == "last" else float(torch.softmax(logits, 0)[j]))
            scores.append(max(per_head))
        return sorted(sorted(range(n), key=lambda j: -scores[j])[:k])
    w = window_queries.shape[1]
    weights = [1.0] * w if selector == "uniform" else [2.0 ** (u - (w - 1)) for u in range(w)]
    scores = [0.0] * n
    for u in range(w):
        probs = [torch.softmax(torch.tensor([float(window_queries[h, u] @ keys[h // g, x]) / math.sqrt(d)
                                             for x in range(n)]), 0) for h in range(hq)]
        for j in range(n):
            scores[j] += weights[u] * max(float(p[j]) for p in probs)
    forced = [j for j in range(max(0, total - w), n)]
    rest = sorted((j for j in range(n) if j not in forced), key=lambda j: -scores[j])[: k - len(forced)]
    return sorted(forced + rest)


@pytest.mark.parametrize("selector", ["last", "softmax_before_last", "uniform", "exp"])
def test_filter_selection_matches_reference(selector):
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d, k, w = 40, 4, 2, 8, 10, 5
    keys = torch.randn(1, hkv, n, d, generator=g)
    prompt_queries = torch.randn(1, hq, n, d, generator=g)
    layer = make_layer(keys, torch.randn(1, hkv, n, d, generator=g))
    method = _omni(k, filter_layers=[0], selector=selector, window=w)
    from helpers import prefill_ctx

    method.prefill(layer, prefill_ctx(prompt_queries, layer, k, layer_idx=0, num_layers=3))
    new_key = torch.randn(1, hkv, 1, d, generator=g)
    layer.update(new_key, torch.randn(1, hkv, 1, d, generator=g))
    query = torch.randn(1, hq, 1, d, generator=g)
    ctx = DecodeContext(layer_idx=0, num_layers=3, num_kv_heads=hkv, query=query, probs=None,
                        capacity=torch.tensor([k]))
    assert method.select(layer, ctx) is None  # the filter layer itself attends densely
    ours = method._selection[0][0].tolist()
    window = torch.cat([prompt_queries[0, :, -(w - 1):], query[0]], dim=1)
    assert ours == _reference_selection(query[0, :, 0], keys[0], k, selector, window, n + 1)
    # the next sparse layer (wait_layers=1: layer 1 is dense, layer 2 sparse) attends to selection + generated
    assert method.select(layer, DecodeContext(1, 3, hkv, query, None, torch.tensor([k]))) is None
    index = method.select(layer, DecodeContext(2, 3, hkv, query, None, torch.tensor([k])))
    assert index.shape == (1, hkv, k + 1) and index[0, 0].tolist() == ours + [n]


def test_through_the_engine(toy_llama):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (120,), generator=g).tolist()
    full_b = Budget.parse(None)
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, full_b), full_b):
        full = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    everything = Budget.parse(500)  # k >= n: OmniKV attends to everything and equals FullKV
    with CompressionSession(toy_llama, build_method({"name": "omnikv", "filter_layers": [0]}, everything), everything):
        same = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    assert same.tokens == full.tokens
    b = Budget.parse(16)
    method = build_method({"name": "omnikv", "filter_layers": [0], "wait_layers": 0}, b)
    with CompressionSession(toy_llama, method, b) as session:
        sparse = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 120 * 2 * 16 * 2 * 4  # nothing evicted
    assert sparse.resident_kv_bytes_final == full.resident_kv_bytes_final
    # per step: layer 0 dense over 120 + t + 1 entries, layers 1-2 over 16 selected + t + 1 generated
    steps = sparse.decode_steps
    expected = sum((120 + t + 1) + 2 * (16 + t + 1) for t in range(steps)) / (3 * steps)
    assert session.stats.attended_tokens_mean == pytest.approx(expected)


def test_refuses_batches_and_bad_fields():
    with pytest.raises(ConfigError, match="selector='top'"):
        OmniKV(selector="top")
    with pytest.raises(ConfigError, match="filter_layers"):
        OmniKV(filter_layers=[])
    assert OmniKV.supports_batching is False


def test_context_bank_offload(toy_llama, caplog):
    """offload=always: sparse layers' prompt KV leaves the cache for the bank and comes back as packed loads of the
    selection; tokens and attended counts equal offload=off. offload=on on a CPU model is a logged no-op."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (120,), generator=g).tolist()
    b = Budget.parse(16)
    runs = {}
    for offload in ("off", "always", "on"):
        method = build_method({"name": "omnikv", "filter_layers": [0], "wait_layers": 0, "offload": offload}, b)
        with CompressionSession(toy_llama, method, b) as session:
            out = greedy_generate(toy_llama, [prompt], 10, [255], 0)
        runs[offload] = (out, session.stats, method)
    off, always, on = runs["off"], runs["always"], runs["on"]
    assert always[0].tokens == off[0].tokens == on[0].tokens
    assert always[1].attended_tokens_mean == pytest.approx(off[1].attended_tokens_mean)
    per_layer = 120 * 2 * 16 * 2 * 4
    assert off[1].resident_kv_bytes_after_prefill == 3 * per_layer
    assert always[1].resident_kv_bytes_after_prefill == per_layer  # only filter layer 0 keeps its prompt KV
    assert sorted(always[2]._bank) == [1, 2] and always[2]._bank[1][0].shape[2] == 120
    assert on[1].resident_kv_bytes_after_prefill == 3 * per_layer and not on[2]._bank
    assert "context bank is a no-op" in caplog.text
    with pytest.raises(ConfigError, match="offload='disk'.*off, on, always"):
        OmniKV(offload="disk")
