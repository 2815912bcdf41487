"""Cache operations shared by the methods: keep the top-scored entries of a layer (real eviction), count what must
go on an unpadded cache from host integers, rank entries among the valid ones, the prompt attention's column sums
(computed with the attention output in one pass where the prompt attention is plain causal attention), and the
``granularity`` choices with the repeat of a layer's KV heads to the query heads they imply.

The method contract (``methods.base``) re-exports these, so a method imports everything it needs from one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvbench.methods.contexts import PrefillContext

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


def keep_top(layer: KVLayer, scores: torch.Tensor, keep: torch.Tensor | Sequence[int],
             window: int | Sequence[int] = 0) -> None:
    """Keep, per (row, head), the ``keep[row]`` entries with the highest ``scores``; evict the rest.

    scores: ``(B, H, entries)``; entries that must stay get ``+inf``, entries that must go (padding) ``-inf``.
    keep: ``(B,)`` number of entries per row (a tensor or Python ints). Rows keeping fewer than the maximum get empty
    (invalid) slots. Nothing happens when every row already fits. On an unpadded cache the checks run on Python ints
    (``KVLayer.capacity_list``), so a decode step's single eviction never makes the host wait for the GPU.

    window: an int or one per row. The row's ``window`` newest valid entries are kept whatever their scores and the
    others are the top ``keep - window`` of the older entries alone, chosen by ``torch.topk`` over exactly those
    entries: KVCache-Factory's selection (``topk(C - w)`` over the past, then the window appended), so that ties
    (max-pooling makes many) break as the reference's ``torch.topk`` breaks them. Kept entries are stored in position
    order, not in the reference's score order (attention does not depend on the order).

    A row's choice never depends on the other rows of the batch: on a padded cache (or rows keeping different numbers)
    each row is selected on its own valid entries, exactly as it would be alone (same ``topk`` or ``argmin`` over the
    same values), so left padding never changes which tied entry stays.
    """
    b = scores.shape[0]
    windows = [int(window)] * b if isinstance(window, int) else [int(w) for w in window]
    if layer.valid is None:  # every (row, head) holds num_entries
        overflow = unpadded_overflow(layer, keep)
        if overflow == 0:
            return
        if overflow == 1 and not any(windows):  # one eviction per decode step
            layer.evict_one(scores.argmin(-1))
            return
        caps = host_ints(layer, keep)
        if len(set(caps)) == 1 and len(set(windows)) == 1:  # every row alike: one topk for the batch
            index, chosen = _top(scores, caps[0], windows[0])
            layer.gather(index, chosen)  # set_valid reads whether all were chosen (in a prefill: with every layer's)
            return
    else:
        caps = host_ints(layer, keep)
        if bool((layer.valid_counts() <= torch.as_tensor(caps, device=scores.device).view(-1, 1)).all()):
            return
    _keep_top_per_row(layer, scores, caps, windows)


def _top(scores: torch.Tensor, k: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``scores`` ``(..., m)`` with the last ``window`` entries always kept: entry indices
    ``(..., k)`` and whether each is a real choice (not a ``-inf`` entry taken to fill ``k``)."""
    m = scores.shape[-1]
    window = min(window, k, m)
    past = scores[..., : m - window]
    top = torch.topk(past, min(k - window, m - window), dim=-1, sorted=True).indices
    chosen = torch.gather(past, -1, top) > float("-inf")
    if window:
        newest = torch.arange(m - window, m, device=scores.device).expand(*scores.shape[:-1], window)
        top = torch.cat([top, newest], dim=-1)
        chosen = torch.cat([chosen, torch.ones_like(newest, dtype=torch.bool)], dim=-1)
    return top, chosen


def _keep_top_per_row(layer: KVLayer, scores: torch.Tensor, caps: list[int], windows: list[int]) -> None:
    """``keep_top`` row by row: each row's valid entries (in stored order) selected as if the row were alone."""
    b, h, n = scores.shape
    valid = layer.valid if layer.valid is not None else torch.ones(b, h, n, dtype=torch.bool, device=scores.device)
    counts = valid.sum(-1).tolist()
    kept = torch.zeros(b, h, n, dtype=torch.bool, device=scores.device)
    for row in range(b):
        by_count: dict[int, list[int]] = {}
        for head, count in enumerate(counts[row]):
            by_count.setdefault(int(count), []).append(head)
        for m, heads in by_count.items():
            hidx = torch.tensor(heads, device=scores.device)
            # the valid entries first, in stored (= position) order: the row's cache as it would be alone
            entries = torch.sort((~valid[row, hidx]).to(torch.uint8), dim=-1, stable=True).indices[:, :m]
            own = torch.gather(scores[row, hidx], -1, entries)  # (heads, m)
            k = caps[row]
            if m <= k:
                choice = torch.ones_like(own, dtype=torch.bool)
            elif m - k == 1 and not windows[row]:  # alone this is keep_top's single eviction (argmin)
                choice = torch.ones_like(own, dtype=torch.bool)
                choice.scatter_(-1, own.argmin(-1, keepdim=True), False)
            else:
                top, chosen = _top(own, k, windows[row])
                choice = torch.zeros_like(own, dtype=torch.bool).scatter_(-1, top, chosen)
            kept[row, hidx] = torch.zeros(len(heads), n, dtype=torch.bool, device=scores.device).scatter_(
                -1, entries, choice)
    keep_entries(layer, kept)


