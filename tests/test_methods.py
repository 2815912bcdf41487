"""Each method against an independent, slow, obviously-correct reference on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (
    assert_same_up_to_ties,
    decode_step,
    kept_positions,
    make_layer,
    prefill_ctx,
    snapkv_reference,
    softmax_row,
)
from kvbench.budget import Budget
from kvbench.errors import ConfigError
from kvbench.methods import METHODS, build_method
from kvbench.methods.h2o import H2O
from kvbench.methods.pyramidkv import PyramidKV, pyramid_capacity
from kvbench.methods.snapkv import SnapKV
from kvbench.methods.streamingllm import StreamingLLM

pytestmark = pytest.mark.compat  # also run on the lowest supported transformers and torch (.ci/run)


def _qkv(n=96, hq=6, hkv=2, d=8, seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    return q, k, v


# ---- SnapKV ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling, kernel, window, capacity", [("max", 5, 8, 24), ("avg", 5, 8, 30), ("max", 7, 4, 16)])
def test_snapkv_matches_reference(pooling, kernel, window, capacity):
    q, k, v = _qkv(n=80)
    layer = make_layer(k, v)
    SnapKV(window=window, kernel=kernel, pooling=pooling).prefill(layer, prefill_ctx(q, layer, capacity))
    ref, scores = snapkv_reference(q[0].double(), k[0].double(), capacity, window, kernel, pooling)
    ours = kept_positions(layer)
    for head in range(2):
        assert len(ours[head]) == capacity
        assert_same_up_to_ties(ours[head], ref[head], scores[head], set(range(80 - window, 80)))
    # keys and values really are the kept rows of the originals
    for head in range(2):
        assert torch.equal(layer.keys[0, head], k[0, head, ours[head]])
        assert torch.equal(layer.values[0, head], v[0, head, ours[head]])


def test_snapkv_keeps_everything_when_prompt_fits():
    q, k, v = _qkv(n=40)
    layer = make_layer(k, v)
    SnapKV(window=8).prefill(layer, prefill_ctx(q, layer, 64))
    assert layer.num_entries == 40


def test_snapkv_left_padding_never_keeps_padding():
    q, k, v = _qkv(n=60, b=2)
    valid = torch.ones(2, 60, dtype=torch.bool)
    valid[1, :20] = False  # row 1 is left-padded by 20
    layer = make_layer(k, v)
    layer.set_valid(valid.view(2, 1, 60).expand(2, 2, 60).clone())
    SnapKV(window=8, kernel=5).prefill(layer, prefill_ctx(q, layer, 24, key_valid=valid))
    for head in kept_positions(layer, row=1):
        assert len(head) == 24 and min(head) >= 20


# ---- PyramidKV -------------------------------------------------------------------------------------------------------
def test_pyramid_schedule_exact_sums_to_budget():
    for n, c, layers in [(1500, 128, 30), (4000, 512, 32), (1000, 64, 28)]:
        caps = pyramid_capacity(c, n, 8, 20, layers, "exact")
        assert sum(caps) == (c - 8) * layers
        assert caps == sorted(caps, reverse=True)


def test_pyramid_schedule_kvfactory_formula():
    # C=128, w=8, beta=20: min = 120 // 20 = 6, max = 240 - 6 = 234, steps = (234 - 6) // 32 = 7
    caps = pyramid_capacity(128, 1000, 8, 20, 32, "kvfactory_2406")
    assert caps[0] == 234 and caps[1] == 227 and caps[31] == 234 - 31 * 7
    # C=64: min = 56 // 20 = 2 in integers (the real-number 2.8 made layer 0 keep 109, not 110)
    assert pyramid_capacity(64, 1000, 8, 20, 32, "kvfactory_2406")[0] == 110
    # C=512, n=2047: max = 1008 - 25 = 983, min = 25; steps 958 // 32 = 29 (2024-06) vs 958 // 31 = 30 (2024-09)
    assert pyramid_capacity(512, 2047, 8, 20, 32, "kvfactory_2406")[-1] == 983 - 31 * 29
    assert pyramid_capacity(512, 2047, 8, 20, 32, "kvfactory_2409")[-1] == 983 - 31 * 30


def test_pyramid_schedule_kvfactory_clamp():
    """Where max = 2 (C - w) - min reaches n - w, the code clamps max to n - w (values printed by the reference's
    PyramidKVCluster at 57e1c26 and 7ee6be0: layers 0, 1 and 31); its 2024-06-10 file clamped to n - w - 1."""
    for schedule in ("kvfactory_2406", "kvfactory_2409"):
        caps = pyramid_capacity(128, 241, 8, 20, 32, schedule)
        assert (caps[0], caps[1], caps[-1]) == (233, 226, 16)
        caps = pyramid_capacity(64, 115, 8, 20, 32, schedule)
        assert (caps[0], caps[1], caps[-1]) == (107, 104, 14)


def test_pyramid_schedule_kvfactory_is_gone_with_a_message():
    with pytest.raises(ConfigError, match="kvfactory_2406.*kvfactory_2409"):
        PyramidKV(schedule="kvfactory")


def test_pyramid_schedule_clamps_and_uniform_cases():
    assert pyramid_capacity(128, 100, 8, 20, 4, "exact") == [92] * 4  # n < C: no compression
    assert pyramid_capacity(128, 200, 8, 20, 4, "exact") == [120] * 4  # n < 2 (C - w): uniform
    caps = pyramid_capacity(128, 241, 8, 20, 4, "exact")  # max = 234 would exceed n - w = 233: clamped
    assert caps[0] == 233 and caps[-1] == 7 and sum(caps) == 480


def test_pyramidkv_layer_sizes():
    q, k, v = _qkv(n=200)
    for layer_idx in range(4):
        layer = make_layer(k, v)
        PyramidKV(window=8, kernel=7).prefill(layer, prefill_ctx(q, layer, 48, layer_idx=layer_idx, num_layers=4))
        expected = 8 + pyramid_capacity(48, 200, 8, 20, 4, "exact")[layer_idx]
        assert layer.num_entries == expected


# ---- StreamingLLM ----------------------------------------------------------------------------------------------------
def test_streamingllm_sinks_and_recent_through_decoding():
    q, k, v = _qkv(n=50)
    layer = make_layer(k, v)
    method = StreamingLLM(sink_size=4)
    method.prefill(layer, prefill_ctx(q, layer, 16))
    assert kept_positions(layer)[0] == list(range(4)) + list(range(38, 50))
    for step in range(5):
        qq, kk, vv = _qkv(n=1, seed=100 + step)
        decode_step(method, layer, qq, kk, vv, 16)
    assert kept_positions(layer) == [list(range(4)) + list(range(43, 55))] * 2


def test_streamingllm_kvfactory_variant_is_prefill_only():
    q, k, v = _qkv(n=50)
    layer = make_layer(k, v)
    method = StreamingLLM(variant="kvfactory", window=8)
    method.prefill(layer, prefill_ctx(q, layer, 16))
    assert kept_positions(layer)[0] == list(range(8)) + list(range(42, 50))
    decode_step(method, layer, *_qkv(n=1, seed=7), 16)
    assert layer.num_entries == 17


# ---- H2O -------------------------------------------------------------------------------------------------------------
def h2o_reference(q, k, capacity, recent_ratio, decode_qk):
    """H2O with a Python dict of accumulated scores per KV head (mean over the group), one eviction per step."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    recent = max(1, min(capacity - 1, round(capacity * recent_ratio)))
    kept_all = []
    for kv in range(hkv):
        keys = {j: k[kv, j] for j in range(n)}
        acc = {j: 0.0 for j in range(n)}
        for x in range(g):
            h = kv * g + x
            for i in range(n):
                p = softmax_row(q[h, i], k[kv], i, d)
                for j in range(i + 1):
                    acc[j] += float(p[j]) / g
        order = sorted(keys)
        protected = set(order[-recent:])
        heavy = sorted((j for j in order if j not in protected), key=lambda j: -acc[j])[: capacity - recent]
        kept = sorted(set(heavy) | protected)
        for step, (qs, ks) in enumerate(decode_qk):
            pos = n + step
            kept.append(pos)
            keys[pos] = ks[kv]
            acc[pos] = 0.0
            mat = torch.stack([keys[j] for j in kept])
            for x in range(g):
                logits = (mat.double() @ qs[kv * g + x].double()) / math.sqrt(d)
                for j, p in zip(kept, torch.softmax(logits, 0)):
                    acc[j] += float(p) / g
            if len(kept) > capacity:
                candidates = kept[: len(kept) - recent]
                victim = min(candidates, key=lambda j: acc[j])
                kept.remove(victim)
        kept_all.append(sorted(kept))
    return kept_all


