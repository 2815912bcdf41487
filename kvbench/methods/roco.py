"""RoCo: robust cache omission, evicting low-mean attention among the low-variance tokens.

Ren & Zhu, "On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language Model Inference"
(arXiv:2402.06262), code DRSY/EasyKV (``easykv/easykv.py``, policy ``h2o_head_std_avg``, later named ``roco``, in the
``encoding_decoding`` mode). reference/methods.md B7; D2O (paper 000) Tables 1, 2 and 17.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.errors import ConfigError
from kvbench.methods.base import (
    DecodeContext,
    Method,
    PrefillContext,
    check_choice,
    check_positive,
    host_ints,
    keep_top,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

VARIANTS = ("paper", "easykv")
STATS = ("roco_sum", "roco_sq", "roco_count")


def roco_victims(sums, squares, counts, k: int, pool: int, exclude_last: int, sinks: int) -> torch.Tensor:
    """Entries to evict ``(B, H, k)`` from per-entry statistics ``(B, H, T)`` (entries in position order).

    mean = S/c, std = sqrt(max(Q/c - mean², 0)). The last ``exclude_last`` entries and the first ``sinks`` get
    std = +inf (EasyKV's 1e9). The candidate pool is the ``pool`` lowest-std entries (ties: older first); the ``k``
    candidates with the lowest mean are evicted (ties: lower std, then older).
    """
    counts = counts.clamp(min=1)
    mean = sums / counts
    std = (squares / counts - mean.square()).clamp(min=0).sqrt()
    t = std.shape[-1]
    std[..., max(0, t - exclude_last) :] = float("inf")
    std[..., : min(sinks, t)] = float("inf")
    pool_idx = torch.sort(std, dim=-1, stable=True).indices[..., : min(pool, t)]
    pick = torch.sort(torch.gather(mean, -1, pool_idx), dim=-1, stable=True).indices[..., :k]
    return torch.gather(pool_idx, -1, pick)


def static_evict(slots, probs: torch.Tensor, policy) -> None:
    """RoCo's decode step in the captured step (``StaticPolicy.evict``), ``RoCo.decode`` on the slots: the step's
    group-mean attention joins each entry's sum, squares and count (``slots.state``), then where a (row, head) holds
    more than its capacity one entry leaves, chosen by :func:`roco_victims`'s rule over the entries in position order
    (the slots sorted by position, empty ones last): the pool is the ``capacity - int(capacity x ratio) - sinks``
    lowest std (computed from each row's capacity on the device, in float64 as the host computes it), the victim its
    lowest mean. ``params``: (ratio, sinks, exclude_last)."""
    from kvbench.engine.static import put_slots

    ratio, sinks, exclude_last = policy.params
    state, valid, positions = slots.state, slots.valid, slots.positions
    row = probs.mean(2)[..., 0, :]  # (B, Hkv, C): the step's attention, mean over the GQA group
    state["roco_sum"].add_(row)
    state["roco_sq"].add_(row.square())
    state["roco_count"].add_(valid.to(row.dtype))  # the step's one query attended every entry held
    c = valid.shape[-1]
    order = torch.argsort(positions.masked_fill(~valid, torch.iinfo(positions.dtype).max), dim=-1, stable=True)
    sums, squares, counts = (torch.gather(state[name], -1, order) for name in STATS)
    counts = counts.clamp(min=1)
    mean = sums / counts
    std = (squares / counts - mean.square()).clamp(min=0).sqrt()
    held = valid.sum(-1, keepdim=True)  # (B, Hkv, 1)
    rank = torch.arange(c, device=valid.device)
    std = std.masked_fill((rank >= held - exclude_last) | (rank < sinks), float("inf"))  # empty slots: last, inf
    capacity = slots.capacity  # (B, 1, 1)
    pool = (capacity - torch.floor(capacity.to(torch.float64) * ratio).long() - sinks).clamp(min=1)
    pool_idx = torch.sort(std, dim=-1, stable=True).indices  # lowest std first, older first among equals
    pool_mean = torch.gather(mean, -1, pool_idx).masked_fill(rank >= pool, float("inf"))
    victim = torch.gather(order, -1, torch.gather(pool_idx, -1, torch.argmin(pool_mean, dim=-1, keepdim=True)))
    over = held > capacity
    put_slots(valid, victim, torch.gather(valid, -1, victim) & ~over)


@dataclass
class RoCo(Method):
    """Per layer and KV head: S_j (accumulated attention), Q_j (accumulated squared attention) and c_j (queries
    that attended token j). Whenever the cache is over its budget C: candidates = the C - ⌊recent_ratio·C⌋ tokens
    with the lowest std (the last ``exclude_last`` = 10 entries and ``sink_size`` first entries never), evict the
    candidates with the lowest mean S/c (EasyKV's ``h2o_head_std_avg``). ``recent_ratio`` = 0.3 is EasyKV's decode
    constant ("protected recent window": it only sizes the pool; nothing but the last 10 is protected explicitly).
    Ties: equal std -> the older token enters the pool first; equal mean -> the lower std, then the older, goes.

    Prefill runs EasyKV's "encoding" loop inside the layer (``prefill_attend``): the first C prompt tokens attend
    causally, then the rest arrive in chunks of ``stride`` tokens that attend only to the kept cache and causally
    to each other; after each chunk as many entries are evicted as arrived (the pool is at least ``stride``).
    Decoding: one token per step, one eviction per step. Attention is averaged over each GQA group before
    squaring (EasyKV). Statistics start with the prompt: S, Q, c count every query that attended a token.

    ``variant="easykv"`` reproduces EasyKV's ``encoding_decoding`` constants: during prefill ``recent_ratio=0.1``
    (its ``generation_config`` default) and 4 excluded sinks (``temp_length``), and the first C tokens' own
    attention is dropped (``keep_attention=False``: statistics start at the first chunk); decoding uses 0.3 and no
    sinks (the ``recent_ratio`` and ``sink_size`` fields apply to ``variant="paper"``). Deviation from EasyKV in both
    variants: its encoding loop keeps ``idx`` ∈ (C, C + stride] entries (the budget is inflated by one stride);
    kvbench keeps exactly C (the last chunk may be shorter). Batch size 1 (the official code indexes row 0). A prompt
    that fits the budget is not compressed; its statistics are the column sums of its causal attention.
    """

    name: ClassVar[str] = "roco"
    own_attention: ClassVar[bool] = True
    compression: ClassVar[str] = "prefill"
    needs_decode_probs: ClassVar[bool] = True
    supports_batching: ClassVar[bool] = False
    recent_ratio: float = 0.3
    exclude_last: int = 10
    sink_size: int = 0
    stride: int = 1
    variant: str = "paper"
    chunk: int = 512

    def __post_init__(self) -> None:
        check_positive(self.name, stride=self.stride, chunk=self.chunk)
        check_choice(self.name, "variant", self.variant, VARIANTS)
        if not 0 <= self.recent_ratio < 1:
            raise ConfigError(f"method 'roco': recent_ratio={self.recent_ratio} must be in [0, 1)")
        if self.exclude_last < 0 or self.sink_size < 0:
            raise ConfigError(f"method 'roco': exclude_last={self.exclude_last} and sink_size={self.sink_size} "
                              "must be >= 0")

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured step: :func:`static_evict` over the three statistics the slots carry."""
        from kvbench.engine.static import StaticPolicy

        ratio, sinks = self._phase(False)
        return StaticPolicy(evict=static_evict, needs_probs=True, state=STATS, params=(ratio, sinks, self.exclude_last))

    def min_budget_tokens(self) -> int:
        return 2

    def _phase(self, prefill: bool) -> tuple[float, int]:
        """(recent ratio, excluded sinks) of a phase."""
        if self.variant == "easykv":
            return (0.1, 4) if prefill else (0.3, 0)
        return self.recent_ratio, self.sink_size

    def _pool(self, capacity: int, k: int, prefill: bool) -> int:
        ratio, sinks = self._phase(prefill)
        return max(capacity - int(capacity * ratio) - sinks, k)

    @staticmethod
    def _probs(q, keys, allowed, scaling):
        """Group-mean attention ``(B, Hkv, c, T)`` and outputs' probabilities ``(B, Hkv, g, c, T)``."""
        b, hkv = keys.shape[:2]
        logits = torch.einsum("bhgqd,bhkd->bhgqk", q, keys).float() * scaling
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        return probs.mean(2), probs

    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        cap, n = ctx.host_ints()[1][0], ctx.n
        if n <= cap:
            return None
        b, hq, _, d = ctx.queries.shape
        hkv = layer.keys.shape[1]
        qg = ctx.queries.view(b, hkv, hq // hkv, n, d)
        dev = qg.device
        stats = [torch.zeros(b, hkv, n, device=dev) for _ in STATS]
        outs = []
        for start in range(0, cap, self.chunk):  # the first C tokens: plain causal attention
            stop = min(cap, start + self.chunk)
            allowed = torch.arange(stop, device=dev).view(1, -1) <= torch.arange(start, stop, device=dev).view(-1, 1)
            mean, probs = self._probs(qg[:, :, :, start:stop], layer.keys[:, :, :stop], allowed, ctx.scaling)
            outs.append(torch.einsum("bhgqk,bhkd->bhgqd", probs.to(layer.values.dtype), layer.values[:, :, :stop]))
            if self.variant == "paper":
                stats[0][..., :stop] += mean.sum(2)
                stats[1][..., :stop] += mean.square().sum(2)
                stats[2][..., :stop] += allowed.sum(0)
        # the kept cache, packed per entry: kv = [key | value], st = [S, Q, c, position] (float32)
        kv = torch.cat([layer.keys, layer.values], dim=-1)
        pos = torch.arange(n, device=dev, dtype=torch.float32).expand(b, hkv, n)
        st = torch.stack([*stats, pos], dim=-1)
        kv_c, st_c = kv[:, :, :cap], st[:, :, :cap]
        causal = torch.ones(self.stride, self.stride, dtype=torch.bool, device=dev).tril()
        sinks = self._phase(True)[1]
        for start in range(cap, n, self.stride):
            stop = min(n, start + self.stride)
            k = stop - start
            kv_c = torch.cat([kv_c, kv[:, :, start:stop]], dim=2)
            st_c = torch.cat([st_c, st[:, :, start:stop]], dim=2)
            logits = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, start:stop], kv_c[..., :d]).float() * ctx.scaling
            if k > 1:
                logits[..., cap:] = logits[..., cap:].masked_fill(~causal[:k, :k], float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            outs.append(torch.einsum("bhgqk,bhkd->bhgqd", probs.to(kv_c.dtype), kv_c[..., d:]))
            mean = probs.mean(2)
            st_c[..., 0] += mean.sum(2)
            st_c[..., 1] += mean.square().sum(2)
            st_c[..., 2] += k
            st_c[..., cap:, 2] -= torch.arange(k, device=dev)  # chunk token u is seen by the k - u queries after it
            victims = roco_victims(st_c[..., 0], st_c[..., 1], st_c[..., 2], k, self._pool(cap, k, True),
                                   self.exclude_last, sinks)
            keep = torch.ones(st_c.shape[:3], dtype=torch.uint8, device=dev).scatter_(-1, victims, 0)
            kept = torch.sort(keep, dim=-1, descending=True, stable=True).indices[..., :cap, None]  # in order
            kv_c = torch.gather(kv_c, 2, kept.expand(-1, -1, -1, kv_c.shape[-1]))  # no boolean index: no host read
            st_c = torch.gather(st_c, 2, kept.expand(-1, -1, -1, st_c.shape[-1]))
        kept = st_c[..., 3].long()
        for i, s in enumerate(stats):
            s.scatter_(-1, kept, st_c[..., i])
        keep_mask = torch.zeros(b, hkv, n, device=dev).scatter_(-1, kept, 1.0)
        layer.state.update(dict(zip(STATS, stats)), roco_keep=keep_mask)
        out = torch.cat(outs, dim=3).reshape(b, hq, n, d)
        return out.transpose(1, 2).contiguous()

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if "roco_keep" not in layer.state:  # the prompt fits: statistics of its causal attention, nothing evicted
            self._prompt_stats(layer, ctx)
            return
        keep = layer.state.pop("roco_keep")
        keep_top(layer, keep.masked_fill(keep == 0, float("-inf")), ctx.capacity)

    def _prompt_stats(self, layer: KVLayer, ctx: PrefillContext) -> None:
        b, hq, n, d = ctx.queries.shape
        hkv = layer.keys.shape[1]
        qg = ctx.queries.view(b, hkv, hq // hkv, n, d)
        stats = [torch.zeros(b, hkv, n, device=qg.device) for _ in STATS]
        for start in range(0, n, self.chunk):
            stop = min(n, start + self.chunk)
            allowed = torch.arange(stop, device=qg.device).view(1, -1) <= torch.arange(start, stop,
                                                                                          device=qg.device).view(-1, 1)
            mean, _ = self._probs(qg[:, :, :, start:stop], layer.keys[:, :, :stop], allowed, ctx.scaling)
            stats[0][..., :stop] += mean.sum(2)
            stats[1][..., :stop] += mean.square().sum(2)
            stats[2][..., :stop] += allowed.sum(0)
        layer.state.update(dict(zip(STATS, stats)))

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        if ctx.probs is None:
            return
        row = ctx.probs.mean(2)  # (B, Hkv, q, T): mean over the GQA group
        q, t = row.shape[2:]
        seen = torch.full((t,), float(q), device=row.device)  # queries of this step that attended each entry
        seen[t - q :] = torch.arange(q, 0, -1, device=row.device, dtype=seen.dtype)
        layer.state["roco_sum"] = layer.state["roco_sum"] + row.sum(2)
        layer.state["roco_sq"] = layer.state["roco_sq"] + row.square().sum(2)
        layer.state["roco_count"] = layer.state["roco_count"] + seen
        cap = host_ints(layer, ctx.capacity)[0]
        while layer.num_entries > cap:
            victims = roco_victims(*(layer.state[s] for s in STATS), 1, self._pool(cap, 1, False),
                                   self.exclude_last, self._phase(False)[1])
            layer.evict_one(victims[..., 0])
