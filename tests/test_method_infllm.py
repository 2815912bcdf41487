"""InfLLM: chunked prefill and decode steps against a slow per-query reference (memory at a fixed distance,
retrieved blocks, representative keys), the budget split, and decoding through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_layer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext, PrefillContext
from kvbench.methods.infllm import InfLLM, split_budget

D = 8
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def rope(x, pos):
    """Rotate-half RoPE of one vector at position ``pos`` (float64)."""
    angle = pos * INV_FREQ
    x1, x2 = x[: D // 2].double(), x[D // 2 :].double()
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()])


def reference(q_pre, k_pre, v, chunks, n_init, n_local, topk, bs, repr_topk):
    """InfLLM written per query with loops. q_pre ``(Hq, T, D)``, k_pre/v ``(Hkv, T, D)``; ``chunks`` the
    ``(start, stop)`` query ranges in processing order. Returns outputs ``(Hq, T, D)`` and, per chunk, the number of
    entries its last query attended."""
    hq, t, _ = q_pre.shape
    g = hq // k_pre.shape[0]
    blocks, scores = [], {}  # blocks: (start, repr (Hq, D)); scores[j][h]
    out = torch.zeros(hq, t, D, dtype=torch.float64)
    attended = []
    for start, stop in chunks:
        fixed_q = [[rope(q_pre[h, i], n_local - 1) for i in range(start, stop)] for h in range(hq)]
        if len(blocks) <= topk:
            retrieved = set(range(len(blocks)))
        else:
            qbar = [sum(fixed_q[h]) / (stop - start) for h in range(hq)]
            block_scores = [sum(float(qbar[h] @ r[h]) for h in range(hq)) for _, r in blocks]
            retrieved = set(sorted(range(len(blocks)), key=lambda b: -block_scores[b])[:topk])
        hidden = {j for b, (s, _) in enumerate(blocks) if b not in retrieved for j in range(s, s + bs)}
        for i in range(start, stop):
            count = 0
            for h in range(hq):
                keys, logits = [], []
                for j in range(i + 1):
                    if i - j < n_local:
                        logit = rope(q_pre[h, i], i) @ rope(k_pre[h // g, j], j)
                    elif j in hidden:
                        continue
                    else:
                        logit = fixed_q[h][i - start] @ k_pre[h // g, j].double()
                    keys.append(j)
                    logits.append(float(logit) / math.sqrt(D))
                p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                out[h, i] = sum(p[x] * v[h // g, j].double() for x, j in enumerate(keys))
                for x, j in enumerate(keys):
                    if i - j < n_local and j >= n_init + len(blocks) * bs:
                        scores.setdefault(j, [0.0] * hq)[h] += float(p[x])
                count = len(keys)
            attended.append(count)
        while stop >= n_init + len(blocks) * bs + bs + n_local:
            s = n_init + len(blocks) * bs
            reps = []
            for h in range(hq):
                top = sorted(range(s, s + bs), key=lambda j: -scores[j][h])[:repr_topk]
                reps.append(sum(k_pre[h // g, j].double() for j in top) / repr_topk)
            blocks.append((s, torch.stack(reps)))
    return out, attended


def _post_rope(x_pre):
    """``(H, T, D)`` pre-RoPE -> post-RoPE at positions 0..T-1, batch dim added, float32."""
    return torch.stack([torch.stack([rope(x_pre[h, j], j) for j in range(x_pre.shape[1])])
                        for h in range(x_pre.shape[0])]).float().unsqueeze(0)


def test_prefill_and_decode_match_reference():
    gen = torch.Generator().manual_seed(0)
    n, steps, hq, hkv = 90, 12, 4, 2
    n_init, n_local, topk, bs, repr_topk = 4, 16, 2, 8, 2
    total = n + steps
    q_pre, k_pre = torch.randn(hq, total, D, generator=gen), torch.randn(hkv, total, D, generator=gen)
    v = torch.randn(hkv, total, D, generator=gen)
    q_post, k_post = _post_rope(q_pre), _post_rope(k_pre)
    method = InfLLM(block_size=bs, n_init=n_init, n_local=n_local, topk=topk, repr_topk=repr_topk, exc_block_size=12)
    method.validate(Budget.parse(128))
    layer = make_layer(k_post[:, :, :n], v[None, :, :n])
    ctx = PrefillContext(layer_idx=0, num_layers=1, num_heads=hq, num_kv_heads=hkv, scaling=D**-0.5,
                         queries=q_post[:, :, :n], key_valid=None, prompt_lens=torch.tensor([n]),
                         capacity=torch.tensor([128]), rope_inv_freq=INV_FREQ.float())
    prefill_out = method.prefill_attend(layer, ctx)
    outs, attended = [prefill_out[0].transpose(0, 1)], []
    for t in range(n, total):
        layer.update(k_post[:, :, t : t + 1], v[None, :, t : t + 1])
        dctx = DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=hkv, query=q_post[:, :, t : t + 1], probs=None,
                             capacity=torch.tensor([128]), scaling=D**-0.5, rope_inv_freq=INV_FREQ.float())
        outs.append(method.attend(layer, dctx)[0].transpose(0, 1))
        attended.append(dctx.attended)
    chunks = [(s, min(n, s + 12)) for s in range(0, n, 12)] + [(t, t + 1) for t in range(n, total)]
    ref, ref_attended = reference(q_pre, k_pre, v, chunks, n_init, n_local, topk, bs, repr_topk)
    torch.testing.assert_close(torch.cat(outs, dim=1).double(), ref, atol=2e-5, rtol=1e-4)
    assert method._memory[0].num_blocks == (total - n_local - n_init) // bs > topk  # retrieval was selective
    assert attended == ref_attended[-steps:]
    assert layer.num_entries == total  # nothing evicted


def test_budget_split_and_ratio_formula():
    assert split_budget(128, 32) == (10, 1, 86)
    assert split_budget(1664, 32) == (128, 16, 1024)  # OmniKV's LongBench config
    method = InfLLM()
    method.validate(Budget.parse(0.3))  # Mem% = (n_init + n_local + topk * 32) / n + 4 / 32
    assert sum(a * b for a, b in zip(method.resolve(9600), (1, 32, 1))) == math.floor((0.3 - 0.125) * 9600)
    with pytest.raises(ConfigError, match="not above repr_topk / block_size = 0.125"):
        InfLLM().validate(Budget.parse(0.1))
    with pytest.raises(ConfigError, match="budget=40 is below the minimum 64"):
        build_method({"name": "infllm"}, Budget.parse(40))
    with pytest.raises(ConfigError, match="set all of n_init, n_local, topk"):
        InfLLM(n_init=4)
    with pytest.raises(ConfigError, match="exc_block_size=512 must be <= n_local=100"):
        InfLLM(n_init=4, n_local=100, topk=2)
    assert InfLLM(n_init=4, n_local=600, topk=2).budget_label(Budget.parse(128)) == "init4+local600+top2x32"


def test_through_the_engine(toy_llama):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (200,), generator=gen).tolist()
    full_b = Budget.parse(None)
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, full_b), full_b):
        full = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    wide = {"name": "infllm", "n_init": 4, "n_local": 512, "topk": 2, "block_size": 16}
    b = Budget.parse(128)
    with CompressionSession(toy_llama, build_method(wide, b), b):  # every token inside the local window
        same = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    assert same.tokens == full.tokens
    with CompressionSession(toy_llama, build_method({"name": "infllm", "block_size": 16}, b), b) as session:
        sparse = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 200 * 2 * 16 * 2 * 4  # nothing evicted
    assert sparse.resident_kv_bytes_final == full.resident_kv_bytes_final
    n_init, topk, n_local = split_budget(128, 16)  # 10, 3, 70: init + 3 blocks + window + unblocked remainder
    assert n_init + topk * 16 + n_local <= session.stats.attended_tokens_mean < 128 + 16


def test_refuses_unrotatable_rope_and_batches():
    layer = make_layer(torch.randn(1, 2, 20, D), torch.randn(1, 2, 20, D))
    method = build_method({"name": "infllm"}, Budget.parse(128))
    ctx = PrefillContext(layer_idx=0, num_layers=1, num_heads=4, num_kv_heads=2, scaling=D**-0.5,
                         queries=torch.randn(1, 4, 20, D), key_valid=None, prompt_lens=torch.tensor([20]),
                         capacity=torch.tensor([128]), rope_inv_freq=None)
    with pytest.raises(NotAvailableError, match="RoPE that can be re-rotated"):
        method.prefill_attend(layer, ctx)
    assert InfLLM.supports_batching is False
