"""A decode step a GPU can run without the host: fixed-capacity cache layers, in-place eviction, one compiled function.

Batch-1 decoding of an 8B model on an H100 is bound by kernel launches and host work, not by memory (issue: GPU-grade
speed): the default decode path builds new cache tensors at every step (``torch.cat``, gathers) and runs Python per
layer. With ``engine.compile=true`` the session converts every layer after prefill into a ``StaticKVLayer``:

* a fixed number of slots ``(B, H, C, D)``: what the method keeps plus the tokens a step adds (budget + 1 for methods
  that evict at every step; kept + the generation's length for methods that never evict after prefill);
* a step writes its key/value into a free slot (``update``: a scatter, no new tensor), attends over the valid slots,
  and an evicting method frees one slot by clearing its ``valid`` bit: no data moves, nothing changes shape;
* ``static_step`` (attention + score accumulation + eviction of one layer) has no host read and no data-dependent
  shape, so ``torch.compile(fullgraph=True)`` captures it once and never recompiles (``tests/test_static_decode.py``
  counts graphs over 32 steps); on CUDA the engine compiles it with ``mode="reduce-overhead"`` (CUDA graphs).

Slots are not in position order (an evicted slot is reused): attention does not care, and positions travel with the
entries. A method opts in with ``Method.static_policy``; one without it (merging, its own attention) refuses
``engine.compile`` with one line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvbench.engine.cache import KVLayer
from kvbench.engine.scores import page_bounds
from kvbench.methods.d2o_ops import static_merge_evict
from kvbench.methods.omnikv_select import select_by_last_query, slide_window, window_choice

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

    def __post_init__(self) -> None:
        if self.evict not in EVICTIONS:
            raise ValueError(f"StaticPolicy.evict={self.evict!r}; valid: {', '.join(EVICTIONS)}")
        if self.select not in SELECTIONS:
            raise ValueError(f"StaticPolicy.select={self.select!r}; valid: {', '.join(SELECTIONS)}")
        if self.evict == "merge" and (self.merge is None or not self.accumulate):
            raise ValueError("StaticPolicy: evict='merge' needs its merge parameters and accumulated scores")
        if self.select != "none" and self.evict != "none":
            raise ValueError("StaticPolicy: a page selection runs on a cache that never evicts (slots in position "
                             "order)")


class StaticKVLayer(KVLayer):
    """A ``KVLayer`` with a fixed number of slots; ``valid`` marks the occupied ones (always a tensor here)."""

    @classmethod
    def from_layer(cls, layer: KVLayer, extra: int, accumulate: bool) -> StaticKVLayer:
        """The entries of ``layer`` in a layer with ``extra`` free slots per (row, head) after them."""
        b, h, n, d = layer.keys.shape
        new = cls()
        new.lazy_initialization(layer.keys, layer.values)
        pad = (0, 0, 0, extra)
        new.keys = torch.nn.functional.pad(layer.keys, pad)
        new.values = torch.nn.functional.pad(layer.values, pad)
        new.positions = torch.nn.functional.pad(layer.positions, (0, extra))
        valid = layer.valid if layer.valid is not None else torch.ones(b, h, n, dtype=torch.bool,
                                                                       device=layer.keys.device)
        new.valid = torch.nn.functional.pad(valid, (0, extra))
        if accumulate:
            acc = layer.state.get("acc", torch.zeros(b, h, n, device=layer.keys.device, dtype=torch.float32))
            new.state = {"acc": torch.nn.functional.pad(acc.float(), (0, extra))}
        new.seen, new.capacity, new.row_state = layer.seen, layer.capacity, dict(layer.row_state)
        new.rope_pos = None
        new.last_slot = torch.zeros(b, h, 1, dtype=torch.long, device=layer.keys.device)
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write one step's key/value ``(B, H, 1, D)`` into the first free slot (a scatter, in place)."""
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

    def assign_positions(self, positions: torch.Tensor) -> None:
        """The step's position ``(B, 1, 1)`` (from the model's ``position_ids``) at the slot it was written to."""
        self.positions.scatter_(-1, self.last_slot, positions.expand_as(self.last_slot))

    def resident_bytes(self) -> int:
        """Every slot is allocated, occupied or not: the honest number for a fixed-capacity cache."""
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
                rope_inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    if select == "filter" and selector in ("uniform", "exp"):  # OmniKV's window of recent queries (row_state)
        newest = positions[:, 0].masked_fill(~valid[:, 0], -1).amax(-1)  # (B,): this step's token
        slide_window(row_state["omnikv_window_q"], row_state["omnikv_window_pos"], query, newest)
        chosen.copy_(window_choice(row_state["omnikv_window_q"], row_state["omnikv_window_pos"], keys[:, :, :prompt],
                                   scaling, top, selector, window_reading, rope_inv_freq).unsqueeze(1))
    elif select == "filter":  # OmniKV's filter layer: the top prompt slots by this step's query, for its segment
        index = select_by_last_query(query, keys[:, :, :prompt], scaling, top, softmax=selector != "last")
        chosen.copy_(torch.zeros_like(chosen).scatter_(-1, index.unsqueeze(1), True))
    logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys).float() * scaling
    logits = logits.masked_fill(~attended.view(b, hkv, 1, 1, -1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(values.dtype), values).reshape(b, hq, q, d)
    if acc is not None:
        step = probs.sum(3)
        acc.add_(step.mean(2) if acc_agg == "mean" else step.amax(2))
    if evict == "merge":
        count = valid.sum() // valid[..., 0].numel()  # before the eviction: the victim was attended
        static_merge_evict(keys, values, positions, valid, acc, capacity, row_state, *merge)
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


@functools.cache
def compiled_step(backend: str | None, mode: str | None):
    """``static_step`` compiled once per (backend, mode) for the process: sessions share the graphs. Each policy (the
    eviction and selection kinds, their sizes) is a graph of its own, all cached on ``static_step``'s code object: a
    process that decodes with several methods (a test session, a sweep run in one process) holds more than dynamo's
    default limit of 8, which under ``fullgraph=True`` raises instead of falling back, so the limit is raised."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7: the old name
    setattr(config, name, max(getattr(config, name), 64))
    # a method's float hyperparameters (D2O's beta) stay constants of their graph: torch 2.6 otherwise turns a float
    # that differs between two compiled calls into a 0-d tensor read back with .item(), which fullgraph refuses
    config.specialize_float = True
    options = {"backend": backend} if backend is not None else {"mode": mode}
    return torch.compile(static_step, fullgraph=True, **options)

