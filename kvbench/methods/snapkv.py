"""SnapKV: keep the prompt tokens the last queries attend to, clustered by pooling.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS 2024, arXiv:2404.14469),
code FasterDecoding/SnapKV. reference/methods.md B4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import aggregate_group, pool1d, window_attention
from kvbench.methods.base import Method, PrefillContext, check_choice, check_positive, keep_top

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

POOLING = ("max", "avg")
GROUP_AGG = ("mean", "max")


def snap_scores(
    layer: KVLayer, ctx: PrefillContext, window: int, kernel: int, pooling: str, group_agg: str
) -> torch.Tensor:
    """SnapKV scores ``(B, Hkv, n)``: window attention summed over the window's queries, pooled per query head,
    aggregated over each KV group; the window itself gets +inf (always kept), padding -inf."""
    probs = window_attention(ctx.queries, layer.keys, window, ctx.scaling, ctx.key_valid)  # (B, Hq, w, n)
    n = probs.shape[-1]
    votes = probs[..., : n - window].sum(-2)  # (B, Hq, n - w)
    votes = pool1d(votes, kernel, pooling)
    votes = aggregate_group(votes, ctx.num_kv_heads, group_agg)  # (B, Hkv, n - w)
    window_scores = torch.full((*votes.shape[:2], window), float("inf"), device=votes.device)
    scores = torch.cat([votes, window_scores], dim=-1)
    if ctx.key_valid is not None:
        scores = scores.masked_fill(~ctx.key_valid.view(scores.shape[0], 1, n), float("-inf"))
    return scores


@dataclass
class SnapKV(Method):
    """Prefill-only selection: per KV head, keep the ``budget - window`` prompt tokens with the highest pooled
    attention from the last ``window`` queries, plus those ``window`` tokens.

    Defaults follow the paper's Listing 1: window 32, max-pool with kernel 5. ``pooling="avg"`` is the official
    code's default (``init_snapkv``); KVCache-Factory's LongBench runs use kernel 7, max-pool.
    GQA: scores are computed per query head (causal inside the window), pooled, then averaged over the query heads
    of each KV group (``group_agg``), so the cache stays at KV-head granularity (DESIGN principle 3).
    No compression when the prompt fits the budget; generated tokens are appended.
    """

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 5
    pooling: str = "max"
    group_agg: str = "mean"

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window, kernel=self.kernel)
        check_choice(self.name, "pooling", self.pooling, POOLING)
        check_choice(self.name, "group_agg", self.group_agg, GROUP_AGG)

    def min_budget_tokens(self) -> int:
        return self.window + 1

    def min_budget_reason(self) -> str:
        return f"the observation window of {self.window} tokens is part of the budget"

    def layer_capacity(self, ctx: PrefillContext) -> torch.Tensor:
        """Tokens this layer keeps per row (window included): the budget, the same in every layer."""
        return ctx.capacity

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.n <= self.window or bool((ctx.prompt_lens <= ctx.capacity).all()):
            return
        scores = snap_scores(layer, ctx, self.window, self.kernel, self.pooling, self.group_agg)
        keep_top(layer, scores, self.layer_capacity(ctx))
