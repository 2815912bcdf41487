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
entries. A method opts in with ``Method.static_policy``, whose ``StaticPolicy`` carries its step as data (the kind of
eviction or selection, its sizes, and its own step functions where it has them: D2O's merge, OmniKV's choice), so the
engine imports no method; one without it (merging every step, its own attention) refuses with one line.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.engine.cache import KVLayer
from kvbench.engine.scores import page_bounds

#: what a method does at a decode step, in a form the static step can run
EVICTIONS = ("none", "oldest", "score", "merge", "least_attended")
#: which entries a step attends to: all valid ones, Quest's critical pages, or OmniKV's prompt tokens chosen by a
#: filter layer (``filter`` chooses them and attends to everything, ``segment`` attends to the choice)
SELECTIONS = ("none", "pages", "filter", "segment")


@dataclass(frozen=True)
class StaticPolicy:
    """``evict``: ``none`` (prefill-only methods: appended tokens stay), ``oldest`` (StreamingLLM: the oldest entry
    after ``sinks`` leaves), ``score`` (H2O: the lowest accumulated attention outside the ``sinks`` first and the
    ``recent`` newest positions leaves), ``least_attended`` (TOVA: the entry this step's query attends to least,
    averaged over all query heads, the same entry in every KV head, the new one included). ``accumulate``: add each
    step's attention probabilities (mean over the GQA group) to the entries' scores (H2O's running column sums, state
    ``acc``). ``select="pages"`` (Quest, which never
    evicts): the step attends only to the ``pages`` pages of ``page_size`` slots with the highest criticality bound
    (the newest entry's page always among them; the KV group's bounds aggregated by ``group_agg``).

    ``evict="merge"`` (D2O): ``score``'s victim with per-row sinks and recent counts (``layer.row_state``), merged into
    its most similar entry through D2O's EMA gate (``methods.d2o_ops.static_merge_evict``, parameters ``merge``:
    ``(beta, similarity feature, merge weights, add the merged score, the official code's gate)``); ``acc_agg``: how
    the GQA group's probabilities are accumulated (``mean`` or ``max``). ``select="filter"`` / ``"segment"`` (OmniKV,
    batch 1, slots in position order): a filter layer chooses the ``top`` of the ``prompt`` first slots by its query
    (``methods.omnikv_select.select_by_last_query``, ``selector``) into the selection of ``source`` and attends to
    everything; a segment's sparse layers attend to that selection and every slot after the prompt."""

    evict: str = "none"
    sinks: int = 0
    recent: int = 0
    accumulate: bool = False
    select: str = "none"
    page_size: int = 1
    pages: int = 0
    group_agg: str = "max"
    acc_agg: str = "mean"
    merge: tuple | None = None
    prompt: int = 0
    top: int = 0
    selector: str = "last"
    window_reading: str = "official_code"
    source: int = -1
    #: the method's own step functions (module-level functions, so that a graph's guard on them holds across
    #: sessions): ``merge_step`` evicts through a merge (D2O's ``d2o_ops.static_merge_evict``), ``choose`` writes a
    #: filter layer's choice of prompt slots (OmniKV's ``omnikv_select.static_choice``); the engine imports neither
    merge_step: Callable | None = None
    choose: Callable | None = None

    def __post_init__(self) -> None:
        if self.evict not in EVICTIONS:
            raise ValueError(f"StaticPolicy.evict={self.evict!r}; valid: {', '.join(EVICTIONS)}")
        if self.select not in SELECTIONS:
            raise ValueError(f"StaticPolicy.select={self.select!r}; valid: {', '.join(SELECTIONS)}")
        if self.evict == "merge" and (self.merge is None or self.merge_step is None or not self.accumulate):
            raise ValueError("StaticPolicy: evict='merge' needs its merge step, its parameters and accumulated scores")
        if self.select == "filter" and self.choose is None:
            raise ValueError("StaticPolicy: select='filter' needs the method's choice function (choose)")
        if self.select != "none" and self.evict != "none":
            raise ValueError("StaticPolicy: a page selection runs on a cache that never evicts (slots in position "
                             "order)")


