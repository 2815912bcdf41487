"""CLA: sharing layers attend to the lowest layer's KV and keep none (small tensors and a whole model against a plain
forward that swaps the KV), resident KV / sharing factor, and the refusal without a declared checkpoint; LoCoCo's
refusal."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from helpers import make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext

D = 8


def _cla(**fields):
    return build_method({"name": "cla", "allow_untrained": True, **fields}, Budget.parse(128))


def reference_attention(q, k, v, offset):
    """Causal softmax attention with loops: query row i sits at position offset + i. ``(Hq, q, D)`` float64."""
    hq, m, _ = q.shape
    g = hq // k.shape[0]
    out = torch.zeros(hq, m, D, dtype=torch.float64)
    for h in range(hq):
        for i in range(m):
            keys = range(offset + i + 1)
            logits = torch.tensor([float(q[h, i] @ k[h // g, j]) / math.sqrt(D) for j in keys], dtype=torch.float64)
            p = torch.softmax(logits, 0)
            out[h, i] = sum(p[j] * v[h // g, j].double() for j in keys)
    return out


def test_sharing_layer_attends_to_the_lowest_layers_kv_and_keeps_none():
    gen = torch.Generator().manual_seed(0)
    n = 30
    lower = make_layer(torch.randn(1, 2, n, D, generator=gen), torch.randn(1, 2, n, D, generator=gen))
    upper = make_layer(torch.randn(1, 2, n, D, generator=gen), torch.randn(1, 2, n, D, generator=gen))
    method = _cla()
    q_low, q_up = torch.randn(1, 4, n, D, generator=gen), torch.randn(1, 4, n, D, generator=gen)
    ctx0 = prefill_ctx(q_low, lower, 128, layer_idx=0, num_layers=2)
    assert method.prefill_attend(lower, ctx0) is None
    method.prefill(lower, ctx0)
    ctx1 = prefill_ctx(q_up, upper, 128, layer_idx=1, num_layers=2)
    out = method.prefill_attend(upper, ctx1)
    method.prefill(upper, ctx1)
    ref = reference_attention(q_up[0], lower.keys[0], lower.values[0], 0)
    torch.testing.assert_close(out[0].transpose(0, 1).double(), ref, atol=1e-5, rtol=1e-5)
    assert upper.num_entries == 0 and upper.resident_bytes() == 0 and lower.num_entries == n
    # a decode step: the lowest layer appends its token, the sharing layer's own K/V are discarded
    lower.update(torch.randn(1, 2, 1, D, generator=gen), torch.randn(1, 2, 1, D, generator=gen))
    upper.update(torch.randn(1, 2, 1, D, generator=gen), torch.randn(1, 2, 1, D, generator=gen))
    q = torch.randn(1, 4, 1, D, generator=gen)
    ctx = DecodeContext(layer_idx=1, num_layers=2, num_kv_heads=2, query=q, probs=None, capacity=torch.tensor([128]))
    step = method.attend(upper, ctx)
    torch.testing.assert_close(step[0].transpose(0, 1).double(), reference_attention(q[0], lower.keys[0],
                                                                                     lower.values[0], n),
                               atol=1e-5, rtol=1e-5)
    assert upper.num_entries == 0 and ctx.attended == n + 1


def test_whole_model_equals_a_forward_with_swapped_kv(toy_llama):
    """Reference: the plain model without a cache, re-run on the whole sequence at every step, whose attention
    function gives layer 1 the keys and values layer 0 computed (layers 0-1 share, layer 2 is its own group)."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 250, (80,), generator=gen).tolist()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    shared = {}

    def swapped(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx % 2 == 0:
            shared[module.layer_idx + 1] = (key, value)
        else:
            key, value = shared[module.layer_idx]
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvbench_test_cla", swapped)
    AttentionMaskInterface.register("kvbench_test_cla", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    original = toy_llama.config._attn_implementation
    toy_llama.set_attn_implementation("kvbench_test_cla")
    try:
        ids, ref = list(prompt), []
        with torch.no_grad():
            for _ in range(8):
                token = int(toy_llama(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
                ref.append(token)
                ids.append(token)
    finally:
        toy_llama.set_attn_implementation(original)
    method = _cla()
    b = Budget.parse(128)
    with CompressionSession(toy_llama, method, b) as session:
        out = greedy_generate(toy_llama, [prompt], 8, [], 0)
    assert out.tokens[0] == ref
    assert session.stats.resident_kv_bytes_after_prefill == 2 * 80 * 2 * 16 * 2 * 4  # layers 0 and 2 of 3
    assert session.stats.layer_entries_after_prefill == [80, 0, 80]


def test_refuses_without_a_declared_checkpoint():
    with pytest.raises(NotAvailableError, match="method 'cla'.*scripts/pod_adapt.py.*adapted_checkpoint=true"):
        build_method({"name": "cla"}, Budget.parse(128))
    adapted = build_method({"name": "cla", "adapted_checkpoint": True}, Budget.parse(128))
    assert adapted.describe()["regime"] == "adapted checkpoint (declared)"
    assert _cla().describe()["regime"] == "untrained proxy (no CLA training)"
    assert _cla(sharing_factor=3).budget_label(Budget.parse(128)) == "share3"
    assert [_cla(sharing_factor=3).source_layer(i) for i in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    with pytest.raises(ConfigError, match="sharing_factor=1"):
        _cla(sharing_factor=1)
    with pytest.raises(ConfigError, match="allow_untrained='yes'"):
        build_method({"name": "cla", "allow_untrained": "yes"}, Budget.parse(128))


def test_lococo_always_refuses():
    with pytest.raises(NotAvailableError, match="method 'lococo'.*learned 1-D convolution kernels.*none are released"):
        build_method({"name": "lococo"}, Budget.parse(128))