def test_h2o_prefill_and_decode_match_reference():
    n, capacity = 40, 12
    q, k, v = _qkv(n=n, hq=4, hkv=2)
    steps = [_qkv(n=1, hq=4, hkv=2, seed=50 + s) for s in range(6)]
    layer = make_layer(k, v)
    method = H2O(recent_ratio=0.5)
    method.prefill(layer, prefill_ctx(q, layer, capacity))
    for qq, kk, vv in steps:
        decode_step(method, layer, qq, kk, vv, capacity)
    ref = h2o_reference(q[0], k[0], capacity, 0.5, [(qq[0, :, 0], kk[0, :, 0]) for qq, kk, _ in steps])
    assert kept_positions(layer) == ref
    assert layer.num_entries == capacity


def test_h2o_prefill_only_keeps_top_column_sums_and_window():
    n, capacity, window = 60, 20, 8
    q, k, v = _qkv(n=n)
    layer = make_layer(k, v)
    H2O(variant="prefill_only", window=window).prefill(layer, prefill_ctx(q, layer, capacity))
    ours = kept_positions(layer)
    for kv in range(2):
        acc = {j: 0.0 for j in range(n)}
        for x in range(3):
            for i in range(n):
                p = softmax_row(q[0, kv * 3 + x].double()[i], k[0, kv].double(), i, 8)
                for j in range(i + 1):
                    acc[j] += float(p[j]) / 3
        heavy = sorted(range(n - window), key=lambda j: -acc[j])[: capacity - window]
        assert_same_up_to_ties(ours[kv], sorted(heavy + list(range(n - window, n))), acc, set(range(n - window, n)))


