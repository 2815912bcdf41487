"""Local window: only the most recent tokens, no sinks.

The "Local Window" baseline of D2O (paper 000, Tables 1, 2 and 17; reference/methods.md B8): keep the ρ·n most recent
tokens of every layer and slide the window during decoding. POD's "WA" (window attention without sinks) is the same
mechanism at a fixed 4K window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.methods.base import DecodeContext, Method, PrefillContext, keep_top, real_rank

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


@dataclass
class LocalWindow(Method):
    """Keep the ``budget`` most recent tokens per layer and KV head; evict the oldest one at every decode step.

    ``budget`` is tokens per layer (``budget=128``) or a ratio of the prompt (``budget=0.2``: D2O's ρ·n). Recency is
    the rank among a row's real tokens (left padding never counts), so a batch of different prompt lengths keeps the
    same number of real tokens per row. No attention statistics are needed; the cache holds exactly the budget after
    prefill and after every decode step.
    """

    name: ClassVar[str] = "local"
    compression: ClassVar[str] = "prefill"

    @staticmethod
    def _keep_scores(layer: KVLayer, capacity: torch.Tensor) -> torch.Tensor:
        """+inf for the ``capacity`` newest real entries of each row, -inf for the rest ``(B, H, entries)``."""
        rank = real_rank(layer)
        recent = rank >= layer.valid_counts().unsqueeze(-1) - capacity.view(-1, 1, 1)
        return torch.where(recent & (rank >= 0), float("inf"), float("-inf"))

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        keep_top(layer, self._keep_scores(layer, ctx.capacity), ctx.capacity)

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        keep_top(layer, self._keep_scores(layer, ctx.capacity), ctx.capacity)

    def static_policy(self, capacity: int, layer_idx: int = 0):
        from kvbench.engine.static import StaticPolicy, evict_oldest

        return StaticPolicy(evict=evict_oldest)  # the window: the oldest entry leaves
