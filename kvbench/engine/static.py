"""Fixed-capacity cache layers and one layer's decode step on them, in place: what the captured step runs.

Batch-1 decoding of an 8B model on a GPU is bound by kernel launches and host work, not by memory (issue: decode at GPU
speed). With ``engine.decode=graph`` (``engine.compile=true``) the session converts every layer after prefill into a
``StaticKVLayer``:

* a fixed number of slots ``(B, H, C, D)``: what the method keeps plus the tokens a step adds (budget + 1 for methods
  that evict at every step; kept + the generation's length for methods that never evict after prefill), its buffers
  taken from the model's ``SlotPool`` (the same addresses for every generation of the same shapes);
* a step writes its key/value into a free slot (a scatter, no new tensor), attends over the valid slots, and an
  evicting method frees one slot by clearing its ``valid`` bit: no data moves, nothing changes shape;
* ``static_step`` (attention + the method's step of one layer) has no host read and no data-dependent shape; the
  whole decode step, every layer's ``static_step`` inside the model's forward, is captured once by
  ``engine.graph`` (``torch.compile(fullgraph=True)``, CUDA graphs on a GPU) and replayed per token.

Slots are not in position order (an evicted slot is reused): attention does not care, and positions travel with the
entries. A layer compressed during decode (``method.decode_compression``) appends instead (``StaticKVLayer.fill``):
slots ``[0, fill)`` are laid out as the eager layer holds its entries, which the host compresses between captured steps
(``show_entries`` / ``hold_entries``).
A method opts in with ``Method.static_policy``, whose ``StaticPolicy`` carries its step: its own pure-tensor
functions (which slots to attend, what to evict, a selection to share) and their constants, so the engine imports and
names no method; one without it (merging every step, its own attention) refuses with one line.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvbench.engine.attention import softmax_with_sinks
from kvbench.engine.cache import KVLayer


class StepSlots(NamedTuple):
    """What one layer's decode step sees, all device tensors but ``scaling``: the slots ``keys`` / ``values``
    ``(B, Hkv, C, D)``, their ``positions`` and ``valid`` bits ``(B, Hkv, C)``, the method's accumulated scores ``acc``
    ``(B, Hkv, C)`` (or None), the layer's ``capacity`` ``(B, 1, 1)``, its per-row method state ``row_state``, a
    selection shared between layers ``chosen`` (or None), the step's post-RoPE ``query`` ``(B, Hq, 1, D)``, the
    attention ``scaling``, the model's RoPE frequencies ``rope_inv_freq`` (or None) and, for a layer whose keys keep
    fewer channels than its queries (ThinK), the channels they keep ``key_channels`` ``(B, Hkv, D_kept)`` (or None:
    ``keys`` are then ``(B, Hkv, C, D_kept)``, ``values`` keep ``D``), and the layer's logit soft-cap ``softcap`` (Gemma
    2) and per-query-head sink logits ``sinks`` ``(Hq,)`` (GPT-OSS), as the model's attention applies them (or None),
    the layer's per-entry statistics ``state`` (``StaticPolicy.state``: name -> ``(B, Hkv, C)``), the logits
    buffer ``shared`` ``(B, Hkv, g, 1, C)`` float32 the layers naming it share (``StaticPolicy.shared``, or None), and
    ``token_logp`` ``(B, 1)`` float32, the model's log-probability of the step's input token under the previous
    forward's prediction (``StaticPolicy.token_logp``, or None), and inside a captured step at a batch bucket ``rows``
    ``(B,)`` long, 1 for the batch's rows and 0 for the bucket's extra ones (or None: every row is the batch's)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    acc: torch.Tensor | None
    capacity: torch.Tensor
    row_state: dict
    chosen: torch.Tensor | None
    query: torch.Tensor
    scaling: float
    rope_inv_freq: torch.Tensor | None
    key_channels: torch.Tensor | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    state: dict | None = None
    shared: torch.Tensor | None = None
    token_logp: torch.Tensor | None = None
    rows: torch.Tensor | None = None


@dataclass(frozen=True)
class StaticPolicy:
    """A method's decode step in the form the captured step runs, given by the method (``Method.static_policy``):

    * ``evict(slots, probs, policy)``: after the step's attention, free the slots the method evicts where a (row,
      head) holds more than ``slots.capacity`` entries (clear their ``valid`` bits, after a merge where the method
      merges), in place; ``probs`` ``(B, Hkv, g, 1, C)`` float32 when ``needs_probs`` or ``accumulate``, else None;
    * ``attend(slots, policy)``: the slots this step attends ``(B, Hkv, C)`` (default: every valid one);
    * ``attention(slots, policy)``: the method's own attention of ``slots.query`` over the slots it attends, the
      output ``(B, Hq, 1, D)`` (default: softmax attention at the keys' stored rotation; LM-Infinite's distance
      ceiling re-rotates);
    * ``choose(slots, policy)``: write this step's choice into ``slots.chosen`` (a selection other layers attend
      through);
    * ``accumulate``: add the step's probabilities to ``slots.acc`` (over each GQA group: ``acc_agg`` mean or max);
    * ``state``: names of per-entry statistics the method's functions read and write themselves (``slots.state``:
      float32 ``(B, Hkv, C)`` each, the layer's ``state`` entries of those names at prefill, zero for a new entry;
      RoCo's attention sums, squares and counts), or ``(B, Hkv, C, k)`` where the method's ``static_state`` starts
      them so (a vector per entry, zero for a new entry), or with one head for a method whose heads hold the same
      slots (PyramidInfer's attention from each of the last W queries, ``(B, 1, C, R)``);
    * ``params``: the method's constants its functions read (its sinks, recent window, page sizes, merge settings);
    * ``slot_multiple``: the layer's slot count a multiple of this (Quest's pages);
    * ``selection``: the layer whose shared selection this layer writes (with ``choose``) or reads, ``(B, 1, C)``
      over the writer's slots;
    * ``key_window``: ``(sinks, recent)``: the layer keeps keys for its first ``sinks`` entries and its last
      ``recent`` only (values for every entry: POD's layers that use only other layers' distant logits), in a ring of
      ``sinks + recent`` key slots (entry ``j``'s key in slot ``j`` below ``sinks``, else ``sinks + (j - sinks) %
      recent``; the step's key overwrites the one that left the window); for a layer whose entries fill its slots in
      order and are never freed;
    * ``entries``: ``entries(held, steps)``, host arithmetic: how many entries a layer that held ``held`` when it
      turned static holds ``steps`` steps later, for a step that frees entries on a schedule of its own (PyramidInfer's
      chunks of generated tokens), which sizes its slots and counts its resident bytes without a read; None: one more
      per step, at most the capacity where ``evict`` is set;
    * ``source``: the layer attends the slots of the method's layer ``source`` (written earlier in the same step)
      with its own query and keeps no entry: it holds no slot and its step writes nothing (CLA's upper layers);
    * ``token_logp``: the step reads ``slots.token_logp``, the model's log-probability of the step's input token
      under the previous forward's prediction (SirLLM's surprisal): the captured step writes it after its output head
      for the next step, the host before the first one;
    * ``shared``: the name of a buffer of attention logits ``(B, Hkv, g, 1, C)`` float32 that every layer naming it
      sees (``slots.shared``; one per name and generation, zero at the start; the layers naming it hold the same slot
      count): the method's functions write and read it in layer order (POD's distant logits of each KV head's block,
      computed by the block's lowest layer and used by the layers above it).

    The functions are pure tensor code (no host read, no data-dependent shape) defined at module level in the method's
    own file (a graph's guard on them then holds across sessions); the engine calls them and names no method. None
    everywhere (``StaticPolicy()``): the method does nothing after prefill and appended tokens stay."""

    evict: Callable | None = None
    attend: Callable | None = None
    attention: Callable | None = None
    choose: Callable | None = None
    accumulate: bool = False
    state: tuple[str, ...] = ()
    acc_agg: str = "mean"
    needs_probs: bool = False
    params: tuple = ()
    slot_multiple: int = 1
    selection: int | None = None
    shared: str | None = None
    key_window: tuple[int, int] | None = None
    entries: Callable[[int, int], int] | None = None
    token_logp: bool = False
    source: int | None = None

    def __post_init__(self) -> None:
        if self.acc_agg not in ("mean", "max"):
            raise ValueError(f"StaticPolicy.acc_agg={self.acc_agg!r}; valid: mean, max")
        if self.attention is not None and (self.needs_probs or self.accumulate):
            raise ValueError("StaticPolicy: a method's own attention gives no probabilities to need or accumulate")
        if self.choose is not None and self.selection is None:
            raise ValueError("StaticPolicy: choose writes a shared selection, which needs selection=<its layer>")


def put_slots(buffer: torch.Tensor, slot: torch.Tensor, value: torch.Tensor, accumulate: bool = False) -> None:
    """``buffer[b, h, slot[b, h, j], ...] = value[b, h, j, ...]`` for a buffer ``(B, H, C, ...)`` and slots ``(B, H,
    n)`` (distinct within a (row, head)); ``value`` broadcasts to ``(B, H, n, ...)``; ``accumulate``: ``+=``. The
    captured step writes its buffers with this ``index_put_``, not ``scatter_``: inductor compiles an ``index_put_`` on
    a graph input in place, where a ``scatter_`` on one becomes a copy of the whole buffer, the scatter into the copy
    and a copy back (its reinplace pass, ``torch/_inductor/fx_passes/reinplace.py``, re-places ``index_put`` and not
    ``scatter``): for the key and value writes, four passes over the cache at every step besides attention's one
    (``tests/test_step_traffic.py``)."""
    b, h = slot.shape[:2]
    rows = torch.arange(b, device=slot.device).view(b, 1, 1)
    heads = torch.arange(h, device=slot.device).view(1, h, 1)
    buffer.index_put_((rows, heads, slot), value, accumulate=accumulate)


def evict_one(valid: torch.Tensor, key: torch.Tensor, capacity: torch.Tensor) -> None:
    """Free the slot with the lowest ``key`` ``(B, H, C)`` in every (row, head) holding more than ``capacity``
    ``(B, 1, 1)`` valid entries (a prompt within the budget keeps growing up to it): its ``valid`` bit cleared."""
    victim = torch.argmin(key, dim=-1, keepdim=True)  # (B, H, 1)
    over = valid.sum(-1, keepdim=True) > capacity
    put_slots(valid, victim, torch.gather(valid, -1, victim) & ~over)


def evict_oldest(slots: StepSlots, probs: torch.Tensor | None, policy: StaticPolicy) -> None:
    """The oldest entry after the first ``params[0]`` positions (the sinks) leaves: a sliding window's step (the
    engine's, for layers no method touches), StreamingLLM's and the local window's."""
    sinks = policy.params[0] if policy.params else 0
    candidate = slots.valid & (slots.positions >= sinks)
    key = slots.positions.masked_fill(~candidate, torch.iinfo(slots.positions.dtype).max)
    evict_one(slots.valid, key, slots.capacity)


class SlotPool:
    """The buffers of a model's fixed-capacity layers and captured-step state, kept across generations and sessions:
    a buffer of the shape and dtype asked for the same name is handed out again (the same address: a CUDA graph
    replays over it without re-recording), another shape replaces it. One per model (``slot_pool``)."""

    def __init__(self) -> None:
        self._held: dict[tuple, torch.Tensor] = {}
        #: the most slots a (method, budget, batch bucket)'s layers with heads of their own lengths have had: every
        #: such layer of the next generation gets at least as many (``CompressionSession._to_static``)
        self.marks: dict[tuple, int] = {}

    def take(self, key: tuple, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        held = self._held.get(key)
        if held is None or tuple(held.shape) != tuple(shape) or held.dtype != dtype or held.device != device:
            self._held.pop(key, None)  # freed before its successor is allocated
            held = self._held[key] = torch.zeros(shape, dtype=dtype, device=device)
        return held

    def taker(self, prefix: tuple, device: torch.device) -> Callable[[str, tuple, torch.dtype], torch.Tensor]:
        return lambda name, shape, dtype: self.take((*prefix, name), shape, dtype, device)

    def clear(self) -> None:
        self._held.clear()
        self.marks.clear()


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def repeat_last_row(base: torch.Tensor, real: int, rows: int) -> None:
    """Rows ``real .. rows - 1`` of a batch bucket's buffer ``base`` become copies of row ``real - 1``, in place."""
    if rows > real:
        base[real:rows].copy_(base[real - 1 : real].expand(rows - real, *base.shape[1:]))


def slot_pool(model) -> SlotPool:
    """The model's ``SlotPool`` (created at first use, freed with the model)."""
    pool = _POOLS.get(model)
    if pool is None:
        pool = _POOLS[model] = SlotPool()
    return pool


def release_slot_pool(model) -> None:
    """Free the buffers a model's captured decode kept (between bench cells, or when memory is needed elsewhere)."""
    pool = _POOLS.pop(model, None)
    if pool is not None:
        pool.clear()


def _key_ring(keys: torch.Tensor, entries: int, sinks: int, recent: int) -> torch.Tensor:
    """The keys of a layer holding ``entries`` entries whose keys are those of its first ``sinks`` entries and its last
    ``keys.shape[2] - min(entries, sinks)`` (at most ``recent``), in a ring of ``sinks + recent`` slots
    (``StaticPolicy.key_window``); the other slots zero."""
    b, h, kept, d = keys.shape
    head = min(entries, sinks)
    tail = kept - head
    if tail > recent:
        raise ValueError(f"a key window of {sinks} + {recent} cannot hold {kept} keys")
    ids = list(range(head)) + list(range(entries - tail, entries))
    slots = torch.tensor([j if j < sinks else sinks + (j - sinks) % recent for j in ids], device=keys.device)
    ring = keys.new_zeros(b, h, sinks + recent, d)
    ring[:, :, slots] = keys
    return ring


class StaticKVLayer(KVLayer):
    """A ``KVLayer`` with a fixed number of slots; ``valid`` marks the occupied ones (always a tensor here)."""

    @classmethod
    def from_layer(cls, layer: KVLayer, extra: int, state: tuple[str, ...] = (), rows: int | None = None,
                   take: Callable[[str, tuple, torch.dtype], torch.Tensor] | None = None,
                   key_window: tuple[int, int] | None = None,
                   initial: tuple[dict, dict] = ({}, {})) -> StaticKVLayer:
        """The entries of ``layer`` in a layer with ``extra`` free slots per (row, head) after them. Every tensor is
        the first rows of a buffer of ``rows`` rows (the captured step's batch bucket; ``pad_rows`` fills the rest)
        that ``take(name, shape, dtype)`` hands out (``SlotPool.taker``: the same buffers for every generation of the
        same shapes, so a CUDA graph replays over the same addresses), or a new one. ``state``: the per-entry
        statistics the step keeps (``acc`` where it accumulates, a method's own ``StaticPolicy.state``), float32, from
        the layer's ``state`` (zero where it has none). ``key_window``: ``StaticPolicy.key_window``; the layer's keys
        are then those of its first ``sinks`` entries and its last ones (at most ``recent``), laid into the ring.
        ``initial``: per-entry ``(B, H, n)`` or ``(B, H, n, k)`` and per-row state the method keeps outside the layer
        (``Method.static_state``), in place of the layer's own entries of those names."""
        ragged = layer.ragged is not None  # each head's kept entries flat (AdaKV's, KVzip's layout): its padded view
        keys, values, valid = layer.attention_view()
        positions = layer.position_view()[0]
        b, h, n, d = values.shape
        rows = max(rows or b, b)
        device = keys.device
        new = cls()
        new.lazy_initialization(keys, values)
        new._bases = {}
        new.kept_bytes_only = ragged

        def place(name: str, tensor: torch.Tensor, slots: bool = True) -> torch.Tensor:
            if slots:  # extra empty slots (zero, invalid) after the entries, along the entry dimension
                pad = (0, 0, 0, extra) if tensor.dim() == 4 else (0, extra)
                tensor = torch.nn.functional.pad(tensor, pad)
            shape = (rows, *tensor.shape[1:])
            base = take(name, shape, tensor.dtype) if take is not None else torch.empty(shape, dtype=tensor.dtype,
                                                                                        device=device)
            base[:b].copy_(tensor)
            new._bases[name] = base
            return base[:b]

        new.key_window = key_window
        if key_window is None:
            new.keys = place("keys", keys)
        else:
            new.keys = place("keys", _key_ring(keys, n, *key_window), slots=False)
        new.values = place("values", values)
        new.positions = place("positions", positions)
        valid = valid if valid is not None else torch.ones(b, h, n, dtype=torch.bool, device=device)
        new.valid = place("valid", valid)
        if state and ragged:
            raise NotImplementedError("a ragged layer's per-entry state has no static form")
        entry_state, row_state = {**layer.state, **initial[0]}, {**layer.row_state, **initial[1]}
        new.state = {name: place(f"state.{name}", entry_state.get(name, torch.zeros(b, h, n, device=device)).float())
                     for name in state}
        new.row_state = {k: place(f"row_state.{k}", v, slots=False) for k, v in row_state.items()}
        if layer.key_channels is not None:  # keys keep these channels (ThinK): every step's key is stored with them
            new.key_channels = place("key_channels", layer.key_channels, slots=False)
        new.seen, new.capacity = layer.seen, layer.capacity
        new.rope_pos = None
        new.last_slot = torch.zeros(b, h, 1, dtype=torch.long, device=device)
        new.captured = False
        #: the layer attends another layer's slots and keeps none (``StaticPolicy.source``): nothing is written here
        new.borrows = False
        #: a layer compressed during decode (``method.decode_compression``): the slot the next step writes, a 0-d
        #: device tensor (the eager layer appends at its end: slots ``[0, fill)`` are laid out as it holds them)
        new.fill = None
        return new

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes in place: the slots, their positions and validity, the method's
        per-entry and per-row state."""
        return [self.keys, self.values, self.positions, self.valid, *self.state.values(), *self.row_state.values()] + \
            ([] if self.fill is None else [self.fill]) + ([] if self.key_channels is None else [self.key_channels])

    def _views(self) -> list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]:
        """Each buffer of the bucket's rows, and how to make the layer hold a view of it."""
        def setter(name: str) -> Callable[[torch.Tensor], None]:
            if name.startswith("state."):
                return lambda t: self.state.__setitem__(name[6:], t)
            if name.startswith("row_state."):
                return lambda t: self.row_state.__setitem__(name[10:], t)
            return lambda t: setattr(self, name, t)

        return [(base, setter(name)) for name, base in self._bases.items()]

    def pad_rows(self, rows: int) -> None:
        """The whole ``rows``-row buffers, the rows after the batch's repeating its last row (a captured step's batch
        bucket: the copies decode what the last row decodes and are dropped; no slot of theirs is empty where the
        row's is not). No allocation: the buffers were allocated at the bucket's rows."""
        b = self.keys.shape[0]
        if rows <= b:
            return
        for base, assign in self._views():
            repeat_last_row(base, b, rows)
            assign(base[:rows])

    def keep_rows(self, rows: int) -> None:
        """The first ``rows`` rows only (views: a bucket's extra rows leave the reported bytes)."""
        for base, assign in self._views():
            assign(base[:rows])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write one step's key/value ``(B, H, 1, D)`` into the first free slot (a scatter, in place). In a captured
        step (``captured``) the step's attention writes them (``write_step``) and this returns them unchanged: the
        position comes with them there, and the host's count of tokens seen (``seen``) is not read inside a graph."""
        if self.captured or self.borrows:  # (a layer attending another's slots keeps nothing: StaticPolicy.source)
            return key_states, value_states
        if key_states.shape[-2] != 1:
            raise NotImplementedError("engine.compile decodes one token per step")
        self.last_slot = self.write_step(key_states, value_states, self.seen)
        self.seen += 1
        return self.keys, self.values

    def write_step(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   positions: torch.Tensor | int) -> torch.Tensor:
        """Key/value ``(B, Hkv, 1, D)`` at position ``positions`` (``(B, 1)``, or one int for every row) into the first
        free slot of every (row, head); returns the slots ``(B, H, 1)``. The captured step's write, and ``update``'s
        (whose position ``assign_positions`` then corrects from the model's ``position_ids``)."""
        if self.keys.shape[1] > key_states.shape[1]:  # a query-head-granular cache (DynamicKV's official layout)
            rep = self.keys.shape[1] // key_states.shape[1]
            key_states = key_states.repeat_interleave(rep, dim=1)
            value_states = value_states.repeat_interleave(rep, dim=1)
        if self.key_channels is not None:  # a channel-pruned layer (ThinK) stores every key with its kept channels
            key_states = self._select_channels(key_states)
        if self.fill is None:
            slot = torch.argmax((~self.valid).to(torch.int8), dim=-1, keepdim=True)  # (B, H, 1): the first free slot
        else:  # after the entries the eager layer would hold (invalid slots among them stay where they are)
            slot = self.fill.view(1, 1, 1).expand(*self.valid.shape[:2], 1).clone()  # not a view of what moves on
            self.fill.add_(1)
        key_slot = slot
        if self.key_window is not None:  # the ring: entry j (its values' slot) -> its key's slot
            sinks, recent = self.key_window
            key_slot = torch.where(slot < sinks, slot, sinks + (slot - sinks) % recent)
        put_slots(self.keys, key_slot, key_states)
        put_slots(self.values, slot, value_states)
        at = positions.view(-1, 1, 1).expand_as(slot) if isinstance(positions, torch.Tensor) else \
            torch.full_like(slot, positions)
        put_slots(self.positions, slot, at)
        put_slots(self.valid, slot, torch.ones_like(slot, dtype=torch.bool))
        for stat in self.state.values():  # a new entry's statistics start at zero
            at = slot[:, : stat.shape[1]]  # (a state of one head: the heads hold the same slots, PyramidInfer's)
            put_slots(stat, at, torch.zeros((), dtype=stat.dtype, device=stat.device))
        return slot

    def show_entries(self, layer: KVLayer, rows: int, fill: int) -> None:
        """``layer`` (a host ``KVLayer``) holds copies of slots ``[0, fill)`` of the first ``rows`` rows: what the eager
        layer of a decode compression holds, slot for slot (``fill``: this layer appends after them)."""
        layer.keys = self.keys[:rows, :, :fill].clone()
        layer.values = self.values[:rows, :, :fill].clone()
        layer.positions = self.positions[:rows, :, :fill].clone()
        layer.set_valid(self.valid[:rows, :, :fill].clone())
        layer.row_state = {k: v[:rows].clone() for k, v in self.row_state.items()}
        layer.seen = self.seen

    def grow(self, slots: int, take: Callable[[str, tuple, torch.dtype], torch.Tensor]) -> None:
        """Every per-slot buffer at ``slots`` slots, new ones from ``take`` (the pool: a shape of its own, so the
        captured step compiles once more for it); their content is the caller's to write (``hold_entries``)."""
        current = self.keys.shape[0]
        for name in ("keys", "values", "positions", "valid"):
            old = self._bases[name]
            base = take(name, (old.shape[0], old.shape[1], slots, *old.shape[3:]), old.dtype)
            self._bases[name] = base
            setattr(self, name, base[:current])

    def hold_entries(self, layer: KVLayer, rows: int) -> int:
        """Slots ``[0, k)`` of the first ``rows`` rows become ``layer``'s ``k`` entries (a compression's result, laid
        out as it holds them), every later slot invalid, the next step's slot ``k``; rows after ``rows`` (a batch
        bucket's) repeat the last one. Returns ``k``. Nothing is allocated: the slots are the layer's own."""
        k = layer.keys.shape[2]
        if k > self.keys.shape[2]:
            raise ValueError(f"a decode compression kept {k} entries, more than the {self.keys.shape[2]} slots")
        total = self.keys.shape[0]
        self.keys[:rows, :, :k].copy_(layer.keys)
        self.values[:rows, :, :k].copy_(layer.values)
        self.positions[:rows, :, :k].copy_(layer.positions)
        self.valid[:rows].zero_()
        if layer.valid is None:
            self.valid[:rows, :, :k] = True
        else:
            self.valid[:rows, :, :k].copy_(layer.valid)
        for name, value in layer.row_state.items():
            self.row_state[name][:rows].copy_(value)
        for t in (self.keys, self.values, self.positions, self.valid, *self.row_state.values()):
            repeat_last_row(t, rows, total)
        self.fill.fill_(k)
        return k

    def assign_positions(self, positions: torch.Tensor) -> None:
        """The step's position ``(B, 1, 1)`` (from the model's ``position_ids``) at the slot it was written to."""
        if not self.borrows:
            self.positions.scatter_(-1, self.last_slot, positions.expand_as(self.last_slot))

    def resident_bytes(self) -> int:
        """The bytes of the entries the layer holds, as the host-driven path's layer holds them: ``entries`` (the
        session's host count of its longest (row, head), ``CompressionSession._record_resident``) per row and head.
        Its empty slots are the captured step's working layout (sized for the batch bucket, the job's longest prompt
        and the generation's new tokens), as a bucket's extra rows are: what a method keeps is the same whichever path
        decodes it. A layer made from a ragged one (heads keeping different numbers) counts the entries its heads
        hold, as the ragged layer did, less the ones the steps the captured loop ran past the generation's end wrote
        (``past_end``, per (row, head): such a layer's step frees none). A layer with a key window
        (``StaticPolicy.key_window``) holds the keys of its first ``sinks`` and last ``recent - 1`` entries between
        steps (the next step's key completes the window), as the host-driven layer trims them. Without a count (a
        layer built outside a session): every slot."""
        per_entry = self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()
        if getattr(self, "kept_bytes_only", False):  # (less what the captured steps run past the end appended)
            past = getattr(self, "past_end", 0) * self.valid.shape[0] * self.valid.shape[1]
            return (int(self.valid.sum()) - past) * per_entry
        entries = getattr(self, "entries", None)
        if entries is not None:  # (keys: the window's entries' where the layer has a key window)
            return self.keys.shape[0] * self.keys.shape[1] * (
                self.keys_held(entries) * self.keys.shape[-1] * self.keys.element_size() +
                entries * self.values.shape[-1] * self.values.element_size())
        return super().resident_bytes()

    def keys_held(self, entries: int) -> int:
        """The keys a layer holding ``entries`` entries holds between steps: all of them, or with a key window those
        of its first ``sinks`` and last ``recent - 1`` entries (the host-driven layer's length, ``num_entries``)."""
        window = getattr(self, "key_window", None)
        if window is None:
            return entries
        sinks, recent = window
        return min(entries, sinks) + min(max(entries - sinks, 0), recent - 1)

    def valid_counts(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def set_valid(self, valid: torch.Tensor | None) -> None:
        self.valid = valid


def static_step(slots: StepSlots, policy: StaticPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's decode step on a static layer: the method's choice of slots to attend (``policy.attend``, default
    every valid one) and of a shared selection (``policy.choose``), attention of ``slots.query`` ``(B, Hq, 1, D)`` over
    them, the method's score accumulation (``policy.accumulate``) and eviction (``policy.evict``). Returns the output
    ``(B, 1, Hq, D)`` and the entries attended per (row, head), a device scalar (before the eviction: the victim was
    attended; over ``slots.rows`` where given). Pure tensor code without host reads or data-dependent shapes: run
    inside the captured step."""
    keys, values, valid, query = slots.keys, slots.values, slots.valid, slots.query
    b, hq, q, _ = query.shape
    hkv, c, d = keys.shape[1], keys.shape[2], values.shape[-1]
    qg = query.view(b, hkv, hq // hkv, q, query.shape[-1])
    if slots.key_channels is not None:  # channel-pruned keys (ThinK): q.k over the kept channels, the same scale
        kept = slots.key_channels.shape[-1]
        qg = torch.gather(qg, -1, slots.key_channels.view(b, hkv, 1, 1, kept).expand(b, hkv, hq // hkv, q, kept))
    attended = policy.attend(slots, policy) if policy.attend is not None else valid
    if policy.choose is not None:
        policy.choose(slots, policy)
    if policy.attention is not None:  # the method's own attention (no probabilities: it neither needs nor accumulates)
        out, probs = policy.attention(slots._replace(valid=attended), policy), None
    elif policy.needs_probs or policy.accumulate or slots.softcap is not None or slots.sinks is not None:
        # the model's soft-cap and sink logits as its eager attention applies them (the fused kernel has neither)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys).float() * slots.scaling
        if slots.softcap is not None:
            logits = torch.tanh(logits / slots.softcap) * slots.softcap
        logits = logits.masked_fill(~attended.view(b, hkv, 1, 1, -1), float("-inf"))
        probs = softmax_with_sinks(logits, slots.sinks, torch.float32)
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(values.dtype), values).reshape(b, hq, q, d)
    else:  # no probabilities needed: the fused kernel (SDPA; the GQA group's queries as the query axis of their KV
        # head, so nothing is repeated and no (B, Hkv, g, 1, C) float32 probabilities exist)
        out = torch.nn.functional.scaled_dot_product_attention(
            qg.reshape(b, hkv, -1, qg.shape[-1]), keys, values, attn_mask=attended.view(b, hkv, 1, c),
            scale=slots.scaling,
        ).reshape(b, hq, q, d)
        probs = None
    if policy.accumulate:
        step = probs.sum(3)
        slots.acc.add_(step.mean(2) if policy.acc_agg == "mean" else step.amax(2))
    if slots.rows is None:
        count = attended.sum() // attended[..., 0].numel()
    else:  # the mean over the batch's rows, not the bucket's extra ones (copies of its last row), as the host-driven
        # step counts it: the rows' sums weighed by a device mask, so the batch's size is not a constant of the graph
        per_row = attended.reshape(b, -1).sum(-1)
        count = (per_row * slots.rows).sum() // (slots.rows.sum() * (attended[..., 0].numel() // b))
    if policy.evict is not None:
        policy.evict(slots, probs, policy)
    return out.transpose(1, 2).contiguous(), count
