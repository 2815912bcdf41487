"""The scorer base: a method that ranks a layer's prompt entries implements ``score`` and inherits everything else.

kvpress's ``ScorerPress`` is the model: its presses implement ``score(...)`` and inherit the top-k selection. Here the
base (``ScorerMethod``) gives, around the subclass's ``score``:

* granularity: a subclass with a ``granularity`` field (choices ``cache_ops.GRANULARITY``, checked in
  ``__post_init__``) has the layer's KV heads repeated to the query heads before anything is scored
  (``to_query_heads``, KVCache-Factory's ``query_head`` mode);
* GQA aggregation: ``score`` may return one row per query head ``(B, Hq, n)`` on a layer of ``Hkv`` heads; the base
  reduces each KV group (``group_aggregation()``, the mean by default, as kvpress's presses average a group);
* the observation window: ``observation_window()`` newest entries (default 0) are always kept and the others are the
  top ``capacity - window`` of the older entries alone (``keep_top(..., window=)``, KVCache-Factory's ``topk`` over
  the past then the window appended); a prompt no longer than the window is all window (kept);
* the compression check: a prompt that fits every row's budget (``ctx.fits()``) is left whole; a finite budget needs
  ``observation_window() + 1`` tokens per layer (``min_budget_tokens``);
* the per-layer budget: ``layer_capacity(ctx)`` (default the budget, the same in every layer; PyramidKV's pyramid);
* the scoring interface the wrappers select through (``prefill_scores``: AdaKV across heads, ChunkKV across chunks),
  the same scores ``prefill`` selects with;
* compression during decode (``decode_compression``, kvpress's ``DecodingPress``; ``methods.decode_compression``):
  every ``interval`` decode steps the engine calls ``compress_decoded``, which is ``prefill`` over every entry the
  layer holds with the buffered recent queries as ``ctx.queries``: the same score and the same ``keep_top``.

A method whose prefill does more than "score, then keep the top" (H2O keeps its accumulated attention for decoding;
CaM merges the evicted values; KeyDiff's block mode scores blocks in sequence) overrides ``prefill`` or stays on
``Method``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.errors import ConfigError
from kvbench.methods.base import GRANULARITY, Method, PrefillContext, check_choice, keep_top, to_query_heads
from kvbench.methods.decode_compression import (
    DecodeCompression,
    check_decode_compression,
    parse_decode_compression,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.budget import Budget
    from kvbench.engine.cache import KVLayer


@dataclass
class ScorerMethod(Method):
    """Prefill-only selection by a per-entry score: per (row, head) keep the ``layer_capacity`` entries with the highest
    ``score`` (the ``observation_window()`` newest always), kept entries in position order, each row of a batch on its
    own tokens as alone (``keep_top``).

    A subclass implements ``score(layer, ctx)``:

    * ``layer``: the layer's cache, ``layer.keys`` / ``layer.values`` ``(B, H, n, D)`` post-RoPE, H the layer's heads
      (the KV heads, or the query heads after ``granularity="query_head"``); ``ctx``: the ``PrefillContext``
      (``ctx.queries`` ``(B, Hq, n, D)`` post-RoPE, ``ctx.key_valid`` ``(B, n)`` False at left padding or None);
    * returns float scores ``(B, H, n)``, or ``(B, Hq, n)`` per query head (reduced over each KV group by the base):
      higher is kept first, ``+inf`` an entry that must stay (sinks, a token the method protects), ``-inf`` padding.
    """

    name: ClassVar[str] = "scorer"
    compression: ClassVar[str] = "prefill"
    #: compression during decode (``methods.decode_compression``): None or a mapping with ``interval`` (null: off),
    #: ``target_size``, ``compression_ratio``, ``query_buffer``; left out of ``describe()`` when off
    decode_compression: dict[str, Any] | None = None
    #: why ``decode_compression`` is refused for this scorer (None: its score takes buffered decode queries)
    decode_refusal: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.score is ScorerMethod.score:  # at import, not at the first prompt
            raise TypeError(f"{cls.__name__} derives from ScorerMethod but does not implement score(layer, ctx)")

    def __post_init__(self) -> None:
        if hasattr(self, "granularity"):
            check_choice(self.name, "granularity", self.granularity, GRANULARITY)
        self.decode_compression_spec()  # its one-line errors at build time

    def decode_compression_spec(self) -> DecodeCompression | None:
        return parse_decode_compression(self.name, self.decode_compression)

    def validate(self, budget: Budget) -> None:
        super().validate(budget)
        spec = self.decode_compression_spec()
        if spec is not None and self.decode_refusal is not None:
            raise ConfigError(f"method {self.name!r} has no compression during decode: {self.decode_refusal}; use "
                              "decode_compression.interval=null")
        if spec is not None and not self.scores_available():
            raise ConfigError(f"method {self.name!r} (with these fields) exposes no per-entry scores: it has no "
                              "compression during decode; use decode_compression.interval=null")
        check_decode_compression(self, spec, budget, self.observation_window(), self.min_budget_tokens())
        self.check_decode_queries(spec)

    def check_decode_queries(self, spec: DecodeCompression | None) -> None:
        """A ConfigError in one line when a compression during decode (``spec``) would score with too few buffered
        queries for this score (beyond the observation window, which ``check_decode_compression`` checks); a wrapper
        calls its scorer's with its own ``decode_compression``."""

    def compress_decoded(self, layer: KVLayer, ctx: PrefillContext) -> None:
        self.prefill(layer, ctx)

    def score(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """Per-entry scores ``(B, H, n)`` or ``(B, Hq, n)`` of the layer's prompt (see the class docstring)."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    def observation_window(self) -> int:
        """The newest entries every row keeps whatever their scores (SnapKV's window); 0: the score alone decides."""
        return 0

    def group_aggregation(self) -> str:
        """How per-query-head scores become one score per KV head (``engine.scores.aggregate_group``)."""
        return "mean"

    def layer_capacity(self, ctx: PrefillContext) -> torch.Tensor | list[int]:
        """Entries this layer keeps per row (window included): a ``(B,)`` tensor or Python ints (a tensor other than
        the layer's ``capacity``, whose ints the session gave, costs ``keep_top`` a device read). Default: the budget,
        the same in every layer."""
        return ctx.capacity

    def min_budget_tokens(self) -> int:
        return self.observation_window() + 1

    def min_budget_reason(self) -> str:
        window = self.observation_window()
        if window:
            return f"the observation window of {window} tokens is part of the budget"
        return super().min_budget_reason()

    def prefill_scores(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """``score`` of the layer's heads after ``granularity``, reduced to them when it scored per query head; a
        prompt no longer than the observation window is all window (+inf), padding -inf."""
        to_query_heads(layer, ctx, getattr(self, "granularity", "kv_head"))
        if ctx.n <= self.observation_window():
            scores = torch.full(layer.keys.shape[:3], float("inf"), device=layer.keys.device)
            return scores if ctx.key_valid is None else scores.masked_fill(~ctx.key_valid[:, None], float("-inf"))
        scores = self.score(layer, ctx)
        heads = layer.keys.shape[1]
        if scores.shape[1] != heads:  # one row per query head: reduce each KV group
            from kvbench.engine.scores import aggregate_group

            scores = aggregate_group(scores, heads, self.group_aggregation())
        return scores

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        to_query_heads(layer, ctx, getattr(self, "granularity", "kv_head"))
        window = self.observation_window()
        if ctx.n <= window or ctx.fits():
            return
        scores = self.prefill_scores(layer, ctx)
        keep_top(layer, scores, self.layer_capacity(ctx), window=window)
