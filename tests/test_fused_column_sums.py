"""Issue #7: methods scored by H2O's column sums (H2O, D2O, KVMerger) compute the prompt attention and the sums in
one pass (``attend_with_column_sums``). The output equals the backend's attention, the sums equal ``column_sums``,
and a whole generation is unchanged; sliding-window and padded prompts fall back to the backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.scores import attention_and_column_sums, column_sums
from kvbench.methods import base, build_method


@pytest.mark.parametrize("few_kernels", [False, True])
def test_output_and_sums_equal_sdpa_and_column_sums(few_kernels):
    """Both forms: 64-query chunks (the CPU's) and two fused attention kernels (a GPU's, tests/test_prefill_kernels)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 300, 16), torch.randn(2, 3, 300, 16), torch.randn(2, 3, 300, 16)
    out, sums = attention_and_column_sums(q, k, v, 0.25, chunk=64, few_kernels=few_kernels)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=True, scale=0.25)
    assert out.shape == (2, 300, 6, 16)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums, column_sums(q, k, 0.25, None, chunk=512), rtol=1e-5, atol=1e-5)
    # by hand for one head: the column sums of the causal softmax matrix
    logits = (q[0, 0] @ k[0, 0].T) * 0.25
    logits = logits.masked_fill(torch.triu(torch.ones(300, 300, dtype=torch.bool), 1), float("-inf"))
    torch.testing.assert_close(sums[0, 0], torch.softmax(logits, -1).sum(0), rtol=1e-5, atol=1e-5)


def test_the_fused_kernels_carry_the_bias_in_two_bfloat16_parts():
    """In bfloat16 the log-sum-exp bias rides in two channels (hi + lo): one would round it by up to 2^-9 of ~30, a
    few percent of every column sum; two leave the inputs' own rounding (the sums of the same bf16 tensors in
    float32 by the chunked pass)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 300, 16).bfloat16() for h in (6, 3, 3))
    _, sums = attention_and_column_sums(q, k, v, 0.25, few_kernels=True)
    reference = column_sums(q.float(), k.float(), 0.25, None)
    torch.testing.assert_close(sums, reference, rtol=1e-3, atol=1e-3)


def _generate(model, method_cfg, budget, ids, monkeypatch=None, fused=True):
    calls = []
    real = base.attend_with_column_sums

    def spy(layer, ctx):
        out = real(layer, ctx) if fused else None
        calls.append(out is not None)
        return out

    if monkeypatch is not None:
        for module in ("h2o", "d2o", "kvmerger"):
            monkeypatch.setattr(f"kvbench.methods.{module}.attend_with_column_sums", spy)
    with CompressionSession(model, build_method(method_cfg, Budget.parse(budget)), Budget.parse(budget)) as session:
        out = greedy_generate(model, ids, 12, [2], 0)
    return out.tokens, session, calls


@pytest.mark.parametrize("method", [{"name": "h2o"}, {"name": "d2o"}, {"name": "kvmerger"}])
def test_generation_is_unchanged_by_the_fused_pass(toy_llama, monkeypatch, method):
    torch.manual_seed(1)
    ids = [torch.randint(3, 256, (200,)).tolist()]
    fused, _, used = _generate(toy_llama, method, 48, ids, monkeypatch, fused=True)
    assert used and all(used)  # every layer took the fused pass
    monkeypatch.undo()
    plain, _, skipped = _generate(toy_llama, method, 48, ids, monkeypatch, fused=False)
    assert not any(skipped)
    assert fused == plain


def test_soft_capping_and_padding_fall_back_to_the_backend(toy_llama, monkeypatch):
    from helpers import tiny_family

    torch.manual_seed(2)
    ids = [torch.randint(3, 256, (120,)).tolist()]
    seen = []
    real = base.attend_with_column_sums
    monkeypatch.setattr("kvbench.methods.h2o.attend_with_column_sums",
                        lambda layer, ctx: seen.append(ctx.plain_causal) or real(layer, ctx))
    gemma2 = tiny_family("gemma2")  # soft-capped logits: the prompt attention is not plain softmax attention
    with CompressionSession(gemma2, build_method({"name": "h2o"}, Budget.parse(40)), Budget.parse(40)):
        greedy_generate(gemma2, ids, 2, [2], 0)
    assert seen and not any(seen)
    cache_ctx = []
    monkeypatch.setattr("kvbench.methods.h2o.attend_with_column_sums",
                        lambda layer, ctx: cache_ctx.append(real(layer, ctx)) or cache_ctx[-1])
    with CompressionSession(toy_llama, build_method({"name": "h2o"}, Budget.parse(32)), Budget.parse(32)):
        greedy_generate(toy_llama, [ids[0], ids[0][:90]], 2, [2], 0)  # left padding: the backend attends
    assert cache_ctx and all(out is None for out in cache_ctx)
