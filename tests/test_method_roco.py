"""RoCo against a slow reference of EasyKV's strided encoding + one eviction per decode step, in plain Python."""

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
from kvbench.methods.roco import RoCo, roco_victims

D = 8


def _qkv(n, hq=4, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, n, D, generator=g), torch.randn(1, hkv, n, D, generator=g),
            torch.randn(1, hkv, n, D, generator=g))


class Reference:
    """One KV head of RoCo with dicts: S, Q, c per token, the kept list in position order."""

    def __init__(self, q, k, v, kv, g, cap, recent, sinks, exclude_last=10, keep_first_stats=True):
        self.q, self.k, self.v, self.kv, self.g, self.cap = q.double(), k.double(), v.double(), kv, g, cap
        self.recent, self.sinks, self.exclude = recent, sinks, exclude_last
        self.keep_first_stats = keep_first_stats
        self.S, self.Q, self.c = {}, {}, {}
        self.kept: list[int] = []
        self.out = {}

    def attend(self, i, keys, count=True):
        """Query i over ``keys``; returns the group-mean probabilities and stores the per-head outputs."""
        mean = {j: 0.0 for j in keys}
        for x in range(self.g):
            h = self.kv * self.g + x
            logits = torch.tensor([float(self.q[h, i] @ self.k[self.kv, j]) / math.sqrt(D) for j in keys])
            p = torch.softmax(logits.double(), 0)
            self.out[(h, i)] = sum(float(w) * self.v[self.kv, j] for w, j in zip(p, keys))
            for w, j in zip(p, keys):
                mean[j] += float(w) / self.g
        if count:
            for j, a in mean.items():
                self.S[j] = self.S.get(j, 0.0) + a
                self.Q[j] = self.Q.get(j, 0.0) + a * a
                self.c[j] = self.c.get(j, 0) + 1
        return mean

    def evict(self, k, prefill):
        entries = list(self.kept)
        std = {}
        for idx, j in enumerate(entries):
            c = max(self.c.get(j, 0), 1)
            m = self.S.get(j, 0.0) / c
            s = math.sqrt(max(self.Q.get(j, 0.0) / c - m * m, 0.0))
            if idx >= len(entries) - self.exclude or idx < self.sinks:
                s = math.inf
            std[j] = s
        pool_size = max(self.cap - int(self.cap * self.recent) - self.sinks, k)
        by_std = sorted(entries, key=lambda j: (std[j], j))[:pool_size]
        rank = {j: r for r, j in enumerate(by_std)}
        victims = sorted(by_std, key=lambda j: (self.S.get(j, 0.0) / max(self.c.get(j, 0), 1), rank[j]))[:k]
        self.kept = [j for j in entries if j not in victims]

    def prefill(self, n, stride):
        for i in range(self.cap):
            self.attend(i, list(range(i + 1)), count=self.keep_first_stats)
        self.kept = list(range(self.cap))
        for start in range(self.cap, n, stride):
            chunk = list(range(start, min(n, start + stride)))
            for i in chunk:
                self.attend(i, self.kept + [j for j in chunk if j <= i])
            self.kept += chunk
            self.evict(len(chunk), prefill=True)

    def decode(self, t):
        self.kept.append(t)
        self.attend(t, list(self.kept))
        if len(self.kept) > self.cap:
            self.evict(1, prefill=False)


