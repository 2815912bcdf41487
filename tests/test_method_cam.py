"""CaM against slow references of CaM's lm-eval loop (paper variant, continued at decode) and of KVCache-Factory's
CAMKVCluster (prefill_only), with the Bernoulli draws re-derived from the method's seed (the prefill's from its
generator, the decode's from the documented hash)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.engine.attention import grouped_attention
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext
from kvbench.methods.cam import CaM

D, HQ, HKV = 8, 4, 2
G = HQ // HKV


def _qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HQ, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g),
            torch.randn(1, HKV, n, D, generator=g))


def probs_row(q, k, i, keys):
    logits = torch.tensor([float(q[i] @ k[j]) / math.sqrt(D) for j in keys], dtype=torch.float64)
    return dict(zip(keys, torch.softmax(logits, 0).tolist()))


def lambda_attention(q, k, s, r):
    """A[h][i] = {j: prob} under CaM's mask (j < s or i - r <= j <= i), per query head, float64."""
    n = q.shape[1]
    return [[probs_row(q[h], k[h // G], i, [j for j in range(i + 1) if j < s or j >= i - r]) for i in range(n)]
            for h in range(q.shape[0])]


def draws(seed, layer_idx, shape):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed + 1_000_003 * layer_idx))


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 on Python ints, written from its definition (not kvbench's tensor code)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def decode_draw(seed: int, layer_idx: int, head: int, position: int) -> float:
    """The documented decode draw of the token at ``position`` leaving head ``head`` of layer ``layer_idx``."""
    key = _lowbias32((seed % 2**32) ^ _lowbias32((seed >> 32) ^ _lowbias32(layer_idx)))
    return (_lowbias32(_lowbias32(head ^ key) ^ position) >> 8) / 2**24


def test_decode_draws_are_the_documented_hash_and_uniform():
    from kvbench.methods.cam_ops import decode_uniforms, layer_key

    for seed, layer_idx in ((0, 0), (7, 3), (2**40 + 5, 31)):
        positions = torch.tensor([[0, 1], [4095, 2**31 + 17]])
        got = decode_uniforms(layer_key(seed, layer_idx), positions)
        want = [[decode_draw(seed, layer_idx, h, int(positions[b, h])) for h in range(2)] for b in range(2)]
        assert got.dtype == torch.float32 and got.tolist() == want
    u = decode_uniforms(layer_key(0, 1), torch.arange(200_000).view(-1, 2))
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.std()) - 12**-0.5) < 0.005
    assert float((u < 0.3).float().mean()) == pytest.approx(0.3, abs=0.005)
    assert not torch.equal(u, decode_uniforms(layer_key(1, 1), torch.arange(200_000).view(-1, 2)))


