"""Quest: page selection and the attended output against a slow reference, metadata caching over decode steps,
and decoding through the engine (FullKV when everything fits, attended counts, nothing evicted)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_layer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.attention import grouped_attention
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext
from kvbench.methods.quest import Quest


def _quest(budget, **fields):
    method = Quest(**fields)
    method.validate(Budget.parse(budget))
    return method


def _ctx(query, capacity, layer_idx=2):
    return DecodeContext(layer_idx=layer_idx, num_layers=4, num_kv_heads=2, query=query, probs=None,
                         capacity=torch.tensor([capacity]))


def reference_pages(q, k, budget, page_size, agg):
    """Per KV head: the attended token positions, by Quest's rule written out with loops."""
    hq, d = q.shape
    hkv, t, _ = k.shape
    g = hq // hkv
    pages = [list(range(s, min(s + page_size, t))) for s in range(0, t, page_size)]
    chosen = []
    for kv in range(hkv):
        scores = []
        for page in pages[:-1]:
            per_head = []
            for x in range(g):
                qh = q[kv * g + x]
                bound = 0.0
                for c in range(d):
                    m = min(float(k[kv, j, c]) for j in page)
                    big = max(float(k[kv, j, c]) for j in page)
                    bound += max(float(qh[c]) * m, float(qh[c]) * big)
                per_head.append(bound)
            scores.append(max(per_head) if agg == "max" else sum(per_head) / g)
        order = sorted(range(len(scores)), key=lambda p: -scores[p])[: budget // page_size - 1]
        chosen.append(sorted(j for p in order for j in pages[p]) + pages[-1])
    return chosen


def reference_output(q, k, v, chosen):
    """Softmax over each query head's chosen keys (its KV head's), in float64."""
    hq, d = q.shape
    g = hq // k.shape[0]
    out = torch.zeros(hq, d, dtype=torch.float64)
    for h in range(hq):
        idx = chosen[h // g]
        logits = torch.tensor([float(q[h] @ k[h // g, j]) / math.sqrt(d) for j in idx], dtype=torch.float64)
        p = torch.softmax(logits, 0)
        out[h] = sum(p[i] * v[h // g, j].double() for i, j in enumerate(idx))
    return out


@pytest.mark.parametrize("agg", ["max", "mean"])
def test_pages_and_output_match_reference(agg):
    gen = torch.Generator().manual_seed(0)
    t, d = 75, 8  # 4 full pages of 16 + a partial page of 11
    k, v = torch.randn(1, 2, t, d, generator=gen), torch.randn(1, 2, t, d, generator=gen)
    q = torch.randn(1, 4, 1, d, generator=gen)
    layer = make_layer(k, v)
    index = _quest(48, group_agg=agg).select(layer, _ctx(q, 48))
    chosen = reference_pages(q[0, :, 0], k[0], 48, 16, agg)
    assert [index[0, h].tolist() for h in range(2)] == chosen
    assert index.shape[-1] == 2 * 16 + 11  # 3-page budget: 2 selected pages + the partial current page
    keys = torch.gather(k, 2, index.unsqueeze(-1).expand(-1, -1, -1, d))
    values = torch.gather(v, 2, index.unsqueeze(-1).expand(-1, -1, -1, d))
    out, _ = grouped_attention(q, keys, values, None, d**-0.5)
    torch.testing.assert_close(out[0, 0].double(), reference_output(q[0, :, 0], k[0], v[0], chosen), atol=1e-5,
                               rtol=1e-5)


def test_cached_page_metadata_stays_exact_while_decoding():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 70, 8, generator=gen), torch.randn(1, 2, 70, 8, generator=gen)
    layer = make_layer(k, v)
    method = _quest(64)
    for _ in range(40):  # crosses three page boundaries
        layer.update(torch.randn(1, 2, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen))
        q = torch.randn(1, 4, 1, 8, generator=gen)
        index = method.select(layer, _ctx(q, 64))
        ref = reference_pages(q[0, :, 0], layer.keys[0], 64, 16, "max")
        assert [index[0, h].tolist() for h in range(2)] == ref


def test_dense_cases():
    k = torch.randn(1, 2, 100, 8)
    layer = make_layer(k, k.clone())
    q = torch.randn(1, 4, 1, 8)
    assert _quest(64).select(layer, _ctx(q, 64, layer_idx=1)) is None  # the first two layers
    assert _quest(112).select(layer, _ctx(q, 112)) is None  # 7 pages fit in a 7-page budget
    assert _quest(96).select(layer, _ctx(q, 96)) is not None


def test_through_the_engine(toy_llama):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (150,), generator=gen).tolist()
    full_b = Budget.parse(None)
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, full_b), full_b):
        full = greedy_generate(toy_llama, [prompt], 12, [255], 0)
    roomy = Budget.parse(512)
    with CompressionSession(toy_llama, build_method({"name": "quest", "dense_layers": 0}, roomy), roomy):
        same = greedy_generate(toy_llama, [prompt], 12, [255], 0)
    assert same.tokens == full.tokens
    b = Budget.parse(48)
    with CompressionSession(toy_llama, build_method({"name": "quest"}, b), b) as session:
        sparse = greedy_generate(toy_llama, [prompt], 12, [255], 0)
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 150 * 2 * 16 * 2 * 4  # nothing evicted
    assert sparse.resident_kv_bytes_final == full.resident_kv_bytes_final
    # layers 0-1 dense over 150 + t + 1 entries; layer 2: 2 selected pages + the current page
    steps = sparse.decode_steps
    expected = sum(2 * (150 + t + 1) + 2 * 16 + (150 + t) % 16 + 1 for t in range(steps)) / (3 * steps)
    assert session.stats.attended_tokens_mean == pytest.approx(expected)


def test_bad_fields_and_budget():
    with pytest.raises(ConfigError, match="group_agg='sum'"):
        Quest(group_agg="sum")
    with pytest.raises(ConfigError, match="page_size=0"):
        Quest(page_size=0)
    with pytest.raises(ConfigError, match="budget=16 is below the minimum 32"):
        build_method({"name": "quest"}, Budget.parse(16))
