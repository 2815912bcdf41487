"""AdaKV: head-wise budgets, the top scores of a layer across all its heads, with a per-head safeguard.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference"
(arXiv:2407.11550), code FFY0/AdaKV; kvpress ``AdaKVPress``. Wraps any method with ``prefill_scores``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.errors import ConfigError
from kvbench.methods.base import PrefillContext, check_choice, host_ints, keep_entries
from kvbench.methods.scorer_wrapper import ScorerWrapper

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: ``evict``: evicted entries leave memory; heads keep different numbers, so the layer is as long as its longest head
#: and shorter heads hold empty slots (allocated, counted in resident bytes); ``kvpress_mask``: kvpress's reading,
#: nothing leaves memory, evicted entries are masked out of attention (resident bytes stay those of the whole prompt)
LAYOUTS = ("evict", "kvpress_mask")


def adakv_keep(scores: torch.Tensor, capacity: int, alpha: float) -> torch.Tensor:
    """One row's kept entries ``(H, n)`` bool from scores ``(H, n)``: ``H * capacity`` entries of the layer, the top
    scores across all heads, after each head's top ``n_safe = int(capacity * alpha)`` (at least 1 when alpha > 0)
    were made unbeatable (kvpress ``AdaKVPress``: the safeguard)."""
    h, n = scores.shape
    n_safe = int(capacity * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe)
    scores = scores.clone()
    if n_safe:
        safe = scores.topk(min(n_safe, n), dim=-1).indices
        scores.scatter_(-1, safe, torch.where(torch.gather(scores, -1, safe) > float("-inf"), float("inf"),
                                              float("-inf")))
    top = scores.reshape(-1).topk(min(h * capacity, h * n)).indices
    kept = torch.zeros(h * n, dtype=torch.bool, device=scores.device)
    kept[top] = True
    return kept.view(h, n) & (scores > float("-inf"))


@dataclass
class AdaKV(ScorerWrapper):
    """Prefill-only: per layer, ``heads x budget`` entries chosen over the scorer's scores of all heads together
    (heads get different budgets), every head keeping at least its top ``alpha_safeguard x budget`` (the paper's
    safeguard, alpha 0.2 as AdaKV and kvpress). The scorer's must-keep entries (+inf: SnapKV's window, sinks) stay.

    Memory (``layout="evict"``, default): evicted entries leave memory, but the cache is a ``(B, H, n, D)`` tensor, so
    the layer is as long as its longest head; the other heads' empty slots are allocated and counted in resident bytes
    (``sample_stats`` records, per layer, the entries kept and the slots allocated). kvbench has no ragged per-head
    layout (AdaKV's own code flattens heads for FlashAttention's varlen kernel), so AdaKV's resident bytes are above the
    budget's whenever heads differ. ``layout="kvpress_mask"``: kvpress's reading (nothing freed, evicted entries
    masked out of attention); never the default.
    """

    name: ClassVar[str] = "adakv"
    alpha_safeguard: float = 0.2
    layout: str = "evict"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha_safeguard <= 1:
            raise ConfigError(f"method 'adakv': alpha_safeguard={self.alpha_safeguard} must be in [0, 1]")
        check_choice("adakv", "layout", self.layout, LAYOUTS)
        self._stats: dict[int, tuple[list[int], list[int]]] = {}  # layer -> (kept, allocated) entries per row

    def expected_compression(self, budget, prompt_len: int, num_layers: int) -> str:
        kind = super().expected_compression(budget, prompt_len, num_layers)
        return "attention" if kind != "none" and self.layout == "kvpress_mask" else kind

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if bool((ctx.prompt_lens <= ctx.capacity).all()):
            return
        scores = self.scorer_scores(layer, ctx)
        kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        for row, cap in enumerate(host_ints(layer, ctx.capacity)):  # each row on its own tokens, as it would be alone
            where = slice(None) if ctx.key_valid is None else ctx.key_valid[row]
            kept[row][:, where] = adakv_keep(scores[row][:, where], cap, self.alpha_safeguard)
        if layer.valid is not None:
            kept = kept & layer.valid
        if self.layout == "kvpress_mask":
            layer.set_valid(kept)
        else:
            keep_entries(layer, kept)
        per_head = kept.sum(-1)  # (B, H)
        self._stats[ctx.layer_idx] = ([int(x) for x in per_head.sum(-1).tolist()],
                                      [layer.num_entries * kept.shape[1]] * kept.shape[0])

    def sample_stats(self, row: int) -> dict:
        layers = sorted(self._stats)
        return {"adakv_kept_entries": [self._stats[i][0][row] for i in layers],
                "adakv_allocated_entries": [self._stats[i][1][row] for i in layers]}
