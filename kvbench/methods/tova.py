"""TOVA: at every step, evict the token the current query attends to least (heads averaged).

Oren et al., "Transformers are Multi-State RNNs" (EMNLP 2024, arXiv:2401.06104), code schwartz-lab-NLP/TOVA
(``src/tova_cache.py``); kvpress ``TOVAPress``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import window_attention
from kvbench.methods.base import DecodeContext, PrefillContext, check_choice, keep_top
from kvbench.methods.scorer import ScorerMethod

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: ``paper``: the official TOVACache (prefill reduced by the last prompt query, then one eviction per decode step);
#: ``kvpress_prefill``: kvpress's TOVAPress, a one-shot prefill selection with the last prompt token kept
VARIANTS = ("paper", "kvpress_prefill")


def last_query_scores(queries: torch.Tensor, keys: torch.Tensor, scaling: float,
                      key_valid: torch.Tensor | None) -> torch.Tensor:
    """Attention of the last query over all keys averaged over the query heads, the same for every KV head:
    ``(B, Hkv, n)``; padding ``-inf``."""
    probs = window_attention(queries, keys, 1, scaling, key_valid)[:, :, 0]  # (B, Hq, n)
    scores = probs.mean(1, keepdim=True).expand(-1, keys.shape[1], -1)
    if key_valid is not None:
        scores = scores.masked_fill(~key_valid[:, None], float("-inf"))
    return scores


@dataclass
class TOVA(ScorerMethod):
    """Token eviction by the current query's attention, averaged over all query heads, one kept set per layer shared
    by every head (the official code averages ``attn_weights[:, :, -1, :]`` over heads and gathers every KV head
    with the same indices).

    ``variant="paper"`` (default; the official ``TOVACache.reduce``, called after every attention): at the end of
    prefill keep the ``budget`` tokens the last prompt query attends to most (itself included, nothing forced); then
    at every decode step, once the cache holds ``budget + 1`` entries, evict the one the step's query attends to
    least (the new token can go). ``variant="kvpress_prefill"``: kvpress's ``TOVAPress``, prefill only: the last
    prompt query's attention over the other tokens, the last token always kept, no eviction while decoding. The
    prefill selection of both is ``ScorerMethod``'s (``torch.topk`` of ``score``, no window).
    """

    name: ClassVar[str] = "tova"
    compression: ClassVar[str] = "prefill"
    needs_decode_probs: ClassVar[bool] = True
    variant: str = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "variant", self.variant, VARIANTS)
        self.needs_decode_probs = self.variant == "paper"  # the prefill reading keeps the fast decode path

    def score(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        scores = last_query_scores(ctx.queries, layer.keys, ctx.scaling, ctx.key_valid)
        if self.variant == "kvpress_prefill":  # the last token is kept whatever its score
            scores = scores.clone()
            scores[..., -1] = float("inf")
        return scores

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        if self.variant != "paper" or ctx.probs is None:
            return
        b, hkv = ctx.probs.shape[:2]
        scores = ctx.probs[:, :, :, -1].mean((1, 2))  # the step's last query, all query heads: (B, entries)
        scores = scores[:, None].expand(b, hkv, -1)
        if layer.valid is not None:
            scores = scores.masked_fill(~layer.valid, float("-inf"))
        keep_top(layer, scores, ctx.capacity)

    def static_policy(self, capacity: int, layer_idx: int = 0):
        from kvbench.engine.static import StaticPolicy

        if self.variant == "kvpress_prefill":
            return StaticPolicy()
        return StaticPolicy(evict=static_evict, needs_probs=True)


def static_evict(slots, probs, policy) -> None:
    """TOVA's decode step on a static layer (``engine.static.StaticPolicy.evict``): the entry this step's query
    attends to least, averaged over all query heads, leaves every KV head (the new one included)."""
    from kvbench.engine.static import evict_one

    b, hkv, c = slots.valid.shape
    key = probs[:, :, :, -1].mean((1, 2)).unsqueeze(1).expand(b, hkv, c).masked_fill(~slots.valid, float("inf"))
    evict_one(slots.valid, key, slots.capacity)
