"""Local window: which tokens are kept, and end to end on a tiny model against a masked full-sequence forward."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from helpers import decode_step, kept_positions, make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.attention import eager_attention
from kvbench.methods import METHODS, build_method
from kvbench.methods.local import LocalWindow


def _qkv(n, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 4, n, 8, generator=g), torch.randn(b, 2, n, 8, generator=g),
            torch.randn(b, 2, n, 8, generator=g))


def test_keeps_the_most_recent_tokens_and_slides():
    q, k, v = _qkv(30)
    layer = make_layer(k, v)
    method = LocalWindow()
    method.prefill(layer, prefill_ctx(q, layer, 12))
    assert kept_positions(layer) == [list(range(18, 30))] * 2
    assert torch.equal(layer.keys, k[:, :, 18:]) and torch.equal(layer.values, v[:, :, 18:])
    for step in range(4):
        qq, kk, vv = _qkv(1, seed=10 + step)
        decode_step(method, layer, qq, kk, vv, 12)
    assert kept_positions(layer) == [list(range(22, 34))] * 2


def test_left_padding_never_counts_as_recent():
    q, k, v = _qkv(20, b=2)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[1, :8] = False
    layer = make_layer(k, v)
    layer.set_valid(valid.view(2, 1, 20).expand(2, 2, 20).clone())
    LocalWindow().prefill(layer, prefill_ctx(q, layer, 6, key_valid=valid))
    assert kept_positions(layer, 0) == [list(range(14, 20))] * 2
    assert kept_positions(layer, 1) == [list(range(14, 20))] * 2


MASK: dict[str, torch.Tensor] = {}


def _masked_attention(module, query, key, value, attention_mask, **kwargs):
    allowed = MASK["allowed"][: query.shape[2], : key.shape[2]]
    return eager_attention(module, query, key, value, allowed.view(1, 1, *allowed.shape), **kwargs)


def test_generation_equals_a_sliding_window_mask_on_the_full_sequence(toy_llama):
    """kvbench's generation with the local window equals a full-sequence forward in which prompt rows are causal and
    the row of the token at position i (generated) sees only positions i - C .. i."""
    n, cap, new = 60, 16, 12
    prompt = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    budget = Budget.parse(cap)
    with CompressionSession(toy_llama, build_method({"name": "local"}, budget), budget) as session:
        out = greedy_generate(toy_llama, [prompt], new, [2], 0)
    tokens = out.tokens[0]
    assert session.stats.layer_entries_after_prefill == [cap] * 3 and len(tokens) == new
    full = prompt + tokens
    i = torch.arange(len(full)).view(-1, 1)
    j = torch.arange(len(full)).view(1, -1)
    MASK["allowed"] = (j <= i) & ((i < n) | (j >= i - cap))
    AttentionInterface.register("kvbench_test_mask", _masked_attention)
    AttentionMaskInterface.register("kvbench_test_mask", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    impl = toy_llama.config._attn_implementation
    toy_llama.set_attn_implementation("kvbench_test_mask")
    try:
        with torch.inference_mode():
            logits = toy_llama(torch.tensor([full]), use_cache=False).logits[0]
    finally:
        toy_llama.set_attn_implementation(impl)
    assert logits[n - 1 : n - 1 + new].argmax(-1).tolist() == tokens


def test_registered_and_no_longer_pending():
    assert "local" in METHODS.names() and "local" not in METHODS.pending
    assert isinstance(build_method({"name": "local"}, Budget.parse(64)), LocalWindow)