class SlotPool:
    """The buffers of a model's fixed-capacity layers and captured-step state, kept across generations and sessions:
    a buffer of the shape and dtype asked for the same name is handed out again (the same address: a CUDA graph
    replays over it without re-recording), another shape replaces it. One per model (``slot_pool``)."""

    def __init__(self) -> None:
        self._held: dict[tuple, torch.Tensor] = {}

    def take(self, key: tuple, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        held = self._held.get(key)
        if held is None or tuple(held.shape) != tuple(shape) or held.dtype != dtype or held.device != device:
            self._held.pop(key, None)  # freed before its successor is allocated
            held = self._held[key] = torch.zeros(shape, dtype=dtype, device=device)
        return held

    def taker(self, prefix: tuple, device: torch.device) -> Callable[[str, tuple, torch.dtype], torch.Tensor]:
        return lambda name, shape, dtype: self.take((*prefix, name), shape, dtype, device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held.values())

    def clear(self) -> None:
        self._held.clear()


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


class StaticKVLayer(KVLayer):
    """A ``KVLayer`` with a fixed number of slots; ``valid`` marks the occupied ones (always a tensor here)."""

    @classmethod
    def from_layer(cls, layer: KVLayer, extra: int, accumulate: bool, rows: int | None = None,
                   take: Callable[[str, tuple, torch.dtype], torch.Tensor] | None = None) -> StaticKVLayer:
        """The entries of ``layer`` in a layer with ``extra`` free slots per (row, head) after them. Every tensor is
        the first rows of a buffer of ``rows`` rows (the captured step's batch bucket; ``pad_rows`` fills the rest)
        that ``take(name, shape, dtype)`` hands out (``SlotPool.taker``: the same buffers for every generation of the
        same shapes, so a CUDA graph replays over the same addresses), or a new one."""
        ragged = layer.ragged is not None  # each head's kept entries flat (AdaKV's, KVzip's layout): its padded view
        keys, values, valid = layer.attention_view()
        positions = layer.position_view()[0]
        b, h, n, d = keys.shape
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

        new.keys, new.values = place("keys", keys), place("values", values)
        new.positions = place("positions", positions)
        valid = valid if valid is not None else torch.ones(b, h, n, dtype=torch.bool, device=device)
        new.valid = place("valid", valid)
        if accumulate:
            if ragged:
                raise NotImplementedError("a ragged layer's per-entry state has no static form")
            acc = layer.state.get("acc", torch.zeros(b, h, n, device=device, dtype=torch.float32))
            new.state = {"acc": place("state.acc", acc.float())}
        new.row_state = {k: place(f"row_state.{k}", v, slots=False) for k, v in layer.row_state.items()}
        new.seen, new.capacity = layer.seen, layer.capacity
        new.rope_pos = None
        new.last_slot = torch.zeros(b, h, 1, dtype=torch.long, device=device)
        new.captured = False
        return new

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a decode step reads or writes in place: the slots, their positions and validity, the method's
        per-entry and per-row state."""
        return [self.keys, self.values, self.positions, self.valid, *self.state.values(), *self.row_state.values()]

    def _views(self) -> dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], None]]]:
        def setter(name: str) -> Callable[[torch.Tensor], None]:
            if name.startswith("state."):
                return lambda t: self.state.__setitem__(name[6:], t)
            if name.startswith("row_state."):
                return lambda t: self.row_state.__setitem__(name[10:], t)
            return lambda t: setattr(self, name, t)

        return {name: (base, setter(name)) for name, base in self._bases.items()}

    def pad_rows(self, rows: int) -> None:
        """The whole ``rows``-row buffers, the rows after the batch's repeating its last row (a captured step's batch
        bucket: the copies decode what the last row decodes and are dropped; no slot of theirs is empty where the
        row's is not). No allocation: the buffers were allocated at the bucket's rows."""
        b = self.keys.shape[0]
        if rows <= b:
            return
        for base, assign in self._views().values():
            base[b:rows].copy_(base[b - 1 : b].expand(rows - b, *base.shape[1:]))
            assign(base[:rows])

    def keep_rows(self, rows: int) -> None:
        """The first ``rows`` rows only (views: a bucket's extra rows leave the reported bytes)."""
        for base, assign in self._views().values():
            assign(base[:rows])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write one step's key/value ``(B, H, 1, D)`` into the first free slot (a scatter, in place). In a captured
        step (``captured``) the step's attention writes them (``write_step``) and this returns them unchanged: the
        position comes with them there, and the host's count of tokens seen (``seen``) is not read inside a graph."""
        if self.captured:
            return key_states, value_states
        if key_states.shape[-2] != 1:
            raise NotImplementedError("engine.compile decodes one token per step")
        if self.keys.shape[1] > key_states.shape[1]:  # a query-head-granular cache (DynamicKV's official layout)
            rep = self.keys.shape[1] // key_states.shape[1]
            key_states = key_states.repeat_interleave(rep, dim=1)
            value_states = value_states.repeat_interleave(rep, dim=1)
        slot = torch.argmax((~self.valid).to(torch.int8), dim=-1, keepdim=True)  # (B, H, 1): the first free slot
        index = slot.unsqueeze(-1).expand(*slot.shape, self.keys.shape[-1])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        self.positions.scatter_(-1, slot, torch.full_like(slot, self.seen))
        self.valid.scatter_(-1, slot, torch.ones_like(slot, dtype=torch.bool))
        if "acc" in self.state:
            self.state["acc"].scatter_(-1, slot, torch.zeros_like(slot, dtype=self.state["acc"].dtype))
        self.last_slot = slot
        self.seen += 1
        return self.keys, self.values

    def write_step(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor) -> None:
        """A captured step's write: key/value ``(B, Hkv, 1, D)`` at position ``positions`` ``(B, 1)`` into the first
        free slot of every (row, head), as ``update`` and ``assign_positions`` do on the host-driven path."""
        if self.keys.shape[1] > key_states.shape[1]:  # a query-head-granular cache (DynamicKV's official layout)
            rep = self.keys.shape[1] // key_states.shape[1]
            key_states = key_states.repeat_interleave(rep, dim=1)
            value_states = value_states.repeat_interleave(rep, dim=1)
        slot = torch.argmax((~self.valid).to(torch.int8), dim=-1, keepdim=True)  # (B, H, 1)
        index = slot.unsqueeze(-1).expand(*slot.shape, self.keys.shape[-1])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        self.positions.scatter_(-1, slot, positions.view(-1, 1, 1).expand_as(slot))
        self.valid.scatter_(-1, slot, torch.ones_like(slot, dtype=torch.bool))
        if "acc" in self.state:
            self.state["acc"].scatter_(-1, slot, torch.zeros_like(slot, dtype=self.state["acc"].dtype))

    def assign_positions(self, positions: torch.Tensor) -> None:
        """The step's position ``(B, 1, 1)`` (from the model's ``position_ids``) at the slot it was written to."""
        self.positions.scatter_(-1, self.last_slot, positions.expand_as(self.last_slot))

    def resident_bytes(self) -> int:
        """Every slot is allocated, occupied or not: the honest number for a fixed-capacity cache. A layer made from a
        ragged one (heads keeping different numbers) counts the entries its heads hold, as the ragged layer did: the
        padding to the longest head is the captured step's working layout, as a batch bucket's extra rows are."""
        if getattr(self, "kept_bytes_only", False):
            per_entry = self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * \
                self.values.element_size()
            return int(self.valid.sum()) * per_entry
        return super().resident_bytes()

    def valid_counts(self) -> torch.Tensor:
        return self.valid.sum(-1)

    def set_valid(self, valid: torch.Tensor | None) -> None:
        self.valid = valid


def page_selection(keys: torch.Tensor, valid: torch.Tensor, query: torch.Tensor, page_size: int, pages: int,
                   group_agg: str) -> torch.Tensor:
    """Quest's step on a static layer whose slots are in position order (nothing is evicted; slot ``i`` of a row holds
    its ``i``-th entry): the slots ``(B, Hkv, C)`` of the ``pages - 1`` complete-or-partial pages with the highest
    criticality bound ``Σ_c max(q_c m_c, q_c M_c)`` (``engine.scores.page_bounds``) among all but the newest entry's
    page, plus that page. Per-page key minima / maxima are recomputed from the slots (no state; one pass over the
    cache). With fewer pages than ``pages`` every valid page is chosen (Quest's dense step)."""
    b, hkv, c, d = keys.shape
    p = c // page_size
    paged = keys.view(b, hkv, p, page_size, d)
    slot_valid = valid.view(b, hkv, p, page_size)
    empty = ~slot_valid.unsqueeze(-1)
    mins = paged.masked_fill(empty, float("inf")).amin(3)
    maxs = paged.masked_fill(empty, float("-inf")).amax(3)
    bounds = page_bounds(query.view(b, hkv, -1, d), mins, maxs)  # (B, Hkv, g, P)
    scores = bounds.amax(2) if group_agg == "max" else bounds.mean(2)
    last = (valid.sum(-1, keepdim=True) - 1) // page_size  # (B, Hkv, 1): the newest entry's page
    candidate = slot_valid.any(-1).scatter(-1, last, False)
    scores = scores.masked_fill(~candidate, float("-inf"))  # also the NaNs of empty pages' infinite bounds
    chosen = torch.zeros_like(candidate).scatter(-1, torch.topk(scores, pages - 1, dim=-1).indices, True)
    chosen = chosen.scatter(-1, last, True)
    return valid & chosen.repeat_interleave(page_size, dim=-1)


def static_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                acc: torch.Tensor | None, capacity: torch.Tensor, query: torch.Tensor, scaling: float, evict: str,
                sinks: int, recent: int, select: str = "none", page_size: int = 1, pages: int = 0,
                group_agg: str = "max", acc_agg: str = "mean", merge: tuple | None = None,
                row_state: dict[str, torch.Tensor] | None = None, chosen: torch.Tensor | None = None, prompt: int = 0,
                top: int = 0, selector: str = "last", window_reading: str = "official_code",
                rope_inv_freq: torch.Tensor | None = None, merge_step: Callable | None = None,
                choose: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's decode step on a static layer: attention of ``query`` ``(B, Hq, 1, D)`` over the valid slots of
    ``keys``/``values`` ``(B, Hkv, C, D)`` (those of the chosen pages with ``select="pages"``, of OmniKV's selection
    ``chosen`` ``(B, 1, prompt)`` and the slots after the prompt with ``select="segment"``), ``acc`` += the step's
    probabilities (mean, or max with ``acc_agg="max"``, over each GQA group), then, where a (row, head) holds more
    than ``capacity`` ``(B, 1, 1)`` entries, the eviction of one (its ``valid`` bit cleared; merged first with
    ``evict="merge"``, D2O, whose per-row state is ``row_state``). ``select="filter"`` writes this step's choice of
    prompt slots into ``chosen``. Returns the output ``(B, 1, Hq, D)`` and the entries attended per (row, head), a
    device scalar. Pure tensor code without host reads or data-dependent shapes: compiled once by
    ``torch.compile(fullgraph=True)``."""
    b, hq, q, d = query.shape
    hkv, c = keys.shape[1], keys.shape[2]
    qg = query.view(b, hkv, hq // hkv, q, d)
    if select == "pages":
        attended = page_selection(keys, valid, query, page_size, pages, group_agg)
    elif select == "segment":  # the filter layer's choice of prompt slots, and every slot after the prompt
        after = torch.ones(b, 1, c - prompt, dtype=torch.bool, device=valid.device)
        attended = valid & torch.cat([chosen, after], dim=-1)
    else:
        attended = valid
    if select == "filter":  # the method's choice of prompt slots for its segment (OmniKV's filter layer), in place
        choose(query, keys, positions, valid, row_state, chosen, scaling, prompt, top, selector, window_reading,
               rope_inv_freq)
    if acc is None and evict not in ("least_attended", "merge"):
        # no probabilities needed: the fused kernel (SDPA; the GQA group's queries as the query axis of their KV
        # head, so nothing is repeated and no (B, Hkv, g, 1, C) float32 probabilities exist)
        out = torch.nn.functional.scaled_dot_product_attention(
            qg.reshape(b, hkv, -1, d), keys, values, attn_mask=attended.view(b, hkv, 1, c), scale=scaling,
        ).reshape(b, hq, q, d)
        probs = None
    else:
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys).float() * scaling
        logits = logits.masked_fill(~attended.view(b, hkv, 1, 1, -1), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(values.dtype), values).reshape(b, hq, q, d)
    if acc is not None:
        step = probs.sum(3)
        acc.add_(step.mean(2) if acc_agg == "mean" else step.amax(2))
    if evict == "merge":
        count = valid.sum() // valid[..., 0].numel()  # before the eviction: the victim was attended
        merge_step(keys, values, positions, valid, acc, capacity, row_state, *merge)
    elif evict != "none":
        newest = positions.masked_fill(~valid, -1).amax(-1, keepdim=True)
        candidate = valid & (positions >= sinks)
        if evict == "least_attended":  # TOVA: the step's query over all query heads, one entry for every KV head
            key = probs[:, :, :, -1].mean((1, 2)).unsqueeze(1).expand(b, hkv, c).masked_fill(~valid, float("inf"))
        elif evict == "score":
            candidate = candidate & (positions <= newest - recent)
            key = acc.masked_fill(~candidate, float("inf"))
        else:  # the oldest entry after the sinks
            key = positions.masked_fill(~candidate, torch.iinfo(positions.dtype).max)
        victim = torch.argmin(key, dim=-1, keepdim=True)  # (B, H, 1)
        over = valid.sum(-1, keepdim=True) > capacity  # a prompt within the budget keeps growing up to it
        count = valid.sum() // valid[..., 0].numel()  # before the eviction: the victim was attended
        valid.scatter_(-1, victim, torch.gather(valid, -1, victim) & ~over)
    else:
        count = attended.sum() // attended[..., 0].numel()
    return out.transpose(1, 2).contiguous(), count
