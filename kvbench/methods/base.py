"""The method contract.

A method is a small dataclass whose fields are its hyperparameters (paper defaults). The engine calls it at up to
three points, one layer at a time (plus one call across layers after prefill) and never with a model class in sight:

* ``prefill(layer, ctx)`` once per layer at the end of the prompt forward pass (select / evict / merge /
  allocate), after the layer's attention output was computed with the full prompt; then
  ``finish_prefill(layers, ctx)`` once with every layer, for decisions across layers (D2O, DynamicKV);
* ``decode(layer, ctx)`` after every decode step's attention (H2O/D2O eviction, merging);
* ``select(layer, ctx)`` before a decode step's attention, to restrict what is *attended* without evicting
  (OmniKV, Quest): returns entry indices or None;
* ``prefill_attend(layer, ctx)`` before ``prefill``, for methods whose prompt attention is not full causal
  attention (LM-Infinite's Λ mask): returns the layer's output ``(B, n, Hq, D)`` or None for the backend's;
* ``attend(layer, ctx)`` before ``select``, for methods that define their own decode attention (POD's shared
  distant scores, Quest/InfLLM's block retrieval): returns the layer's attention output ``(B, q, Hq, D)`` or None
  for the engine's attention. When it returns a tensor, ``select`` and the engine's attention are skipped and
  ``decode`` follows with ``ctx.probs`` as the method left it (None unless it set them);
* ``observe_logits(layers, input_ids, logits)`` after every forward of the model (the prompt, then each decode step),
  before the next one, only for methods that set ``needs_logits`` (SirLLM scores tokens by their surprisal under the
  model): ``logits`` gives the model's log-probabilities of chosen tokens (``engine.session.TokenLogits``).

Methods change the cache only through ``KVLayer.gather`` / ``KVLayer.evict_one`` (real eviction) or by assigning
new tensors (merging), so resident memory is what the method keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer
    from kvbench.engine.session import TokenLogits


@dataclass
class PrefillContext:
    """What a method sees for one layer at the end of prefill.

    queries: ``(B, Hq, n, D)`` post-RoPE queries of the prompt.
    key_valid: ``(B, n)`` False at left padding, or None.
    prompt_lens: ``(B,)`` real prompt length per row (n minus padding).
    capacity: ``(B,)`` tokens per layer the budget allows for each row (average over layers).
    """

    layer_idx: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    scaling: float
    queries: torch.Tensor
    key_valid: torch.Tensor | None
    prompt_lens: torch.Tensor
    capacity: torch.Tensor
    #: ``(D/2,)`` RoPE inverse frequencies when keys can be re-rotated (``engine.session.rotate_keys``), else None
    rope_inv_freq: torch.Tensor | None = None
    #: True when the model's prompt attention is plain causal softmax attention (no sliding window reaching into the
    #: prompt, no logit soft-capping), so a method may compute it itself (``attend_with_column_sums``)
    plain_causal: bool = False
    #: ``(B, Hq, n)`` column sums of the prompt attention, when ``prefill_attend`` computed them with the output
    column_sums: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.queries.shape[-2]


@dataclass
class DecodeContext:
    """What a method sees for one layer after a decode step.

    query: ``(B, Hq, q, D)``; probs: ``(B, Hkv, g, q, entries)`` attention probabilities over the layer's entries
    (only when the method sets ``needs_decode_probs``; else None); capacity: as in PrefillContext; scaling: the
    model's softmax scale (None: ``D ** -0.5``).
    """

    layer_idx: int
    num_layers: int
    num_kv_heads: int
    query: torch.Tensor
    probs: torch.Tensor | None
    capacity: torch.Tensor
    scaling: float | None = None
    rope_inv_freq: torch.Tensor | None = None
    #: entries the step attended per (row, head), set by a method's ``attend`` when they are not the layer's own
    #: entries (OmniKV's context bank); None: the engine counts them
    attended: int | None = None


@dataclass
class Method:
    """Base class; on its own it is FullKV (keeps everything)."""

    name: ClassVar[str] = "base"
    #: prefill-only methods never evict during decoding; generated tokens are appended
    needs_decode_probs: ClassVar[bool] = False
    #: a method whose paper defines it per sequence sets this to refuse batch > 1
    supports_batching: ClassVar[bool] = True
    #: the method needs trained or adapted weights (CLA, LoCoCo): its ``validate`` refuses with a NotAvailableError
    #: naming the paper and what to provide, unless the user declares an adapted checkpoint
    requires_training: ClassVar[bool] = False
    #: the method only makes sense on a CUDA device (Brutal Offload's host<->GPU transfers); ``plan_job`` refuses
    #: before the model loads when the model would run elsewhere
    requires_cuda: ClassVar[bool] = False
    #: a method that scores tokens by the model's predictions sets this: the session then calls ``observe_logits``
    needs_logits: ClassVar[bool] = False

    def validate(self, budget: Budget) -> None:
        """Reject a budget or hyperparameters before any model loads (raise ConfigError naming the value)."""
        if budget.kind == "tokens" and budget.value < self.min_budget_tokens():
            raise ConfigError(
                f"budget={budget.label()} is below the minimum {self.min_budget_tokens()} tokens per layer of "
                f"method {self.name!r} ({self.min_budget_reason()})"
            )

    def min_budget_tokens(self) -> int:
        return 1

    def min_budget_reason(self) -> str:
        return "at least one token"

    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        """The layer's prompt attention output ``(B, n, Hq, D)`` when the method restricts prefill attention itself
        (LM-Infinite's Λ mask, CaM's start+recent mask), or None (default) for the backend's full causal attention.
        ``layer`` holds the whole prompt's post-RoPE keys/values; called before ``prefill``."""
        return None

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        """Compress ``layer`` at the end of prefill (default: keep everything)."""

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        """Called once after the last layer's ``prefill`` with every layer, for decisions that need all layers
        (D2O's per-layer allocation, DynamicKV's final re-allocation). ``ctx`` is the last layer's context."""

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        """Act after a decode step (default: nothing; the new token stays)."""

    def select(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        """Entries to attend at this decode step ``(B, H, k)``, or None for all."""
        return None

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        """The layer's decode attention output ``(B, q, Hq, D)`` computed by the method itself, or None (default)
        for the engine's attention. Called after the step's key/value were appended to ``layer``."""
        return None

    def observe_logits(self, layers: list[KVLayer], input_ids: torch.Tensor, logits: TokenLogits) -> None:
        """After every forward (prompt or decode step) when ``needs_logits`` is set; default: nothing.

        ``layers``: every layer's cache, the forward's tokens already appended; ``input_ids`` ``(B, q)``: the
        forward's tokens; ``logits.gather(ids)`` ``(B, q)``: log-probability of ``ids[:, i]`` under the prediction
        made at position i; ``logits.previous`` ``(B, V)``: the previous forward's last prediction (the one that
        scored ``input_ids[:, 0]``), None after a prompt. The method may evict here (``keep_top``); the session
        measures the prompt's resident bytes after this call.
        """

    def budget_label(self, budget: Budget) -> str | None:
        """How results of this method are filed and keyed; None: the budget's own label. A method whose memory is
        set by its own fields rather than the budget (POD's window) returns a label of those."""
        return None

    def describe(self) -> dict:
        """Hyperparameters as data (stored in meta.json)."""
        from dataclasses import asdict

        return {"name": self.name, **asdict(self)}

    def sample_stats(self, row: int) -> dict:
        """Per-layer decisions of the last prefill for batch row ``row`` as JSON data (lists of numbers), stored in
        that sample's record under ``method_stats`` for the report's figures (D2O's layer variances, DynamicKV's and
        D2O's allocations, KVMerger's per-layer ratios). Default: nothing."""
        return {}


def check_positive(method: str, **fields: float) -> None:
    for key, value in fields.items():
        if value is None or value <= 0:
            raise ConfigError(f"method {method!r}: {key}={value!r} must be > 0")


def check_choice(method: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"method {method!r}: {key}={value!r} is not valid; valid: {', '.join(choices)}")


def keep_top(layer: KVLayer, scores: torch.Tensor, keep: torch.Tensor | Sequence[int]) -> None:
    """Keep, per (row, head), the ``keep[row]`` entries with the highest ``scores``; evict the rest.

    scores: ``(B, H, entries)``; entries that must stay get ``+inf``, entries that must go (padding) ``-inf``.
    keep: ``(B,)`` number of entries per row (a tensor or Python ints). Rows keeping fewer than the maximum get empty
    (invalid) slots. Nothing happens when every row already fits. On an unpadded cache the checks run on Python ints
    (``KVLayer.capacity_list``), so a decode step's single eviction never makes the host wait for the GPU.
    """
    if layer.valid is None:  # every (row, head) holds num_entries
        overflow = unpadded_overflow(layer, keep)
        if overflow == 0:
            return
        if overflow == 1:  # one eviction per decode step
            layer.evict_one(scores.argmin(-1))
            return
        caps = host_ints(layer, keep)
        k = max(caps)
        keep = torch.as_tensor(caps, device=scores.device)
    else:
        keep = torch.as_tensor(keep, device=scores.device)
        if bool((layer.valid_counts() <= keep.view(-1, 1)).all()):
            return
        scores = scores.masked_fill(~layer.valid, float("-inf"))
        k = int(keep.max())
    index = torch.topk(scores, k, dim=-1, sorted=True).indices
    slots = torch.arange(k, device=scores.device).view(1, 1, k)
    keep_valid = slots < keep.view(-1, 1, 1)
    chosen = torch.gather(scores, -1, index)
    keep_valid = keep_valid & (chosen > float("-inf"))
    layer.gather(index, None if bool(keep_valid.all()) else keep_valid)


def unpadded_overflow(layer: KVLayer, keep: torch.Tensor | Sequence[int]) -> int | None:
    """On an unpadded cache, the entries every row must lose to fit ``keep`` when that number is the same for all rows
    (0: every row fits; 1: a decode step's single eviction), from host ints only; None otherwise (padded cache, or
    rows that differ): the caller's general path."""
    if layer.valid is not None:
        return None
    n = layer.num_entries
    overflow = {max(0, n - c) for c in host_ints(layer, keep)}
    return overflow.pop() if len(overflow) == 1 else None


def host_ints(layer: KVLayer, keep: torch.Tensor | Sequence[int]) -> list[int]:
    """``keep`` as Python ints: the layer's cached capacity when ``keep`` is it, else one device read."""
    if isinstance(keep, torch.Tensor):
        return layer.capacity_list() if keep is layer.capacity else [int(c) for c in keep.tolist()]
    return [int(c) for c in keep]


def attend_with_column_sums(layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
    """``prefill_attend`` of methods that score tokens by H2O's column sums: one chunked attention pass gives the
    layer's output and the sums (kept in ``ctx.column_sums``) instead of the backend's attention plus a second pass
    (issue #7's prefill overhead). Only for unpadded batches of plain causal attention; else None (the backend)."""
    from kvbench.engine.scores import attention_and_column_sums

    if ctx.key_valid is not None or not ctx.plain_causal or layer.keys.shape[1] != ctx.num_kv_heads:
        return None
    out, ctx.column_sums = attention_and_column_sums(ctx.queries, layer.keys, layer.values, ctx.scaling)
    return out


def prompt_column_sums(layer: KVLayer, ctx: PrefillContext, chunk: int) -> torch.Tensor:
    """``(B, Hq, n)`` column sums of the prompt attention: those ``attend_with_column_sums`` kept, else computed."""
    from kvbench.engine.scores import column_sums

    if ctx.column_sums is not None:
        return ctx.column_sums
    return column_sums(ctx.queries, layer.keys, ctx.scaling, ctx.key_valid, chunk=chunk)


def real_rank(layer: KVLayer) -> torch.Tensor:
    """Rank of each entry among the valid entries of its (row, head) in position order: ``(B, H, entries)``.

    Entries are always stored in position order (appends are newer; gathers sort), so without invalid entries the
    rank is the index.
    """
    if layer.valid is None:
        return torch.arange(layer.num_entries, device=layer.positions.device).expand(*layer.positions.shape)
    valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
    order = torch.argsort(layer.positions, dim=-1)
    sorted_valid = torch.gather(valid, -1, order).long()
    ranks_sorted = sorted_valid.cumsum(-1) - 1
    rank = torch.empty_like(ranks_sorted)
    rank.scatter_(-1, order, ranks_sorted)
    return rank.masked_fill(~valid, -1)