# ---- registry and validation -----------------------------------------------------------------------------------------
def test_every_method_rejects_budget_below_its_window():
    with pytest.raises(ConfigError, match="budget=16.*window of 32"):
        build_method({"name": "snapkv"}, Budget.parse(16))
    with pytest.raises(ConfigError, match="budget=4"):
        build_method({"name": "streamingllm"}, Budget.parse(4))


def test_unknown_and_bad_fields():
    with pytest.raises(ConfigError, match="unknown method 'snapkvv'.*snapkv"):
        build_method({"name": "snapkvv"}, Budget.parse(128))
    with pytest.raises(ConfigError, match="no field.*windw.*valid fields"):
        build_method({"name": "snapkv", "windw": 3}, Budget.parse(128))
    with pytest.raises(ConfigError, match="pooling='median'"):
        build_method({"name": "snapkv", "pooling": "median"}, Budget.parse(128))


def test_pending_methods_say_what_is_missing():
    from kvbench.errors import NotAvailableError
    from kvbench.registry import Registry

    registry = Registry("method", {"fullkv": "kvbench.methods.fullkv:FullKV"}, pending={"later": "arrives with #9"})
    with pytest.raises(NotAvailableError, match="method .later. is configured but not implemented yet .arrives with"):
        registry.build("later", {})
    for name in METHODS.pending:
        with pytest.raises(NotAvailableError, match=f"{name}.*issue #4"):
            build_method({"name": name}, Budget.parse(128))
    implemented = {"fullkv", "streamingllm", "snapkv", "pyramidkv", "h2o"}
    implemented |= {"dynamickv", "omnikv", "d2o", "kvmerger", "pod"}
    implemented |= {"quest", "infllm", "pyramidinfer", "offload", "cla", "lococo"}
    implemented |= {"cam", "roco", "local", "lminfinite", "sirllm"}
    assert implemented <= set(METHODS.names())


@pytest.mark.parametrize("rows", [1, 2])
def test_h2o_decode_fast_path_equals_keep_top(rows):
    """H2O's unpadded decode step evicts the lowest accumulated score outside the recent window directly; the
    previous implementation (scores with the recent window at +inf, then keep_top) must agree at every step."""
    from helpers import decode_step
    from kvbench.engine.attention import grouped_attention
    from kvbench.methods.base import keep_top

    g = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(rows, h, 30, 8, generator=g) for h in (4, 2, 2))
    layers = []
    for _ in range(2):
        layer = make_layer(k.clone(), v.clone())
        method = H2O()
        method.prefill(layer, prefill_ctx(q, layer, 12))
        layers.append(layer)
    fast, slow = layers
    cap = torch.full((rows,), 12)
    for step in range(8):
        qq, kk, vv = (torch.randn(rows, h, 1, 8, generator=g) for h in (4, 2, 2))
        decode_step(method, fast, qq, kk, vv, 12)
        slow.update(kk, vv)
        _, probs = grouped_attention(qq, slow.keys, slow.values, None, 8**-0.5)
        slow.state["acc"] = slow.state["acc"] + probs.sum(3).mean(2)
        keep_top(slow, method._scores(slow, slow.state["acc"], cap), cap)
        for key in ("positions", "keys", "values"):
            assert torch.equal(getattr(fast, key), getattr(slow, key)), (step, key)
        assert torch.equal(fast.state["acc"], slow.state["acc"])
    assert fast.num_entries == 12
