"""LM-Infinite against a slow reference that applies RoPE from scratch on raw (pre-RoPE) queries and keys with the
distance ceiling, pair by pair."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext
from kvbench.methods.lminfinite import LMInfinite

D = 8
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def rope(x: torch.Tensor, pos: float) -> torch.Tensor:
    """Rotate a vector ``(D,)`` to position ``pos``: pairs (i, i + D/2) turn by pos * inv_freq[i] (rotate-half)."""
    half = x.shape[-1] // 2
    ang = pos * INV_FREQ
    a, b = x[:half], x[half:]
    return torch.cat([a * torch.cos(ang) - b * torch.sin(ang), b * torch.cos(ang) + a * torch.sin(ang)])


def reference(q_raw, k_raw, v, q_pos, k_pos, n_global, n_local, g):
    """Outputs ``(Hq, len(q_pos), D)``: query at position i sees key at position j if 0 <= i - j < n_local (distance
    i - j) or if j is one of the n_global first tokens (distance min(i - j, n_local)); logit = <R(d) q, k> / sqrt(D)."""
    hq = q_raw.shape[0]
    out = torch.zeros(hq, len(q_pos), D, dtype=torch.float64)
    for h in range(hq):
        for a, i in enumerate(q_pos):
            logits, vals = [], []
            for b_, j in enumerate(k_pos):
                dist = i - j
                if dist < 0 or (dist >= n_local and j >= n_global):
                    continue
                dist = min(dist, n_local)
                logits.append(float(rope(q_raw[h, a], dist) @ k_raw[h // g, b_]) / math.sqrt(D))
                vals.append(v[h // g, b_])
            p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
            out[h, a] = sum(w * val for w, val in zip(p, vals))
    return out


def _raw(n, hq=4, hkv=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(hq, n, D, generator=gen, dtype=torch.float64),
            torch.randn(hkv, n, D, generator=gen, dtype=torch.float64),
            torch.randn(hkv, n, D, generator=gen, dtype=torch.float64))


def _rotated(x, positions):
    return torch.stack([torch.stack([rope(x[h, t], positions[t]) for t in range(x.shape[1])])
                        for h in range(x.shape[0])])


def test_prefill_output_and_cache_match_the_reference():
    n, cap, n_global = 40, 14, 3  # n_local = cap - n_global + 1 = 12
    q_raw, k_raw, v = _raw(n)
    pos = list(range(n))
    q, k = _rotated(q_raw, pos).float()[None], _rotated(k_raw, pos).float()[None]
    layer = make_layer(k, v.float()[None])
    ctx = prefill_ctx(q, layer, cap)
    ctx.rope_inv_freq = INV_FREQ.float()
    method = LMInfinite(n_global=n_global, chunk=7)  # several chunks, windows straddling chunk borders
    out = method.prefill_attend(layer, ctx)  # (B, n, Hq, D)
    ref = reference(q_raw, k_raw, v, pos, pos, n_global, cap - n_global + 1, g=2)
    assert torch.allclose(out[0].transpose(0, 1).double(), ref, atol=1e-5)
    method.prefill(layer, ctx)
    assert kept_positions(layer) == [list(range(n_global)) + list(range(n - (cap - n_global), n))] * 2
    assert layer.num_entries == cap


def test_ceiling_changes_the_output():
    """The same Λ mask with true distances (StreamingLLM) gives a different output than LM-Infinite."""
    n, cap, n_global = 30, 10, 2
    q_raw, k_raw, v = _raw(n, seed=3)
    pos = list(range(n))
    q, k = _rotated(q_raw, pos).float()[None], _rotated(k_raw, pos).float()[None]
    layer = make_layer(k, v.float()[None])
    ctx = prefill_ctx(q, layer, cap)
    ctx.rope_inv_freq = INV_FREQ.float()
    out = LMInfinite(n_global=n_global).prefill_attend(layer, ctx)[0].transpose(0, 1).double()
    true_dist = reference(q_raw, k_raw, v, pos, pos, n_global, 10**9, g=2)  # no ceiling ...
    lam = torch.zeros_like(true_dist)
    for i in range(n):  # ... but the same Λ mask: rebuild row i from keys inside the window or global
        keep = [j for j in range(i + 1) if i - j < cap - n_global + 1 or j < n_global]
        lam[:, i] = reference(q_raw[:, i : i + 1], k_raw[:, keep], v[:, keep], [i], keep, n_global, 10**9, g=2)[:, 0]
    assert not torch.allclose(out, lam, atol=1e-3)
    assert torch.allclose(out, reference(q_raw, k_raw, v, pos, pos, n_global, cap - n_global + 1, g=2), atol=1e-5)


def test_decode_attends_with_the_ceiling_and_keeps_the_budget():
    n, cap, n_global, steps = 25, 9, 2, 6
    n_local = cap - n_global + 1
    q_raw, k_raw, v = _raw(n + steps, seed=1)
    pos = list(range(n + steps))
    q_all, k_all = _rotated(q_raw, pos).float()[None], _rotated(k_raw, pos).float()[None]
    layer = make_layer(k_all[:, :, :n], v.float()[None, :, :n])
    ctx = prefill_ctx(q_all[:, :, :n], layer, cap)
    ctx.rope_inv_freq = INV_FREQ.float()
    method = LMInfinite(n_global=n_global)
    method.prefill_attend(layer, ctx)
    method.prefill(layer, ctx)
    for t in range(n, n + steps):
        layer.update(k_all[:, :, t : t + 1], v.float()[None, :, t : t + 1])
        dctx = DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=2, query=q_all[:, :, t : t + 1], probs=None,
                             capacity=torch.tensor([cap]), scaling=D**-0.5, rope_inv_freq=INV_FREQ.float())
        out = method.attend(layer, dctx)  # (1, 1, Hq, D)
        kept = kept_positions(layer)[0]
        assert kept == list(range(n_global)) + list(range(t - n_local + 1, t + 1))
        ref = reference(q_raw[:, t : t + 1], k_raw[:, kept], v[:, kept], [t], kept, n_global, n_local, g=2)
        assert torch.allclose(out[0, 0].double(), ref[:, 0], atol=1e-5)
        method.decode(layer, dctx)
        assert layer.num_entries == cap


def test_left_padded_batch_uses_each_rows_real_tokens():
    n, pad, cap, n_global = 30, 6, 12, 3
    q_raw, k_raw, v = _raw(n, seed=2)
    real = n - pad
    q = torch.zeros(2, 4, n, D)
    k = torch.zeros(2, 2, n, D)
    vv = torch.zeros(2, 2, n, D)
    q[0], k[0], vv[0] = _rotated(q_raw, list(range(n))).float(), _rotated(k_raw, list(range(n))).float(), v.float()
    rows = list(range(real))
    q[1, :, pad:] = _rotated(q_raw[:, :real], rows).float()
    k[1, :, pad:] = _rotated(k_raw[:, :real], rows).float()
    vv[1, :, pad:] = v[:, :real].float()
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :pad] = False
    layer = make_layer(k, vv)
    layer.positions[1, :, pad:] = torch.arange(real)
    layer.positions[1, :, :pad] = 0
    layer.set_valid(valid.view(2, 1, n).expand(2, 2, n).clone())
    ctx = prefill_ctx(q, layer, cap, key_valid=valid)
    ctx.rope_inv_freq = INV_FREQ.float()
    out = LMInfinite(n_global=n_global).prefill_attend(layer, ctx)
    ref = reference(q_raw[:, :real], k_raw[:, :real], v[:, :real], rows, rows, n_global, cap - n_global + 1, g=2)
    assert torch.allclose(out[1, pad:].transpose(0, 1).double(), ref, atol=1e-5)


def test_refuses_without_rotary_frequencies_and_bad_budgets():
    q_raw, k_raw, v = _raw(20)
    layer = make_layer(k_raw.float()[None], v.float()[None])
    ctx = prefill_ctx(q_raw.float()[None], layer, 8)
    with pytest.raises(NotAvailableError, match="lminfinite needs a rotary"):
        LMInfinite(n_global=2).prefill_attend(layer, ctx)
    with pytest.raises(ConfigError, match="budget=10 is below the minimum 11"):
        build_method({"name": "lminfinite"}, Budget.parse(10))
    with pytest.raises(ConfigError, match="n_global=0"):
        build_method({"name": "lminfinite", "n_global": 0}, Budget.parse(64))


@pytest.mark.parametrize("passes", [False, True])
def test_blocked_form_equals_the_chunk_loop(monkeypatch, passes):
    """``few_kernels`` (a GPU's form: every block of queries in one batched call) gives the chunk loop's output:
    several blocks, a left-padded row, rows with different windows, a window wider than a block; in one pass or, with
    a tiny ``PASS_BYTES``, in several."""
    import kvbench.methods.lminfinite as lmi

    if passes:
        monkeypatch.setattr(lmi, "PASS_BYTES", 1)
    n, pad = 300, 37
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, n, D, generator=g), torch.randn(2, 2, n, D, generator=g), torch.randn(2, 2, n, D,
                                                                                                     generator=g)
    for cap in ([14, 14], [100, 40], [150, 150]):
        layer = make_layer(k.clone(), v.clone())
        valid = torch.ones(2, n, dtype=torch.bool)
        valid[1, :pad] = False
        layer.positions[1, :, pad:] = torch.arange(n - pad)
        layer.positions[1, :, :pad] = 0
        layer.set_valid(valid.view(2, 1, n).expand(2, 2, n).clone())
        outs = []
        for few in (False, True):
            ctx = prefill_ctx(q, layer, torch.tensor(cap), key_valid=valid)
            ctx.rope_inv_freq = INV_FREQ.float()
            ctx.few_kernels = few
            outs.append(LMInfinite(n_global=3).prefill_attend(layer, ctx))
        assert outs[0].shape == outs[1].shape == (2, n, 4, D)
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(outs[1][1, pad:], outs[0][1, pad:], rtol=1e-5, atol=1e-6)