def keep_entries(layer: KVLayer, kept: torch.Tensor, slots: int | None = None,
                 counts: Sequence[int] | None = None) -> None:
    """Keep the entries ``kept`` ``(B, H, entries)`` marks (a selection made elsewhere: block-wise, chunk-wise,
    head-wise budgets), evicting the rest. The cache becomes ``slots`` entries long (default: the most any (row, head)
    keeps, one device read; a caller that knows no head keeps more, its budget, passes it); a (row, head) keeping
    fewer gets empty (invalid) slots, which are allocated and count in resident bytes. ``counts``: the entries every
    head of each row keeps, when the caller knows them as host ints (no read; ``slots`` is then their maximum)."""
    least = None  # the fewest entries a (row, head) keeps, when known
    if counts is not None:
        k, least = max(counts), min(counts)
    elif slots is None:  # the longest and the shortest (row, head) in one read: every slot is filled if they agree
        per_head = kept.sum(-1)
        k, least = torch.stack([per_head.max(), per_head.min()]).tolist()
    else:
        k = min(slots, kept.shape[-1])
    # kept entries first (stable: in stored order), then other entries as empty slots of rows keeping fewer
    index = torch.sort(kept.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :k]
    if least is not None and least >= k:
        layer.gather(index)
    else:  # counted with an empty slot (no read of the new mask), or set_valid reads it (in a prefill: with all)
        layer.gather(index, torch.gather(kept, -1, index), partial=least is not None)


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
    out, ctx.column_sums = attention_and_column_sums(ctx.queries, layer.keys, layer.values, ctx.scaling,
                                                     few_kernels=ctx.few_kernels)
    return out


def prompt_column_sums(layer: KVLayer, ctx: PrefillContext, chunk: int) -> torch.Tensor:
    """``(B, Hq, n)`` column sums of the prompt attention: those ``attend_with_column_sums`` kept, else computed."""
    from kvbench.engine.scores import column_sums

    if ctx.column_sums is not None:
        return ctx.column_sums
    return column_sums(ctx.queries, layer.keys, ctx.scaling, ctx.key_valid, chunk=chunk)


#: ``kv_head``: one kept set per KV head (DESIGN principle 3); ``query_head``: K/V repeated to the query heads before
#: selection, one kept set per query head (KVCache-Factory's default and, in 2024, only mode; caches g x larger). The
#: choices of every method's ``granularity`` field (SnapKV, PyramidKV, H2O, CaM, StreamingLLM through
#: ``to_query_heads``; D2O and DynamicKV through ``expand_to_query_heads``, their official codes' ``repeat_kv``)
GRANULARITY = ("kv_head", "query_head")


def to_query_heads(layer: KVLayer, ctx: PrefillContext, granularity: str) -> None:
    """``granularity="query_head"``: repeat the layer's KV heads to the query heads (``KVLayer.repeat_heads``) before
    anything is scored or selected, as KVCache-Factory's ``repeat_kv`` before ``update_kv``; the cache stays so."""
    if granularity == "query_head" and ctx.num_heads > layer.keys.shape[1]:
        layer.repeat_heads(ctx.num_heads // layer.keys.shape[1])


def expand_to_query_heads(layer: KVLayer, group: int) -> None:
    """The official codes' ``repeat_kv`` into the cache (DynamicKV, D2O): ``(B, Hkv, n, D)`` -> ``(B, Hq, n, D)``, query
    head h on KV head h // group, with positions, validity and per-entry state. Later appends repeat the new KV heads
    the same way (``KVLayer.update``). Resident bytes grow by the group size: the code's layout, really held."""
    for name in ("keys", "values", "positions", "valid"):
        if getattr(layer, name) is not None:
            setattr(layer, name, getattr(layer, name).repeat_interleave(group, dim=1))
    layer.state = {k: v.repeat_interleave(group, dim=1) for k, v in layer.state.items()}


def position_rank(positions: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots in position order, the valid ones first (``order`` ``(..., C)``), and each slot's index in that order
    (``rank``: a valid slot's rank among the valid ones by position; an invalid slot's is at least their count): the
    order of a captured step's slots, which an evicted slot's reuse leaves unordered."""
    order = torch.argsort(positions.masked_fill(~valid, torch.iinfo(positions.dtype).max), dim=-1)
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return order, torch.empty_like(order).scatter_(-1, order, ranks)


def top_k_mask(scores: torch.Tensor, k: torch.Tensor, stable: bool = False) -> torch.Tensor:
    """A mask of the ``k`` highest ``scores`` along the last dimension, ``k`` a device count broadcasting against
    ``scores``' leading dimensions (a sort and each entry's rank, no ``topk`` of a constant k); ``stable``: ties to
    the lower index (else the sort's own order)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=stable).indices
    ranks = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks) < k


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
