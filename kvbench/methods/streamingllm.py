"""StreamingLLM: attention sinks + a recent window.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024, arXiv:2309.17453),
code mit-han-lab/streaming-llm. reference/methods.md B2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.errors import ConfigError
from kvbench.methods.base import (
    GRANULARITY,
    DecodeContext,
    Method,
    PrefillContext,
    check_choice,
    check_positive,
    keep_top,
    real_rank,
    to_query_heads,
    unpadded_overflow,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

VARIANTS = ("paper", "kvfactory")


@dataclass
class StreamingLLM(Method):
    """Keep the first ``sink_size`` tokens and the most recent ones, ``budget`` tokens per layer and KV head.

    Variants:
      * ``paper`` (default): ``sink_size`` sinks + ``budget - sink_size`` recent tokens, and the middle is evicted
        again at every decode step so the cache stays at ``budget`` (``evict_for_space``). The original code also
        re-assigns positions inside the cache (pos-shift): run with ``position_mode=compact`` for that; the
        default keeps original positions.
      * ``kvfactory``: KVCache-Factory's prefill-only ``StreamingLLMKVCluster`` (DynamicKV Table 1 / D2O Table 21):
        keep the first ``budget - window`` tokens and the last ``window``; generated tokens are appended, no
        eviction. The window is a setting of its LongBench script: 32 until 2024-07-10 (``window=32``, the default),
        ``budget - 4`` since (``window=null``: ``budget - sink_size`` recent tokens after ``sink_size`` sinks);
        docs/baseline_readings.md says which table ran which.

    ``granularity="query_head"`` repeats K/V to the query heads first (KVCache-Factory's default mode): the kept
    positions are the same, the cache and its resident bytes ``Hq / Hkv`` times larger.
    Shapes: scores are ``(batch, heads, entries)``; no attention statistics are needed.
    """

    name: ClassVar[str] = "streamingllm"
    compression: ClassVar[str] = "prefill"
    sink_size: int = 4
    window: int | None = 32
    variant: str = "paper"
    granularity: str = "kv_head"

    def __post_init__(self) -> None:
        check_positive(self.name, sink_size=self.sink_size)
        if self.window is not None:
            check_positive(self.name, window=self.window)
        elif self.variant != "kvfactory":
            raise ConfigError("method 'streamingllm': window=null (budget - sink_size recent tokens) is a setting of "
                              "variant=kvfactory")
        check_choice(self.name, "variant", self.variant, VARIANTS)
        check_choice(self.name, "granularity", self.granularity, GRANULARITY)

    def min_budget_tokens(self) -> int:
        return (self.sink_size if self.variant == "paper" or self.window is None else self.window) + 1

    def min_budget_reason(self) -> str:
        if self.variant == "paper" or self.window is None:
            return f"sink_size={self.sink_size} sinks + at least one recent token"
        return f"window={self.window} recent tokens + at least one leading token"

    def _keep_scores(self, layer: KVLayer, capacity: torch.Tensor) -> torch.Tensor:
        """+inf for entries to keep, -inf for the rest (rank among the row's real tokens decides)."""
        rank = real_rank(layer)
        count = layer.valid_counts().unsqueeze(-1)
        cap = capacity.view(-1, 1, 1)
        head = self.sink_size if self.variant == "paper" or self.window is None else cap - self.window
        recent = cap - head
        keep = ((rank >= 0) & (rank < head)) | (rank >= count - recent)
        return torch.where(keep, float("inf"), float("-inf"))

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        to_query_heads(layer, ctx, self.granularity)
        keep_top(layer, self._keep_scores(layer, ctx.capacity), ctx.capacity)

    def static_policy(self, capacity: int, layer_idx: int = 0):
        from kvbench.engine.static import StaticPolicy, evict_oldest

        return StaticPolicy(evict=evict_oldest, params=(self.sink_size,)) if self.variant == "paper" else StaticPolicy()

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        if self.variant != "paper":
            return
        if unpadded_overflow(layer, ctx.capacity) == 1:
            layer.evict_at(self.sink_size)  # the usual step: the oldest token after the sinks leaves (rank = index)
            return
        keep_top(layer, self._keep_scores(layer, ctx.capacity), ctx.capacity)