def test_paper_prefill_merges_evicts_and_outputs_like_the_loop():
    n, cap, seed = 40, 12, 5
    s, r = 6, 6  # start_share 0.5
    q, k, v = _qkv(n)
    layer = make_layer(k, v)
    ctx = prefill_ctx(q, layer, cap)
    method = CaM(seed=seed, chunk=9)
    out = method.prefill_attend(layer, ctx)
    method.prefill(layer, ctx)

    qd, kd, vd = q[0].double(), k[0].double(), v[0].double().clone()
    A = lambda_attention(qd, kd, s, r)
    u = draws(seed, 0, (n - s - r, 1, HKV))
    margins, merged = [], 0
    for kv in range(HKV):
        mean = [{j: sum(A[kv * G + x][i].get(j, 0.0) for x in range(G)) / G for j in range(n)} for i in range(n)]
        for t in range(s + r, n):  # CaM's loop: the token x = t - r leaves; S_j(t) sums the rows before t
            S = {j: sum(mean[i][j] for i in range(t)) for j in range(t)}
            x = t - r
            p = min(max(S[x] / max(S[j] for j in list(range(s)) + list(range(t - r, t))), 0.0), 1.0)
            margins.append(abs(float(u[t - s - r, 0, kv]) - p))
            if float(u[t - s - r, 0, kv]) < p:
                vd[kv, x + 1 : x + 1 + r] += vd[kv, x] / r
                merged += 1
    assert min(margins) > 1e-4  # no draw sits on its probability: float32 vs float64 cannot flip a merge
    assert 0 < merged < len(margins)
    for h in range(HQ):
        for i in range(n):
            ref = sum(p * vd[h // G, j] for j, p in A[h][i].items())
            assert torch.allclose(out[0, i, h].double(), ref, atol=1e-5), (h, i)
    kept = list(range(s)) + list(range(n - r, n))
    assert kept_positions(layer) == [kept] * HKV
    assert torch.allclose(layer.values[0].double(), vd[:, kept], atol=1e-5)
    assert torch.equal(layer.keys[0], k[0, :, kept])  # keys are never merged


def test_paper_decode_continues_the_loop_and_keeps_the_budget():
    n, cap, seed, steps = 30, 10, 2, 8
    s, r = 5, 5
    q, k, v = _qkv(n + steps, seed=1)
    layer = make_layer(k[:, :, :n], v[:, :, :n])
    ctx = prefill_ctx(q[:, :, :n], layer, cap)
    method = CaM(seed=seed)
    method.prefill_attend(layer, ctx)
    method.prefill(layer, ctx)
    # reference state after prefill, taken from the (separately tested) prefill: kept values, S of the kept tokens
    kept = list(range(s)) + list(range(n - r, n))
    qd, kd = q[0].double(), k[0].double()
    A = lambda_attention(qd[:, :n], kd[:, :n], s, r)
    S = [{j: sum(sum(A[kv * G + x][i].get(j, 0.0) for x in range(G)) / G for i in range(n)) for j in kept}
         for kv in range(HKV)]
    vals = [{j: layer.values[0, kv, a].double().clone() for a, j in enumerate(kept)} for kv in range(HKV)]
    merged = 0
    for t in range(n, n + steps):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        _, probs = grouped_attention(q[:, :, t : t + 1], layer.keys, layer.values, None, D**-0.5)
        method.decode(layer, DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=HKV, query=q[:, :, t : t + 1],
                                           probs=probs, capacity=torch.tensor([cap])))
        cache = kept + [t]
        for kv in range(HKV):
            vals[kv][t] = v[0, kv, t].double().clone()
            S[kv][t] = 0.0
            x = cache[s]
            p = min(S[kv][x] / max(S[kv][j] for j in cache), 1.0)
            u = decode_draw(seed, 0, kv, x)
            assert abs(u - p) > 1e-4
            if u < p:
                merged += 1
                for j in cache[s + 1 : s + 1 + r]:
                    vals[kv][j] = vals[kv][j] + vals[kv][x] / r
            row = [probs_row(qd[kv * G + g_], kd[kv], t, cache) for g_ in range(G)]
            for j in cache:
                S[kv][j] += sum(rw[j] for rw in row) / G
        kept = cache[:s] + cache[s + 1 :]
        assert kept_positions(layer) == [kept] * HKV
        for kv in range(HKV):
            expect = torch.stack([vals[kv][j] for j in kept])
            assert torch.allclose(layer.values[0, kv].double(), expect, atol=1e-5)
            assert torch.allclose(layer.state["cam_acc"][0, kv].double(),
                                  torch.tensor([S[kv][j] for j in kept], dtype=torch.float64), atol=1e-5)
    assert 0 < merged < steps * HKV
    assert layer.num_entries == cap


def test_prefill_only_is_kvcache_factory_cam():
    n, cap, w, seed = 50, 20, 8, 3
    q, k, v = _qkv(n, seed=4)
    layer = make_layer(k, v)
    ctx = prefill_ctx(q, layer, cap)
    method = CaM(variant="prefill_only", window=w, seed=seed)
    out = method.prefill_attend(layer, ctx)
    method.prefill(layer, ctx)
    qd, kd, vd = q[0].double(), k[0].double(), v[0].double().clone()
    s = math.ceil(0.1 * n)
    u = draws(seed, 0, (n - w - s, 1, HKV))
    kept_ref, margins, merged = [], [], 0
    for kv in range(HKV):
        W = [0.0] * n
        for x_ in range(G):
            for i in range(n - w, n):
                for j, p in probs_row(qd[kv * G + x_], kd[kv], i, list(range(i + 1))).items():
                    W[j] += p / G
        for t in range(s + w, n):
            x = t - w
            p = min(W[x] / max(W[j] for j in list(range(s)) + list(range(t - w, t))), 1.0)
            margins.append(abs(float(u[t - s - w, 0, kv]) - p))
            if float(u[t - s - w, 0, kv]) < p:
                vd[kv, x + 1 : x + 1 + w] += vd[kv, x] / w
                merged += 1
        top = sorted(range(n - w), key=lambda j: -W[j])[: cap - w]
        kept_ref.append(sorted(top + list(range(n - w, n))))
    assert min(margins) > 1e-4 and 0 < merged < len(margins)
    assert kept_positions(layer) == kept_ref
    for kv in range(HKV):
        assert torch.allclose(layer.values[0, kv].double(), vd[kv, kept_ref[kv]], atol=1e-5)
    for h in range(HQ):  # KVCache-Factory merges in place before its attention: the prompt output sees merged values
        for i in (0, 17, n - 1):
            ref = sum(p * vd[h // G, j] for j, p in probs_row(qd[h], kd[h // G], i, list(range(i + 1))).items())
            assert torch.allclose(out[0, i, h].double(), ref, atol=1e-5)
    layer.update(k[:, :, :1], v[:, :, :1])  # prefill-only: decoding appends
    method.decode(layer, DecodeContext(0, 1, HKV, q[:, :, :1], None, torch.tensor([cap])))
    assert layer.num_entries == cap + 1


def test_draws_are_reproducible_and_follow_the_seed():
    q, k, v = _qkv(40, seed=6)
    outs = []
    for seed in (0, 0, 1):
        layer = make_layer(k, v)
        ctx = prefill_ctx(q, layer, 12)
        method = CaM(seed=seed)
        method.prefill_attend(layer, ctx)
        method.prefill(layer, ctx)
        outs.append(layer.values.clone())
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_prompt_that_fits_is_plain_attention():
    q, k, v = _qkv(10)
    layer = make_layer(k, v)
    ctx = prefill_ctx(q, layer, 16)
    method = CaM()
    assert method.prefill_attend(layer, ctx) is None
    method.prefill(layer, ctx)
    assert layer.num_entries == 10 and torch.equal(layer.values, v)
    assert torch.allclose(layer.state["cam_acc"].sum(-1), torch.full((1, HKV), 10.0), atol=1e-4)  # rows sum to 1


def test_config_validation():
    with pytest.raises(ConfigError, match="variant='decode'.*paper, prefill_only"):
        build_method({"name": "cam", "variant": "decode"}, Budget.parse(64))
    with pytest.raises(ConfigError, match="start_share=1.5"):
        build_method({"name": "cam", "start_share": 1.5}, Budget.parse(64))
    with pytest.raises(ConfigError, match="budget=32.*window of 32"):
        build_method({"name": "cam", "variant": "prefill_only"}, Budget.parse(32))
    with pytest.raises(ConfigError, match="seed=-1"):
        build_method({"name": "cam", "seed": -1}, Budget.parse(64))
    assert CaM().split(128) == (64, 64) and CaM(start_share=0.25).split(10) == (3, 7)


def _dense_lambda(q, k, v, s, r):
    """CaM's Λ attention with the whole n x n mask, float64: outputs (B, Hq, n, D), group-mean probabilities."""
    n = q.shape[2]
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    allowed = (j <= i) & ((j < s) | (j >= i - r))
    kq, vq = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    probs = torch.softmax((q.double() @ kq.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, float("-inf")), -1)
    return probs @ vq, probs.view(1, HKV, G, n, n).mean(2)


@pytest.mark.parametrize(("n", "s", "r", "pass_bytes"), [
    (300, 6, 10, 1 << 30),  # windows much shorter than a block
    (300, 40, 90, 1 << 30),  # windows longer than a block: two blocks back
    (257, 0, 70, 1 << 30),  # no start tokens; a last block of one row
    (300, 6, 10, 40_000),  # passes of a few blocks each
])
def test_lambda_blocks_equal_the_dense_mask(monkeypatch, n, s, r, pass_bytes):
    """The blocked Λ attention (queries in blocks of 64, a window of keys per block, passes bounded in bytes) equals
    the whole masked n x n attention: outputs, and the merge probabilities and column sums derived from it."""
    from kvbench.methods import cam_ops

    monkeypatch.setattr(cam_ops, "PASS_BYTES", pass_bytes)
    q, k, v = _qkv(n, seed=n + r)
    qg = q.view(1, HKV, G, n, D)
    out = cam_ops.masked_output(qg, k, v, s, r, D**-0.5)
    ref_out, mean = _dense_lambda(q, k, v, s, r)
    torch.testing.assert_close(out.double(), ref_out.transpose(1, 2), rtol=0, atol=1e-5)
    p, colsum = cam_ops.leaving_probabilities(qg, k, s, r, D**-0.5)
    cum = mean.cumsum(2)  # [t - 1, j] = S_j(t)
    t = torch.arange(s + r, n)
    x = t - r
    s_x = cum[..., t - 1, x]
    window = torch.stack([cum[..., tt - 1, tt - r : tt].amax(-1) for tt in t.tolist()], -1)
    start = cum[..., t - 1, :s].amax(-1) if s else torch.zeros_like(window)
    ref_p = (s_x / torch.maximum(window, start)).clamp(0, 1)
    torch.testing.assert_close(p.double(), ref_p, rtol=0, atol=1e-5)
    stay = list(range(s)) + list(range(max(s, n - r), n))
    torch.testing.assert_close(colsum[..., stay].double(), cum[..., -1, stay], rtol=0, atol=1e-5)


def _merge_loop(values, merge, first, span):
    """CaM's merge as its code writes it: token by token, each merged value already carrying earlier merges."""
    for k in range(merge.shape[-1]):
        x = first + k
        m = merge[:, :, k].to(values.dtype).unsqueeze(-1)
        values[:, :, x + 1 : x + 1 + span] += (values[:, :, x] * m / span).unsqueeze(2)


@pytest.mark.parametrize(("b", "h", "n", "first", "steps", "span", "blocks"), [
    (1, 2, 40, 6, 28, 6, 1),  # one block
    (2, 3, 300, 10, 200, 7, 16),  # many blocks, span not dividing the block size, rows after the last target untouched
    (1, 2, 300, 0, 299, 1, 64),  # span 1: the longest cascade
    (1, 3, 500, 100, 200, 300, 16),  # span longer than a block would be: blocks of span rows
    (1, 1, 50, 3, 3, 100, 16),  # targets clipped at the end of the cache
])
def test_merge_values_is_the_token_order_loop(b, h, n, first, steps, span, blocks):
    from kvbench.methods.cam_ops import merge_values

    g = torch.Generator().manual_seed(n + span)
    v = torch.randn(b, h, n, D, generator=g, dtype=torch.float64)
    merge = torch.rand(b, h, steps, generator=g) < 0.7
    expect, got = v.clone(), v.clone()
    _merge_loop(expect, merge, first, span)
    merge_values(got, merge, first, span, blocks)
    assert torch.allclose(got, expect, rtol=0, atol=1e-12)
    assert not torch.equal(expect, v)
    v32 = v.float()
    merge_values(v32, merge, first, span, blocks)  # float32 (and bf16 on GPUs) solve in float32
    assert torch.allclose(v32.double(), expect, atol=1e-5)
