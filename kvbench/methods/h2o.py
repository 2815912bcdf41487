"""H2O: heavy hitters (largest accumulated attention) + recent tokens.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(NeurIPS 2023, arXiv:2306.14048), code FMInference/H2O (``utils_real_drop``). reference/methods.md B3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import aggregate_group, window_attention, window_causal_column_sums
from kvbench.methods.base import (
    GRANULARITY,
    DecodeContext,
    Method,
    PrefillContext,
    attend_with_column_sums,
    check_choice,
    check_positive,
    host_ints,
    keep_top,
    prompt_column_sums,
    real_rank,
    to_query_heads,
    unpadded_overflow,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: ``prefill_only`` and the ``kvfactory_*`` readings are KVCache-Factory's ``H2OKVCluster`` at three periods:
#: ``kvfactory_2406`` the last window's queries only (until 98e8228, 2024-10-13), ``kvfactory_2410`` all queries with
#: only the last w x w block masked (98e8228 to 9f9aa2e, 2026-06-22), ``prefill_only`` all queries, causal (since)
VARIANTS = ("paper", "prefill_only", "kvfactory_2406", "kvfactory_2410")
PREFILL_ONLY = ("prefill_only", "kvfactory_2406", "kvfactory_2410")
GROUP_AGG = ("mean", "max")


@dataclass
class H2O(Method):
    """Accumulated-attention eviction, per layer and KV head.

    ``paper`` (default; decode-time, as the H2O paper and its real-drop code): at the end of prefill each token's
    score is its column sum of prompt attention ``acc[j] = sum_i A[i, j]``; keep the top
    ``budget - recent`` by score from the non-recent part plus the ``recent`` newest tokens, with
    ``recent = round(recent_ratio * budget)`` (50/50 as the papers that compare against H2O use). At every decode
    step the new query's attention row is added to ``acc`` (the new token starts with its own weight) and, once the
    cache exceeds the budget, the non-recent entry with the lowest ``acc`` is evicted, so the cache stays at
    ``budget`` entries.

    KVCache-Factory's one-shot prefill readings (no decode eviction; keep the top ``budget - window`` past tokens
    plus the last ``window``), named by the period of its code (docs/baseline_readings.md says which table used which):

    * ``prefill_only``: scores are the column sums of causal attention over all prompt queries (its code since
      9f9aa2e, 2026-06-22);
    * ``kvfactory_2410``: all prompt queries, but only the last ``window`` x ``window`` block masked: queries before
      the window see later tokens too (98e8228, 2024-10-13, to 9f9aa2e);
    * ``kvfactory_2406``: the last ``window`` queries only (causal inside the window), no pooling: SnapKV with kernel
      1 (until 98e8228).

    Selection is ``torch.topk`` over the past tokens alone, then the window/recent tokens appended (as the H2O and
    KVCache-Factory code), so ties break as theirs; kept tokens are stored in position order.
    GQA: ``granularity="kv_head"`` (default): per-query-head scores are averaged over each KV group (``group_agg=
    "mean"`` as KVMerger's H2O and KVCache-Factory's ``kv_head`` mode; OmniKV's port uses ``max``).
    ``"query_head"``: K/V repeated to the query heads, one kept set (and accumulated score) per query head, as the H2O
    code and KVCache-Factory's default mode (caches ``Hq / Hkv`` times larger). Column sums are computed in query
    chunks, never as an n x n matrix: together with the layer's attention output when the prompt is unpadded
    (``attend_with_column_sums``), else in ``chunk``-query passes.
    """

    name: ClassVar[str] = "h2o"
    compression: ClassVar[str] = "prefill"
    needs_decode_probs: ClassVar[bool] = True
    recent_ratio: float = 0.5
    window: int = 32
    variant: str = "paper"
    group_agg: str = "mean"
    granularity: str = "kv_head"
    chunk: int = 512

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window, chunk=self.chunk)
        check_choice(self.name, "variant", self.variant, VARIANTS)
        check_choice(self.name, "group_agg", self.group_agg, GROUP_AGG)
        check_choice(self.name, "granularity", self.granularity, GRANULARITY)
        if not 0 < self.recent_ratio < 1:
            from kvbench.errors import ConfigError

            raise ConfigError(f"method 'h2o': recent_ratio={self.recent_ratio} must be in (0, 1)")
        # the prefill-only readings never look at decode attention, so they keep the fast decode path
        self.needs_decode_probs = self.variant == "paper"
        self._recent_cache: dict[tuple[int, ...], list[int]] = {}  # host capacities -> recent sizes

    def min_budget_tokens(self) -> int:
        return self.window + 1 if self.variant in PREFILL_ONLY else 2

    def min_budget_reason(self) -> str:
        if self.variant in PREFILL_ONLY:
            return f"the window of {self.window} recent tokens is part of the budget"
        return "one heavy hitter and one recent token"

    def _recent(self, capacity: torch.Tensor) -> torch.Tensor:
        if self.variant in PREFILL_ONLY:
            return torch.full_like(capacity, self.window)
        return recent_window(capacity, self.recent_ratio)

    def _scores(self, layer: KVLayer, acc: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
        rank = real_rank(layer)
        recent = (rank >= layer.valid_counts().unsqueeze(-1) - self._recent(capacity).view(-1, 1, 1)) & (rank >= 0)
        return acc.masked_fill(recent, float("inf"))

    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        if self.variant in ("kvfactory_2406", "kvfactory_2410"):
            return None  # their scores are not the causal column sums: the backend's attention
        return attend_with_column_sums(layer, ctx)  # the prompt's attention and its column sums in one pass

    def _prompt_scores(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """Per-query-head scores ``(B, Hq, n)`` of the variant."""
        if self.variant == "kvfactory_2406":
            return window_attention(ctx.queries, layer.keys, self.window, ctx.scaling, ctx.key_valid).sum(-2)
        if self.variant == "kvfactory_2410":
            return window_causal_column_sums(ctx.queries, layer.keys, self.window, ctx.scaling, ctx.key_valid,
                                             chunk=self.chunk)
        return prompt_column_sums(layer, ctx, self.chunk)

    def _prompt_acc(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """The variant's prompt scores per head of the layer ``(B, H, n)`` (KV heads, or query heads after
        ``granularity``)."""
        to_query_heads(layer, ctx, self.granularity)
        return aggregate_group(self._prompt_scores(layer, ctx), layer.keys.shape[1], self.group_agg)

    def prefill_scores(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """The prefill selection's scores: accumulated prompt attention per head, the recent tokens (``window`` for
        the prefill-only variants, ``round(recent_ratio * budget)`` for ``paper``) at +inf, padding -inf."""
        acc = self._prompt_acc(layer, ctx)
        if ctx.key_valid is not None:
            acc = acc.masked_fill(~ctx.key_valid[:, None], float("-inf"))
        return self._scores(layer, acc, ctx.capacity)

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        acc = self._prompt_acc(layer, ctx)
        if self.variant == "paper":
            layer.state["acc"] = acc
        caps = ctx.host_ints()[1]  # the session's host ints: no read of the device per layer
        recent = self._recent_host(tuple(caps))
        keep_top(layer, self._scores(layer, acc, ctx.capacity), caps, window=recent)

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        if self.variant != "paper" or ctx.probs is None:
            return
        step = ctx.probs.sum(3)  # over the step's queries: (B, Hkv, g, entries)
        step = step.mean(2) if self.group_agg == "mean" else step.amax(2)
        layer.state["acc"] = layer.state["acc"] + step
        overflow = unpadded_overflow(layer, ctx.capacity)  # unpadded: decided on host ints
        if overflow == 0:
            return
        if overflow == 1:  # the lowest score outside the recent window (keep_top's argmin), without the mask
            recent = self._recent_host(tuple(host_ints(layer, ctx.capacity)))
            if len(set(recent)) == 1:
                layer.evict_one(layer.state["acc"][..., : layer.num_entries - recent[0]].argmin(-1))
                return
        keep_top(layer, self._scores(layer, layer.state["acc"], ctx.capacity), ctx.capacity)

    def static_policy(self, capacity: int, layer_idx: int = 0):
        from kvbench.engine.static import StaticPolicy

        if self.variant != "paper":
            return StaticPolicy()
        # the recent window follows each row's capacity on the device (as ``_recent`` does in the eager path), so a
        # prompt shorter than the budget (its capacity is its length) replays the same graph as any other
        return StaticPolicy(evict=static_evict, accumulate=True, params=(self.recent_ratio,))

    def _recent_host(self, caps: tuple[int, ...]) -> list[int]:
        """``_recent`` of host capacities, with the same float32 arithmetic (computed on the CPU, once per value)."""
        if caps not in self._recent_cache:
            self._recent_cache[caps] = [int(x) for x in self._recent(torch.tensor(caps)).tolist()]
        return self._recent_cache[caps]


def recent_window(capacity: torch.Tensor, ratio: float) -> torch.Tensor:
    """The recent tokens the paper reading protects per row: ``round(capacity x ratio)``, at least 1 and at most
    ``capacity - 1`` (one heavy hitter), in float32 as a tensor of capacities computes it (the eager and the captured
    steps both)."""
    return torch.clamp(torch.round(capacity * ratio).long(), 1, None).clamp(max=capacity - 1)


def static_evict(slots, probs, policy) -> None:
    """H2O's decode step on a static layer (``engine.static.StaticPolicy.evict``): the entry with the lowest
    accumulated attention outside the newest ``round(capacity x params[0])`` positions (the recent ratio; at least 1,
    at most capacity - 1, each row's capacity: ``recent_window``) leaves."""
    from kvbench.engine.static import evict_one

    positions, valid, capacity = slots.positions, slots.valid, slots.capacity
    recent = recent_window(capacity, policy.params[0])
    newest = positions.masked_fill(~valid, -1).amax(-1, keepdim=True)
    candidate = valid & (positions <= newest - recent)
    evict_one(valid, slots.acc.masked_fill(~candidate, float("inf")), slots.capacity)
