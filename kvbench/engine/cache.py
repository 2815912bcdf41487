"""A cache layer that really shrinks: per-entry positions, validity and method state travel with the keys.

``KVLayer`` subclasses transformers' ``DynamicLayer`` (a public extension point) and stores, per layer:

* ``keys``/``values``: ``(batch, heads, entries, head_dim)`` with ``heads`` = the model's KV heads (GQA-native);
* ``positions``: ``(batch, heads, entries)`` int64, the original token position of each entry (post-RoPE keys keep
  their original rotation, so this is what the key "is");
* ``valid``: ``(batch, heads, entries)`` bool, or None when every entry is valid. False marks left padding and the
  empty slots of rows that keep fewer entries than others; such entries are never attended;
* ``state``: per-entry method state, e.g. H2O's accumulated attention ``(batch, heads, entries)``, gathered and
  evicted together with the keys; ``row_state``: per-row method state ``(batch, ...)``, e.g. D2O's EMA threshold;
* ``key_channels``: ``(batch, heads, kept)`` int64 ascending, or None: the key channels the layer keeps after a
  channel-pruning method (ThinK, ``prune_key_channels``). Keys are then ``(batch, heads, entries, kept)`` (values
  keep ``head_dim``), every later key is stored with the same channels, and attention gathers the queries to them
  (``gather_query``): q.k over the kept channels only.

**Ragged layers** (``to_ragged``, AdaKV's and KVzip's default): heads that keep different numbers of entries hold
exactly what they keep. The compressed prompt's entries of every (row, head) are stored flat in a ``RaggedEntries``
(``ragged``: keys ``(kept, head_dim)``, their positions, the kept count per (row, head)); ``keys``/``values``/
``positions``/``valid``/``state`` then hold only the entries appended since (decode tokens: one per head per step, so
a dense ``(batch, heads, appended, head_dim)`` tail that ``update`` extends as usual). Attention reads
``attention_view()``: a transient padded ``(batch, heads, longest + appended, head_dim)`` copy and its validity mask,
built per layer per step and dropped after it; ``resident_bytes`` counts the flat storage and the tail, i.e. the kept
entries. Operations that would edit entries in place (eviction, gathers, channel pruning, RoPE re-rotation) refuse a
ragged layer instead of editing only its tail; a sliding window's reach (``keep_after``) flattens it again.

``get_seq_length`` reports the *logical* number of tokens seen (as ``DynamicSlidingWindowLayer`` does), which is
what ``generate`` needs to slice inputs and number positions; the physical length is ``num_entries``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvbench.errors import NotAvailableError


@dataclass(frozen=True)
class RaggedEntries:
    """A layer's compressed prompt, flat per (row, head): entries of (row 0, head 0) first, each (row, head)'s in
    position order. Never edited after ``KVLayer.to_ragged`` builds it (a snapshot may share it)."""

    keys: torch.Tensor  # (kept, key_dim)
    values: torch.Tensor  # (kept, head_dim)
    positions: torch.Tensor  # (kept,) int64
    lengths: torch.Tensor  # (batch, heads) int64: entries of each (row, head)
    slots: torch.Tensor  # (kept,) int64: (row * heads + head) * width + rank, each entry's slot in a padded view
    width: int  # the longest (row, head)
    uniform: bool  # every (row, head) keeps ``width`` entries (the padded view has no empty slot)
    state: dict[str, torch.Tensor]  # per-entry method state, (kept,) each

    @property
    def kept(self) -> int:
        return self.keys.shape[0]

    def nbytes(self) -> int:
        """Bytes of K and V held (what ``KVLayer.resident_bytes`` counts for the dense layout too)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def padded_slots(self, appended: int) -> torch.Tensor:
        """Each entry's slot in a padded view ``(B * H * (width + appended))`` whose rows end with ``appended`` more."""
        if appended == 0:
            return self.slots
        return self.slots + torch.div(self.slots, self.width, rounding_mode="floor") * appended


