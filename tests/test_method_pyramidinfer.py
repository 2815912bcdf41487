"""PyramidInfer: layer sizes (the code's compounding rule, the budget allocation), the chain of pivotal contexts
with masked prompt attention, and decode-time chunk compression, against slow references."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import kept_positions, make_layer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.attention import grouped_attention
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext, PrefillContext
from kvbench.methods.pyramidinfer import PyramidInfer, budget_contexts, decay, paper_contexts

D = 8


def test_paper_sizes_follow_the_code():
    # n=500: recent = int(0.2 * 500) = 100, W = 101, c_0 = 399; s(1) = 0.1 (cos(pi/4) + 1) / 2 + 0.9 = 0.98536,
    # int(399 * 0.98536) = 393; s(2) = 0.95, int(393 * 0.95) = 373 (layer 0's s = 1 changes nothing)
    assert paper_contexts(500, 4, 0.2, 0.9, "cosine", 64) == (101, [399, 399, 393, 373])
    # a step that would go to min_context or below keeps the previous size (the code's rule)
    assert paper_contexts(100, 4, 0.2, 0.5, "constant", 64)[1] == [79, 79, 79, 79]
    assert decay(0, 32, 0.9, "cosine") == 1.0 and decay(16, 32, 0.9, "cosine") == pytest.approx(0.95)


@pytest.mark.parametrize("n, budget, layers", [(1500, 128, 30), (3000, 512, 32), (300, 128, 28), (200, 180, 8)])
def test_budget_sizes_average_the_budget(n, budget, layers):
    window = 1 + int(0.2 * budget)
    contexts = budget_contexts(n, budget, window, layers, 0.9, "cosine", 64)
    assert sum(contexts) + layers * window == layers * budget
    assert contexts == sorted(contexts, reverse=True) and max(contexts) <= n - window
    assert min(contexts) >= min(64, budget - window)
    profile = [math.prod(decay(i, layers, 0.9, "cosine") for i in range(layer)) for layer in range(layers)]
    unclamped = [c for c in contexts if min(64, budget - window) < c < n - window]
    if len(unclamped) > 1:  # unclamped layers follow the compounding profile (up to integer rounding)
        first = contexts.index(unclamped[0])
        for layer, c in enumerate(contexts):
            if c in unclamped:
                assert c == pytest.approx(unclamped[0] * profile[layer] / profile[first], abs=1.5)


def reference_prefill(qs, ks, vs, contexts, window, sinks, weight):
    """The chain of pivotal contexts with loops: layer l attends (causally) to what layer l-1 kept, layer 0 to all;
    keeps ``contexts[l]`` context entries + the window (layer 0 by its own scores, layer l by layer l-1's choice).
    Returns kept positions per layer and each layer's attention outputs ``(Hq, n, D)``."""
    n = qs[0].shape[1]
    hq, hkv = qs[0].shape[0], ks[0].shape[0]
    g = hq // hkv
    weights = [1 + (weight - 1) * u / (window - 1) for u in range(window)]
    held, kept, outputs = list(range(n)), [], []
    for layer, (q, k, v) in enumerate(zip(qs, ks, vs)):
        out = torch.zeros(hq, n, D, dtype=torch.float64)
        rows = {}
        for h in range(hq):
            for i in range(n):
                keys = [j for j in held if j <= i]
                logits = torch.tensor([float(q[h, i] @ k[h // g, j]) / math.sqrt(D) for j in keys], dtype=torch.float64)
                p = torch.softmax(logits, 0)
                out[h, i] = sum(p[x] * v[h // g, j].double() for x, j in enumerate(keys))
                if i >= n - window:
                    for x, j in enumerate(keys):
                        rows[(i, j)] = rows.get((i, j), 0.0) + float(p[x]) / hq
        outputs.append(out)

        def choose(candidates, count, rows=rows):
            context = candidates[: len(candidates) - window]
            if count >= len(context):
                return list(candidates)
            score = {j: sum(weights[u] * rows.get((n - window + u, j), 0.0) for u in range(window)) / window
                     for j in context}
            for j in context[:sinks]:
                score[j] = float("inf")
            top = sorted(context, key=lambda j: -score[j])[:count]
            return sorted(top) + candidates[len(candidates) - window :]

        if layer == 0:
            held = choose(held, contexts[0])
        kept.append(list(held))
        if layer + 1 < len(qs):
            held = choose(held, contexts[layer + 1])
    return kept, outputs


def test_prefill_chain_matches_reference():
    gen = torch.Generator().manual_seed(0)
    n, layers, hq, hkv, budget = 70, 4, 4, 2, 30
    qs = [torch.randn(hq, n, D, generator=gen) for _ in range(layers)]
    ks = [torch.randn(hkv, n, D, generator=gen) for _ in range(layers)]
    vs = [torch.randn(hkv, n, D, generator=gen) for _ in range(layers)]
    method = PyramidInfer(decay_ratio=0.5, min_context=4, sink_size=2)
    method.validate(Budget.parse(budget))
    window = 1 + int(0.2 * budget)
    contexts = budget_contexts(n, budget, window, layers, 0.5, "cosine", 4)
    assert contexts[0] > contexts[-1]  # a real pyramid
    kept, outputs = reference_prefill(qs, ks, vs, contexts, window, 2, 1.2)
    for layer in range(layers):
        cache = make_layer(ks[layer][None], vs[layer][None])
        ctx = PrefillContext(layer_idx=layer, num_layers=layers, num_heads=hq, num_kv_heads=hkv, scaling=D**-0.5,
                             queries=qs[layer][None], key_valid=None, prompt_lens=torch.tensor([n]),
                             capacity=torch.tensor([budget]))
        out = method.prefill_attend(cache, ctx)
        method.prefill(cache, ctx)
        assert cache.positions[0, 0].tolist() == kept[layer]
        assert torch.equal(cache.keys[0], ks[layer][:, kept[layer]])
        if layer == 0:
            assert out is None  # the backend's full attention
        else:
            torch.testing.assert_close(out[0].transpose(0, 1).double(), outputs[layer], atol=1e-5, rtol=1e-5)
    assert sum(len(x) for x in kept) == layers * budget


def test_decode_compresses_generated_chunks_like_the_reference():
    gen = torch.Generator().manual_seed(1)
    hq, hkv, window, chunk, steps = 4, 2, 5, 4, 16
    method = PyramidInfer(gen_chunk=chunk, sink_size=2, min_context=4)
    method.validate(Budget.parse(20))
    n = 40
    k0, v0 = torch.randn(1, hkv, n, D, generator=gen), torch.randn(1, hkv, n, D, generator=gen)
    cache = make_layer(k0, v0)
    ctx = PrefillContext(layer_idx=2, num_layers=4, num_heads=hq, num_kv_heads=hkv, scaling=D**-0.5,
                         queries=torch.randn(1, hq, n, D, generator=gen), key_valid=None, prompt_lens=torch.tensor([n]),
                         capacity=torch.tensor([20]))
    method._plan, method._chosen = (window, [15, 15, 15, 15]), torch.arange(n)  # layer 2 of 4, holding everything
    method.prefill(cache, ctx)
    kept = cache.positions[0, 0].tolist()
    rows = [dict(zip(kept, r.tolist())) for r in method._rows[2]]
    frozen = len(kept)
    keys = {p: cache.keys[0, :, i] for i, p in enumerate(kept)}
    s_gen = decay(2, 4, 0.1, "cosine")
    weights = [1 + 0.2 * u / (window - 1) for u in range(window)]
    for step in range(steps):
        q = torch.randn(1, hq, 1, D, generator=gen)
        k, v = torch.randn(1, hkv, 1, D, generator=gen), torch.randn(1, hkv, 1, D, generator=gen)
        cache.update(k, v)
        _, probs = grouped_attention(q, cache.keys, cache.values, None, D**-0.5)
        method.decode(cache, DecodeContext(2, 4, hkv, q, probs, torch.tensor([20])))
        # reference: head-mean probabilities, the last W rows, chunk compression of generated entries
        pos = n + step
        keys[pos] = k[0, :, 0]
        kept.append(pos)
        p = [0.0] * len(kept)
        for h in range(hq):
            logits = torch.tensor([float(q[0, h, 0] @ keys[j][h // 2]) / math.sqrt(D) for j in kept])
            for x, value in enumerate(torch.softmax(logits.double(), 0)):
                p[x] += float(value) / hq
        rows = (rows + [dict(zip(kept, p))])[-window:]
        if len(kept) - window - frozen >= chunk:
            cand = kept[frozen : frozen + chunk]
            score = {j: sum(weights[u] * rows[u].get(j, 0.0) for u in range(window)) / window for j in cand}
            count = max(int(chunk * 0.9 * s_gen), 1)
            survivors = sorted(sorted(cand, key=lambda j: -score[j])[:count])
            kept = kept[:frozen] + survivors + kept[frozen + chunk :]
            frozen += count
        assert cache.positions[0, 0].tolist() == kept, step
    assert len(kept) < n + steps  # something was compressed, and the prompt entries never were
    assert kept[:n] == list(range(n))


def test_through_the_engine(toy_llama):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (200,), generator=gen).tolist()
    b = Budget.parse(64)
    with CompressionSession(toy_llama, build_method({"name": "pyramidinfer", "min_context": 8}, b), b) as session:
        out = greedy_generate(toy_llama, [prompt], 6, [255], 0)
    entries = session.stats.layer_entries_after_prefill
    assert sum(entries) == 3 * 64 and entries[0] > entries[-1]
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 64 * 2 * 16 * 2 * 4
    assert len(out.tokens[0]) == 6  # 5 decode steps append to every layer; nothing left the 13-token window yet
    assert out.resident_kv_bytes_final == (3 * 64 + 3 * out.decode_steps) * 2 * 16 * 2 * 4
    paper = Budget.parse(64)
    with CompressionSession(toy_llama, build_method({"name": "pyramidinfer", "allocation": "paper"}, paper),
                            paper) as session:
        greedy_generate(toy_llama, [prompt], 2, [255], 0)
    w, contexts = paper_contexts(200, 3, 0.2, 0.9, "cosine", 64)
    assert session.stats.layer_entries_after_prefill == [w + c for c in contexts]


def test_the_one_pass_prefill_attention_is_the_chunked_one(toy_llama):
    """``few_kernels`` (a GPU's form): the masked prompt attention in passes of ``PASS_BYTES`` (here one) instead of
    512 queries gives the same logits and keeps the same entries in every layer (its kernels:
    tests/test_prefill_kernels.py)."""
    ids = torch.randint(3, 250, (1, 1300), generator=torch.Generator().manual_seed(5))
    b = Budget.parse(128)
    results = []
    for few in (False, True):
        with CompressionSession(toy_llama, build_method({"name": "pyramidinfer"}, b), b, few_kernels=few) as session:
            logits = toy_llama(ids, use_cache=True).logits[0, -1]
            results.append((logits, [kept_positions(session._layers[i]) for i in range(3)]))
    (chunked, kept_chunked), (one_pass, kept_one_pass) = results
    torch.testing.assert_close(one_pass, chunked, rtol=0, atol=1e-5)
    assert kept_one_pass == kept_chunked
    assert len(kept_chunked[2][0]) < len(kept_chunked[0][0]) < 1300  # compressed, as a pyramid


def test_bad_fields():
    with pytest.raises(ConfigError, match="decay_strategy='linear'"):
        PyramidInfer(decay_strategy="linear")
    with pytest.raises(ConfigError, match="recent_ratio=0"):
        PyramidInfer(recent_ratio=0)
    with pytest.raises(ConfigError, match="allocation='uniform'"):
        PyramidInfer(allocation="uniform")
    with pytest.raises(ConfigError, match="budget=6 is below the minimum 7"):
        build_method({"name": "pyramidinfer"}, Budget.parse(6))
    assert PyramidInfer(allocation="paper").budget_label(Budget.parse(128)) == "ratios0.2-0.9"
