"""SnapKV: keep the prompt tokens the last queries attend to, clustered by pooling.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS 2024, arXiv:2404.14469),
code FasterDecoding/SnapKV. reference/methods.md B4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import aggregate_group, pool1d, window_attention
from kvbench.methods.base import PrefillContext, check_choice, check_positive
from kvbench.methods.scorer import ScorerMethod

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

POOLING = ("max", "avg")
#: ``mean``/``max``: pool each query head's scores, then aggregate the KV group (kvbench's reading);
#: ``*_before_pool``: aggregate the group's window sums, then pool (KVCache-Factory's ``kv_head`` mode since 2026-07,
#: ``gqa_score_agg``)
GROUP_AGG = ("mean", "max", "mean_before_pool", "max_before_pool", "sum_before_pool")


def snap_scores(
    layer: KVLayer, ctx: PrefillContext, window: int, kernel: int, pooling: str, group_agg: str
) -> torch.Tensor:
    """SnapKV scores ``(B, H, n)`` with H the layer's heads (KV heads, or query heads after ``to_query_heads``):
    window attention summed over the window's queries, pooled and aggregated over each KV group in the order
    ``group_agg`` names; the window itself gets +inf (always kept), padding -inf."""
    probs = window_attention(ctx.queries, layer.keys, window, ctx.scaling, ctx.key_valid)  # (B, Hq, w, n)
    n = probs.shape[-1]
    heads = layer.keys.shape[1]
    votes = probs[..., : n - window].sum(-2)  # (B, Hq, n - w)
    if group_agg.endswith("_before_pool"):
        votes = aggregate_group(votes, heads, group_agg.removesuffix("_before_pool"))
        votes = pool1d(votes, kernel, pooling)
    else:
        votes = aggregate_group(pool1d(votes, kernel, pooling), heads, group_agg)  # (B, H, n - w)
    window_scores = torch.full((*votes.shape[:2], window), float("inf"), device=votes.device)
    scores = torch.cat([votes, window_scores], dim=-1)
    if ctx.key_valid is not None:
        scores = scores.masked_fill(~ctx.key_valid.view(scores.shape[0], 1, n), float("-inf"))
    return scores


@dataclass
class SnapKV(ScorerMethod):
    """Prefill-only selection: per head, keep the ``budget - window`` prompt tokens with the highest pooled
    attention from the last ``window`` queries, plus those ``window`` tokens.

    Defaults follow the paper's Listing 1: window 32, max-pool with kernel 5. ``pooling="avg"`` is the official
    code's default (``init_snapkv``); KVCache-Factory's LongBench runs use kernel 7, max-pool.
    Selection is KVCache-Factory's: ``torch.topk`` of ``budget - window`` over the past tokens alone, then the window
    (``keep_top(..., window=)``), so max-pooling's ties break as the reference's; kept tokens are stored in position
    order. In a left-padded batch each row is selected on its own tokens, as alone.
    GQA: ``granularity="kv_head"`` (default; DESIGN principle 3): scores are computed per query head (causal inside
    the window), pooled, then averaged over the query heads of each KV group (``group_agg="mean"``; ``"max"``), or
    averaged before pooling (``"mean_before_pool"``, KVCache-Factory's ``kv_head`` mode). ``"query_head"``: K/V are
    repeated to the query heads first and each query head keeps its own tokens (KVCache-Factory's default mode: the
    cache and its resident bytes are ``Hq / Hkv`` times larger).
    No compression when the prompt fits the budget; generated tokens are appended.
    """

    name: ClassVar[str] = "snapkv"
    compression: ClassVar[str] = "prefill"
    window: int = 32
    kernel: int = 5
    pooling: str = "max"
    group_agg: str = "mean"
    granularity: str = "kv_head"

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window, kernel=self.kernel)
        check_choice(self.name, "pooling", self.pooling, POOLING)
        check_choice(self.name, "group_agg", self.group_agg, GROUP_AGG)
        super().__post_init__()  # granularity

    def observation_window(self) -> int:
        return self.window

    def must_keep_count(self, n: int) -> int:
        """The window: the last ``min(window, n)`` entries are ``+inf`` in every head (votes are finite)."""
        return min(self.window, n)

    def score(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """``snap_scores``: the window (+inf), the pooled window attention before it (the layer's heads after
        ``granularity``; ``ScorerMethod.prefill_scores`` gives a prompt no longer than the window all +inf)."""
        return snap_scores(layer, ctx, self.window, self.kernel, self.pooling, self.group_agg)