@pytest.mark.parametrize("stride, variant", [(1, "paper"), (3, "paper"), (4, "easykv")])
def test_prefill_and_decode_match_the_reference(stride, variant):
    n, cap, steps = 64, 40, 6  # pool = 40 - 12 = 28 of the 31 non-excluded entries: the std filter matters
    q, k, v = _qkv(n + steps)
    layer = make_layer(k[:, :, :n], v[:, :, :n])
    ctx = prefill_ctx(q[:, :, :n], layer, cap)
    method = RoCo(stride=stride, variant=variant, chunk=7)
    out = method.prefill_attend(layer, ctx)
    method.prefill(layer, ctx)
    refs = []
    for kv in range(2):
        recent, sinks = (0.1, 4) if variant == "easykv" else (0.3, 0)
        ref = Reference(q[0], k[0], v[0], kv, 2, cap, recent, sinks, keep_first_stats=variant == "paper")
        ref.prefill(n, stride)
        refs.append(ref)
        assert kept_positions(layer)[kv] == ref.kept
        for x in range(2):
            h = kv * 2 + x
            for i in range(n):
                assert torch.allclose(out[0, i, h].double(), ref.out[(h, i)], atol=1e-5), (h, i)
        for name, stat in (("roco_sum", ref.S), ("roco_sq", ref.Q), ("roco_count", ref.c)):
            expect = torch.tensor([stat.get(j, 0.0) for j in ref.kept], dtype=torch.float64)
            assert torch.allclose(layer.state[name][0, kv].double(), expect, atol=1e-5), name
    for t in range(n, n + steps):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        _, probs = grouped_attention(q[:, :, t : t + 1], layer.keys, layer.values, None, D**-0.5)
        method.decode(layer, DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=2, query=q[:, :, t : t + 1],
                                           probs=probs, capacity=torch.tensor([cap])))
        for kv in range(2):
            refs[kv].recent, refs[kv].sinks = 0.3, 0  # EasyKV's decode constants (both variants)
            refs[kv].decode(t)
            assert kept_positions(layer)[kv] == refs[kv].kept
    assert layer.num_entries == cap


def test_victims_come_from_the_low_std_pool_and_ties_go_to_the_older_token():
    # 6 entries; counts 4 each. means: e0 .10, e1 .05 (lowest, but high std), e2 .20, e3 .20, e4 .30, e5 .30
    means = torch.tensor([0.10, 0.05, 0.20, 0.20, 0.30, 0.30])
    stds = torch.tensor([0.01, 0.40, 0.00, 0.00, 0.02, 0.00])
    counts = torch.full((6,), 4.0)
    sums = means * counts
    squares = (stds**2 + means**2) * counts
    view = lambda x: x.view(1, 1, -1)  # noqa: E731
    # pool of 4 lowest std: e2, e3, e5 (std 0, older first), e0 (.01); e1 has the lowest mean but is not a candidate
    assert roco_victims(view(sums), view(squares), view(counts), 1, 4, 0, 0).tolist() == [[[0]]]
    # pool of 3: e2, e3, e5 -> lowest mean .20 tied between e2 and e3: the older (e2)
    assert roco_victims(view(sums), view(squares), view(counts), 1, 3, 0, 0).tolist() == [[[2]]]
    # the first three as sinks and the last entry excluded: pool e3 (std 0), e4 (.02) -> e3 (e2 would tie it, older)
    assert roco_victims(view(sums), view(squares), view(counts), 1, 2, 1, 3).tolist() == [[[3]]]
    # two victims, in increasing mean
    assert roco_victims(view(sums), view(squares), view(counts), 2, 4, 0, 0).tolist() == [[[0, 2]]]
    # a pool as large as the cache reaches the lowest mean
    assert roco_victims(view(sums), view(squares), view(counts), 1, 6, 0, 0).tolist() == [[[1]]]


def test_prompt_that_fits_keeps_everything_with_causal_statistics():
    n, cap = 12, 20
    q, k, v = _qkv(n)
    layer = make_layer(k, v)
    ctx = prefill_ctx(q, layer, cap)
    method = RoCo()
    assert method.prefill_attend(layer, ctx) is None
    method.prefill(layer, ctx)
    assert layer.num_entries == n
    ref = Reference(q[0], k[0], v[0], 1, 2, n, 0.3, 0)
    for i in range(n):
        ref.attend(i, list(range(i + 1)))
    expect = torch.tensor([ref.S[j] for j in range(n)], dtype=torch.float64)
    assert torch.allclose(layer.state["roco_sum"][0, 1].double(), expect, atol=1e-5)
    assert layer.state["roco_count"][0, 1].tolist() == [n - j for j in range(n)]


def test_config_validation():
    with pytest.raises(ConfigError, match="variant='h2o'.*paper, easykv"):
        build_method({"name": "roco", "variant": "h2o"}, Budget.parse(64))
    with pytest.raises(ConfigError, match="stride=0"):
        build_method({"name": "roco", "stride": 0}, Budget.parse(64))
    with pytest.raises(ConfigError, match="recent_ratio=1.2"):
        build_method({"name": "roco", "recent_ratio": 1.2}, Budget.parse(64))