class KVLayer(DynamicLayer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = 0
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.rope_pos: torch.Tensor | None = None  # position each key is currently rotated to (compact mode only)
        self.capacity = None  # (batch,) tokens this layer may keep per row (a tensor; see capacity_list)
        self.row_state: dict[str, torch.Tensor] = {}  # per-row method state, (batch, ...): e.g. D2O's EMA threshold
        self.key_channels: torch.Tensor | None = None  # (batch, heads, kept) key channels kept (ThinK), or None
        self.ragged: RaggedEntries | None = None  # the compressed prompt held flat per head (to_ragged), or None
        self.position_ordered = True  # entries stored in position order (gather(..., position_order=False) clears it)
        self.defer_valid_check = False  # set_valid stores a mask unread (the session, around a method's prefill)
        self.valid_unchecked = False  # valid may be all True: check_deferred_valid reads it with the other layers'

    # ---- transformers' layer API -------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized and self.keys.numel() and self.keys.shape[1] > key_states.shape[1]:
            # a query-head-granular cache (DynamicKV's official layout): repeat new KV heads as repeat_kv does
            rep = self.keys.shape[1] // key_states.shape[1]
            key_states = key_states.repeat_interleave(rep, dim=1)
            value_states = value_states.repeat_interleave(rep, dim=1)
        if self.key_channels is not None:  # a channel-pruned cache stores every new key with the same channels
            key_states = self._select_channels(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            bsz, heads = key_states.shape[:2]
            self.positions = torch.empty(bsz, heads, 0, dtype=torch.long, device=key_states.device)
        q = key_states.shape[-2]
        new_pos = torch.arange(self.seen, self.seen + q, device=key_states.device)
        self.positions = torch.cat([self.positions, new_pos.expand(*key_states.shape[:2], q)], dim=-1)
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones(*key_states.shape[:2], q)], dim=-1)
        for name, tensor in self.state.items():
            self.state[name] = torch.cat([tensor, tensor.new_zeros(*tensor.shape[:2], q)], dim=-1)
        if self.rope_pos is not None:
            self.rope_pos = torch.cat([self.rope_pos, new_pos.float().expand(*key_states.shape[:2], q)], dim=-1)
        self.seen += q
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model-level mask is built for logical positions; kvbench's attention ignores it after compression.
        return self.seen + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.seen = 0
        self.positions = None
        self.valid = None
        self.state = {}
        self.rope_pos = None
        self.capacity = None
        self.row_state = {}
        self.key_channels = None
        self.ragged = None
        self.position_ordered = True
        self.defer_valid_check = False
        self.valid_unchecked = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotAvailableError(
            "a kvbench compressed cache cannot be cropped: assisted/speculative decoding is not supported with it"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._dense_only("select batch rows")
        super().batch_select_indices(indices)
        self.positions = self.positions[indices]
        if self.valid is not None:
            self.valid = self.valid[indices]
        self.state = {k: v[indices] for k, v in self.state.items()}
        if self.rope_pos is not None:
            self.rope_pos = self.rope_pos[indices]
        if self.capacity is not None:
            self.capacity = self.capacity[indices]
        self.row_state = {k: v[indices] for k, v in self.row_state.items()}
        if self.key_channels is not None:
            self.key_channels = self.key_channels[indices]

    # ---- kvbench API ---------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> torch.Tensor | None:
        return self._capacity

    @capacity.setter
    def capacity(self, value: torch.Tensor | None) -> None:
        self._capacity = value
        self._capacity_host: list[int] | None = None

    def set_capacity(self, value: torch.Tensor, host: list[int]) -> None:
        """``capacity`` together with its values as Python ints (the session knows them: no device read)."""
        self.capacity = value
        self._capacity_host = list(host)

    def capacity_list(self) -> list[int]:
        """``capacity`` as Python ints, read from the device once per assignment: per-step eviction checks on a GPU
        would otherwise wait for the device at every layer of every step."""
        if self._capacity_host is None:
            self._capacity_host = [int(c) for c in self._capacity.tolist()]
        return self._capacity_host

    @property
    def num_entries(self) -> int:
        """Entries of the longest (row, head): the length of the attention view."""
        dense = 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]
        return dense if self.ragged is None else self.ragged.width + self.keys.shape[-2]

    def resident_bytes(self) -> int:
        """Bytes of K and V actually held by this layer (a ragged layer: its flat entries and its appended tail)."""
        if self.keys is None:
            return 0
        dense = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        return dense if self.ragged is None else dense + self.ragged.nbytes()

    def valid_counts(self) -> torch.Tensor:
        """Valid entries per (batch, head): ``(batch, heads)``."""
        if self.valid is None:
            dense = torch.full(self.keys.shape[:2], self.keys.shape[-2], dtype=torch.long, device=self.keys.device)
        else:
            dense = self.valid.sum(-1)
        return dense if self.ragged is None else dense + self.ragged.lengths

    def to_ragged(self, kept: torch.Tensor) -> None:
        """Keep the entries ``kept`` ``(B, H, entries)`` marks (and that are valid), each (row, head) holding only its
        own, flat (``RaggedEntries``): heads keeping different numbers allocate nothing for the difference. The layer's
        dense tensors become empty ``(B, H, 0, ...)`` tails, fresh tensors (the evicted entries leave memory)."""
        self._dense_only("become ragged again")
        if self.key_channels is not None or self.rope_pos is not None:
            raise NotAvailableError("a ragged cache layer holds neither pruned key channels nor re-rotated keys")
        if self.valid is not None:
            kept = kept & self.valid
        positions = self.positions
        b, h, n = kept.shape
        lengths = kept.sum(-1)  # (the order below moves entries within a (row, head): their counts stay)
        # flat entries go in position order: sorted unless a kept entry follows a later kept one (empty slots of a
        # padded view, at -1, do not count); that, the longest head, whether every head is as long and how many are
        # kept in all, in one read (the only one: the count sizes the flat index below, which nonzero would read)
        latest = torch.where(kept, positions, -1).cummax(-1).values
        unsorted = (kept[..., 1:] & (positions[..., 1:] < latest[..., :-1])).any() if n > 1 else kept.new_zeros(())
        width = lengths.max() if lengths.numel() else lengths.new_zeros(())
        unsorted, width, uniform, total = (int(x) for x in torch.stack([
            unsorted.long(), width.long(), (lengths == width).all().long(), lengths.sum().long()]).tolist())
        if unsorted:
            order = torch.argsort(positions, dim=-1, stable=True)
            self.gather(order)
            kept, positions = torch.gather(kept, -1, order), self.positions
        rank = kept.cumsum(-1) - 1  # each kept entry's slot within its (row, head)
        row_head = torch.arange(b * h, device=kept.device).view(b, h, 1).expand(b, h, n)
        # the kept entries in (row, head, slot) order: a stable sort puts them first, in order (nonzero would read)
        flat = torch.argsort((~kept.reshape(-1)).to(torch.int8), stable=True)[:total]

        def pick(t: torch.Tensor) -> torch.Tensor:  # t[kept], by the one index
            return t.reshape(b * h * n, *t.shape[3:]).index_select(0, flat)

        self.ragged = RaggedEntries(
            keys=pick(self.keys), values=pick(self.values), positions=pick(positions), lengths=lengths,
            slots=pick(row_head * width + rank), width=width, uniform=bool(uniform),
            state={k: pick(v) for k, v in self.state.items()},
        )
        self.keys = self.keys.new_empty(b, h, 0, self.keys.shape[-1])
        self.values = self.values.new_empty(b, h, 0, self.values.shape[-1])
        self.positions = positions.new_empty(b, h, 0)
        self.valid = None
        self.state = {k: v.new_empty(b, h, 0) for k, v in self.state.items()}

    def attention_view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(keys, values, valid)`` to attend over: the layer's own tensors, or, for a ragged layer, a transient padded
        copy ``(B, H, width + appended, D)`` (its flat entries first in each (row, head), empty zero slots after them,
        then the appended tail) and its validity ``(B, H, width + appended)`` (None when no slot is empty)."""
        if self.ragged is None:
            return self.keys, self.values, self.valid
        slots = self.ragged.padded_slots(self.keys.shape[2])
        return self._padded(self.ragged.keys, self.keys, slots), self._padded(self.ragged.values, self.values, slots), \
            self._view_valid()

    def position_view(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(positions, valid)`` ``(B, H, entries)``, the entries as ``attention_view`` lays them out (a ragged layer's
        empty slots at position -1)."""
        if self.ragged is None:
            return self.positions, self.valid
        slots = self.ragged.padded_slots(self.keys.shape[2])
        positions = self._padded(self.ragged.positions.unsqueeze(-1), self.positions.unsqueeze(-1), slots, -1)
        return positions.squeeze(-1), self._view_valid()

    def _padded(self, flat: torch.Tensor, tail: torch.Tensor, slots: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """A ragged layer's flat entries ``(kept, D)`` at their ``slots`` of a new ``(B, H, width + appended, D)``
        tensor whose last ``appended`` entries of each (row, head) are ``tail`` ``(B, H, appended, D)``."""
        b, h, t = tail.shape[:3]
        out = flat.new_full((b, h, self.ragged.width + t, flat.shape[-1]), fill)
        out[:, :, self.ragged.width:] = tail
        out.view(-1, flat.shape[-1]).index_copy_(0, slots, flat)
        return out

    def _view_valid(self) -> torch.Tensor | None:
        r = self.ragged
        if r.uniform and self.valid is None:
            return None
        j = torch.arange(r.width + self.keys.shape[2], device=self.keys.device)
        valid = (j < r.lengths.unsqueeze(-1)) | (j >= r.width)
        if self.valid is not None:
            valid[:, :, r.width:] &= self.valid
        return valid

    def _densify(self) -> None:
        """A ragged layer back to the dense layout, as its padded view (the empty slots invalid)."""
        r = self.ragged
        slots = r.padded_slots(self.keys.shape[2])
        keys, values = self._padded(r.keys, self.keys, slots), self._padded(r.values, self.values, slots)
        positions, valid = self.position_view()
        self.state = {k: self._padded(r.state[k].unsqueeze(-1), v.unsqueeze(-1), slots).squeeze(-1)
                      for k, v in self.state.items()}
        self.ragged = None
        self.keys, self.values, self.positions = keys, values, positions
        self.set_valid(valid)

    def _dense_only(self, what: str) -> None:
        if self.ragged is not None:
            raise NotAvailableError(
                f"kvbench cannot {what} on a ragged cache layer (heads holding different numbers of entries, flat); "
                "the method's layout=padded holds a padded (B, H, n, D) cache that can"
            )

    def set_valid(self, valid: torch.Tensor | None) -> None:
        """Set validity of all entries; a mask with no False is stored as None (the fast path). Under
        ``defer_valid_check`` (a method's prefill, set by the session) the mask is stored without that read and the
        layer is ``valid_unchecked``: the session's ``check_deferred_valid`` reads every such layer's at once after
        the prompt's last layer, so a prefill reads once for all layers instead of once per layer."""
        if valid is not None and self.defer_valid_check:
            self.valid, self.valid_unchecked = valid, True
            return
        self.valid = None if valid is None or bool(valid.all()) else valid

    def gather(self, index: torch.Tensor, keep_valid: torch.Tensor | None = None, position_order: bool = True,
               partial: bool = False) -> None:
        """Keep only entries ``index`` ``(batch, heads, k)`` (sorted by position), dropping everything else.

        ``keep_valid`` ``(batch, heads, k)`` marks gathered slots that are empty (rows keeping fewer than k).
        The evicted tensors are freed: the new tensors are fresh copies of the kept rows.

        ``position_order=False`` stores the entries in ``index``'s order instead (a method's working layout during
        its prefill, DynamicKV's score order, which ``keep_first`` truncates without a selection): the layer is then
        not ``position_ordered`` until ``sort_by_position``, which the method calls before its prefill ends (the
        session refuses a layer left out of order; decode-time code relies on position order, ``real_rank``).

        ``partial=True``: the caller knows from host ints that ``keep_valid`` marks an empty slot, so the new mask is
        stored without reading whether it is all valid (``set_valid``'s read).
        """
        self._dense_only("gather entries")
        if position_order:
            order = torch.argsort(torch.gather(self.positions, -1, index), dim=-1)
            index = torch.gather(index, -1, order)
            if keep_valid is not None:
                keep_valid = torch.gather(keep_valid, -1, order)
        self.keys = torch.gather(self.keys, 2, index.unsqueeze(-1).expand(*index.shape, self.keys.shape[-1]))
        self.values = torch.gather(self.values, 2, index.unsqueeze(-1).expand(*index.shape, self.values.shape[-1]))
        self.positions = torch.gather(self.positions, -1, index)
        valid = torch.gather(self.valid, -1, index) if self.valid is not None else None
        if keep_valid is not None:
            valid = keep_valid if valid is None else valid & keep_valid
        if partial and keep_valid is not None:
            self.valid = valid
        else:
            self.set_valid(valid)
        self.state = {k: torch.gather(v, -1, index) for k, v in self.state.items()}
        if self.rope_pos is not None:
            self.rope_pos = torch.gather(self.rope_pos, -1, index)
        self.position_ordered = position_order

    def keep_first(self, count: int, rows: list[int] | None = None) -> None:
        """Keep the first ``count`` stored entries of every (row, head) (fresh copies: the rest leaves memory); with
        ``rows`` (one count per row, at most ``count``), the slots of a row past its own count become empty. In a
        layer stored in a method's score order (``gather(..., position_order=False)``) this is a top-k without a
        selection: a slice per tensor, no index and no read (unless the layer holds empty slots already, whose
        validity ``set_valid`` checks)."""
        if count < self.num_entries:
            self._map_entries(lambda t: t[:, :, :count].contiguous(), lambda t: t[..., :count].contiguous())
        if rows is not None and min(rows) < count:
            b, h, n = self.positions.shape
            short = torch.arange(n, device=self.positions.device) < torch.tensor(rows, device=self.positions.device)[
                :, None]
            short = short[:, None, :]
            self.set_valid(short.expand(b, h, n).contiguous() if self.valid is None else self.valid & short)

    def sort_by_position(self) -> None:
        """Store the entries in position order again, valid entries first in each (row, head) and empty slots after
        them (after ``gather(..., position_order=False)``); nothing to do for a layer in position order."""
        if self.position_ordered:
            return
        self._dense_only("sort entries")
        key = self.positions if self.valid is None else self.positions.masked_fill(~self.valid, self.seen)
        order = torch.argsort(key, dim=-1, stable=True)
        self._map_entries(lambda t: torch.gather(t, 2, order.unsqueeze(-1).expand(*order.shape, t.shape[-1])),
                          lambda t: torch.gather(t, -1, order), check_valid=False)
        self.position_ordered = True

    def repeat_heads(self, group: int) -> None:
        """Hold ``group`` copies of every head side by side, ``(B, H, n, D)`` -> ``(B, H * group, n, D)`` with head h
        on h // group (transformers' ``repeat_kv``), positions, validity, method state and RoPE positions included: a
        query-head-granular cache (KVCache-Factory's default, DynamicKV's official layout), on which a method selects
        per query head. ``update`` then repeats new KV heads the same way, and resident bytes count every copy."""
        self._dense_only("repeat heads")
        if group <= 1:
            return
        self.keys = self.keys.repeat_interleave(group, dim=1)
        self.values = self.values.repeat_interleave(group, dim=1)
        self.positions = self.positions.repeat_interleave(group, dim=1)
        if self.valid is not None:
            self.valid = self.valid.repeat_interleave(group, dim=1)
        self.state = {k: v.repeat_interleave(group, dim=1) for k, v in self.state.items()}
        if self.rope_pos is not None:
            self.rope_pos = self.rope_pos.repeat_interleave(group, dim=1)
        if self.key_channels is not None:
            self.key_channels = self.key_channels.repeat_interleave(group, dim=1)

    def prune_key_channels(self, channels: torch.Tensor) -> None:
        """Keep only key channels ``channels`` ``(batch, heads, kept)`` (ascending) of every entry: the keys become
        ``(batch, heads, entries, kept)``, fresh tensors (the pruned channels leave memory); values are untouched.
        Later keys (``update``) are stored with the same channels; attention gathers the queries (``gather_query``)."""
        self._dense_only("prune key channels")
        if self.key_channels is not None:
            raise ValueError("the layer's key channels were pruned already")
        self.key_channels = channels
        self.keys = self._select_channels(self.keys)

    def gather_query(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` ``(batch, q_heads, q, head_dim)`` at the kept key channels of its KV head: ``(batch, q_heads, q,
        kept)``, query head h on KV head h // (q_heads / heads) (GQA), so that q.k runs over the kept channels."""
        group = query.shape[1] // self.key_channels.shape[1]
        channels = self.key_channels.repeat_interleave(group, dim=1) if group > 1 else self.key_channels
        return torch.gather(query, -1, channels.unsqueeze(2).expand(-1, -1, query.shape[2], -1))

    def _select_channels(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.gather(keys, -1, self.key_channels.unsqueeze(2).expand(-1, -1, keys.shape[2], -1))

    def evict_one(self, index: torch.Tensor) -> None:
        """Evict one entry per (batch, head): ``index`` ``(batch, heads)``; the others keep their order.

        A gather with ``i + (i >= index)`` for i < n - 1, not a boolean mask: masked indexing has a data-dependent
        size and makes the host wait for the GPU, at every layer of every decode step."""
        n = self.num_entries
        b, h = index.shape
        keep = torch.arange(n - 1, device=index.device).expand(b, h, n - 1)
        keep = keep + (keep >= index.unsqueeze(-1)).long()
        idx4 = keep.unsqueeze(-1)
        self._map_entries(lambda t: torch.gather(t, 2, idx4.expand(b, h, n - 1, t.shape[-1])),
                          lambda t: torch.gather(t, -1, keep))

    def evict_at(self, index: int) -> None:
        """Evict the entry at ``index`` of every (batch, head): the same as ``evict_one`` with a constant index
        (StreamingLLM's and CaM's decode step), as one concatenation per tensor instead of an index computation and a
        gather each: fewer kernel launches per layer on a GPU, where batch-1 decoding is bound by them."""
        def drop(t: torch.Tensor, dim: int) -> torch.Tensor:
            return torch.cat([t.narrow(dim, 0, index), t.narrow(dim, index + 1, t.shape[dim] - index - 1)], dim)

        self._map_entries(lambda t: drop(t, 2), lambda t: drop(t, -1))

    def drop_oldest(self, count: int) -> None:
        """Evict the ``count`` oldest entries of every (batch, head) (views of the rest, as transformers' sliding
        cache keeps ``full[:, :, -(window - 1):]``): a sliding layer that no method touches is a contiguous tail."""
        if count > 0:
            self._map_entries(lambda t: t[:, :, count:], lambda t: t[..., count:])

    def drop_newest(self, count: int) -> None:
        """Forget the ``count`` newest entries of every (batch, head) and their tokens (``seen``): a scoring forward's
        tokens (KVzip's context reconstruction) leave the cache as if they were never fed."""
        if count > 0:
            self._map_entries(lambda t: t[:, :, :-count], lambda t: t[..., :-count])
            self.seen -= count

    def keep_after(self, first: torch.Tensor) -> None:
        """Keep only entries at positions ``>= first`` ``(B, 1, 1)`` (a sliding window's reach after a method evicted
        inside it, so rows and heads may lose different numbers): a gather, invalid slots where a row keeps fewer. A
        ragged layer that loses entries is flattened again from its padded view (rows may lose different numbers of
        the appended tail too)."""
        if self.ragged is not None:
            positions, valid = self.position_view()
            keep = positions >= first
            if bool((keep if valid is None else keep | ~valid).all()):
                return
            self._densify()
            self.to_ragged(keep)
            return
        keep = self.positions >= first
        if self.valid is not None:
            keep = keep & self.valid
        if bool(keep.all()):
            return
        k = int(keep.sum(-1).max())
        order = torch.where(keep, self.positions, -1)
        index = torch.topk(order, k, dim=-1).indices
        self.gather(index, torch.gather(keep, -1, index))

    def _map_entries(self, kv: Callable[[torch.Tensor], torch.Tensor],
                     per_entry: Callable[[torch.Tensor], torch.Tensor], check_valid: bool = True) -> None:
        """Apply an entry selection to every per-entry tensor: ``kv`` to keys and values ``(B, H, n, D)``,
        ``per_entry`` to positions, validity, method state and RoPE positions ``(B, H, n)``. ``check_valid=False``:
        a reordering, which cannot make every slot valid (no read of the new mask)."""
        self._dense_only("evict entries")
        self.keys, self.values = kv(self.keys), kv(self.values)
        self.positions = per_entry(self.positions)
        if self.valid is not None:
            valid = per_entry(self.valid)
            if check_valid:
                self.set_valid(valid)
            else:
                self.valid = valid
        self.state = {k: per_entry(v) for k, v in self.state.items()}
        if self.rope_pos is not None:
            self.rope_pos = per_entry(self.rope_pos)


def check_deferred_valid(layers: list[KVLayer]) -> None:
    """Store as None (every entry valid: the fast path) the masks that ``set_valid`` kept unread during a prefill
    (``KVLayer.defer_valid_check``), in one read for all the layers."""
    pending = [layer for layer in layers if layer.valid_unchecked and layer.valid is not None]
    if pending:
        full = torch.stack([layer.valid.all() for layer in pending]).tolist()
        for layer, all_valid in zip(pending, full):
            if all_valid:
                layer.valid = None
    for layer in layers:
        layer.valid_unchecked = False


class KVCache(Cache):
    """A transformers ``Cache`` whose layers are ``KVLayer``s (created lazily, one per decoder layer)."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=KVLayer)

    def resident_bytes(self) -> int:
        return sum(layer.resident_bytes() for layer in self.layers if isinstance(layer, KVLayer))


def ensure_kv_layer(cache: Cache, layer_idx: int) -> KVLayer:
    """Make ``cache.layers[layer_idx]`` a KVLayer (converting an empty or filled stock DynamicLayer in place)."""
    while len(cache.layers) <= layer_idx:
        cache.layers.append(KVLayer())
    layer = cache.layers[layer_idx]
    if isinstance(layer, KVLayer):
        return layer
    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):  # what DynamicCache(config=...) builds
        raise TypeError(f"kvbench cannot compress a {type(layer).__name__} cache layer; use a DynamicCache or KVCache")
    new = KVLayer()
    if layer.is_initialized and layer.keys is not None and layer.keys.numel():
        # a sliding layer holds the last tokens of ``cumulative_length`` seen: positions continue from there
        new.seen = int(getattr(layer, "cumulative_length", layer.keys.shape[-2])) - layer.keys.shape[-2]
        new.update(layer.keys, layer.values)
    cache.layers[layer_idx] = new
    return new
