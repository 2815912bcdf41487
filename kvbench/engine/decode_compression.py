"""Compression during decode (``Method.decode_compression_spec``), kvpress ``DecodingPress``'s loop: per layer, a step
count and a buffer of the recent steps' post-RoPE queries; every ``interval`` decode steps the method compresses the
layer (``Method.compress_decoded``) over everything it holds, with the buffer as the queries. The semantics and where
they differ from kvpress are in ``kvbench.methods.decode_compression``; the engine never names a method."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvbench.budget import Budget
from kvbench.methods.base import DecodeCompression, PrefillContext  # the method contract


class DecodeCompressor:
    """The per-layer state of one generation (reset at every prefill)."""

    def __init__(self, spec: DecodeCompression):
        self.spec = spec
        self.buffers: dict[int, list[torch.Tensor]] = {}
        self.counts: dict[int, int] = {}
        #: per layer, the decode steps at which it was compressed (1-based step counts of the generation)
        self.compressions: dict[int, list[int]] = {}

    def reset(self) -> None:
        self.buffers.clear()
        self.counts.clear()
        self.compressions.clear()

    def after_step(self, layer_idx: int, query: torch.Tensor, target_for: Callable[[], int],
                   compress: Callable[[torch.Tensor, int], None], step: int) -> bool:
        """After a decode forward of layer ``layer_idx`` (its entries appended): buffer its queries ``(B, Hq, q, D)``,
        count the step, and at the ``interval``-th step (or a forward of at least the target's tokens) call
        ``compress(queries, target)`` with the buffered queries ``(B, Hq, m, D)``. True when it compressed."""
        spec = self.spec
        buffer = self.buffers.setdefault(layer_idx, [])
        buffer.append(query)
        self.counts[layer_idx] = self.counts.get(layer_idx, 0) + 1
        target = target_for()
        compressed = False
        if self.counts[layer_idx] >= spec.interval or query.shape[2] >= target:
            compress(torch.cat(buffer, dim=2), target)
            self.counts[layer_idx] = 0
            buffer.clear()  # kvpress: the buffered queries and the cache would no longer match
            self.compressions.setdefault(layer_idx, []).append(step)
            compressed = True
        # kvpress keeps the last hidden_states_buffer_size forwards (none at 0) after every step
        del buffer[: max(0, len(buffer) - spec.query_buffer)]
        return compressed


def decode_context(layer, queries: torch.Tensor, target: int, layer_idx: int, num_layers: int, num_heads: int,
                   scaling: float, rope_inv_freq: torch.Tensor | None = None,
                   few_kernels: bool = False) -> PrefillContext:
    """A decode-time compression's ``PrefillContext``: every entry the layer holds is the "prompt" (its rows' valid
    entries their lengths), ``queries`` ``(B, Hq, m, D)`` the buffered recent queries (the newest ``m`` entries'),
    ``target`` each row's capacity (at most what it holds). ``key_valid`` ``(B, n)``: an entry valid in some head of
    its row (the method's scores are then masked per head by ``keep_top``'s own validity)."""
    b, device = layer.keys.shape[0], layer.keys.device
    valid = layer.valid
    key_valid = None if valid is None else valid.any(1)
    lens = [layer.num_entries] * b if valid is None else [int(x) for x in key_valid.sum(-1).tolist()]
    caps = [min(target, n) for n in lens]
    return PrefillContext(
        layer_idx=layer_idx, num_layers=num_layers, num_heads=num_heads, num_kv_heads=layer.keys.shape[1],
        scaling=scaling, queries=queries, key_valid=key_valid, prompt_lens=torch.tensor(lens, device=device),
        capacity=torch.tensor(caps, device=device), rope_inv_freq=rope_inv_freq, plain_causal=False,
        few_kernels=few_kernels, host=(lens, caps),
    )


#: steps ahead the host looks for a method's next scheduled ``after_decode_forward`` (``CapturedCompression.due_in``):
#: past it a block of captured steps runs whole (a block is at most ``engine.graph.READ_EVERY`` steps)
DUE_HORIZON = 256


class CapturedCompression:
    """Compression during decode with the captured decode step (``engine.decode=graph``): the state of one generation.

    Every compressing layer is a ``StaticKVLayer`` that appends (``StaticKVLayer.fill``: slots ``[0, fill)`` laid out
    as the eager layer holds them), and its step writes its post-RoPE query ``(B, Hq, 1, D)`` into a ring ``(rows, Hq,
    R, D)`` of the model's ``SlotPool`` (``write``: pure tensor code, inside the captured step), ``R = min(interval,
    query_buffer + 1)``, the most queries a compression scores with. Every layer counts every decode step, so all
    compress at the same step: the host cuts the captured loop there (``due_in``) and compresses each layer eagerly
    (the session's ``_compress_captured``) with the ring's newest ``min(count, R)`` queries in step order
    (``queries``): ``DecodeCompressor``'s buffer at its compressions (appended, then trimmed to ``query_buffer``
    after each step, cleared at a compression).

    A method whose cross-layer ``after_decode_forward`` acts at forwards that host counts name (``Method.
    after_decode_forward_due``: TriAttention's trigger on the entries held and the tokens seen) runs the same way
    with ``due`` instead of ``spec``: the layers append, no query is kept, the host cuts the captured loop at the
    forward where ``due(entries, seen)`` holds and calls ``after_decode_forward`` there with every compressed layer as
    the host-driven path holds it (the session's ``_after_forward_captured``)."""

    def __init__(self, spec: DecodeCompression | None, due: Callable[[int, int], bool] | None = None):
        if (spec is None) == (due is None):
            raise ValueError("CapturedCompression: a decode compression's spec or a method's schedule, one of them")
        self.spec = spec
        #: the method's schedule (``Method.after_decode_forward_due``), or None for a per-layer decode compression
        self.due = due
        self.ring_len = 0 if spec is None else min(spec.interval, spec.query_buffer + 1)
        #: per compressing layer: the host's ``KVLayer`` the method compresses (the prefill's own object, so a method
        #: that remembers its layer between compressions, R-KV's code order, sees the one it saw), the ring's base and
        #: its next column (a 0-d device tensor), the slots in use (host ints)
        self.layers: dict[int, object] = {}
        self.rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fill: dict[int, int] = {}
        self.scaling: dict[int, float] = {}
        self.count = 0  # decode steps since the last compression
        self.written = 0  # decode steps written into the rings
        #: per decode step, the entries each layer held after it (``log``), the last ``LOG_STEPS`` steps: where the
        #: generation ended (the captured loop runs up to a read block past it) for its final resident bytes
        self.held: dict[int, dict[int, int]] = {}

    #: steps of ``held`` kept: more than a read block (``engine.graph.READ_EVERY``) of steps run past the end
    LOG_STEPS = 64

    def log(self, step: int, layer_idx: int, entries: int) -> None:
        """Layer ``layer_idx`` held ``entries`` entries after decode step ``step``."""
        self.held.setdefault(step, {})[layer_idx] = entries
        self.held.pop(step - self.LOG_STEPS, None)

    def held_at(self, step: int, layer_idx: int) -> int | None:
        """The entries layer ``layer_idx`` held after decode step ``step`` (one of the last ``LOG_STEPS``), or None
        where that step was not logged."""
        return self.held.get(step, {}).get(layer_idx)

    def write(self, layer_idx: int, query: torch.Tensor) -> None:
        """The step's query ``(B, Hq, 1, D)`` into the layer's ring at its next column (no host read)."""
        base, column = self.rings[layer_idx]
        base[: query.shape[0]].index_copy_(2, column.view(1), query)
        column.copy_((column + 1) % base.shape[2])

    def due_in(self, entries: int, seen: int, horizon: int = DUE_HORIZON) -> int | None:
        """Under a method's schedule: the decode steps from a layer holding ``entries`` entries with ``seen`` tokens
        seen until the forward after which the method acts (1: the next one), or None within ``horizon`` steps."""
        return next((k for k in range(1, horizon + 1) if self.due(entries + k, seen + k)), None)

    def extra_slots(self, held: int, seen: int, budget: Budget, reserve: int) -> int:
        """Free slots a layer holding ``held`` entries (``seen`` tokens seen) needs after them until its first
        compression in a generation appending up to ``reserve`` tokens: up to its target (or what it holds) plus one
        interval; under a method's schedule, up to the forward it acts at (every token where it does not within
        ``reserve``; a layout that then needs more grows: the session's ``_grow_captured``)."""
        if self.due is not None:
            return max(1, self.due_in(held, seen, reserve) or reserve)
        target = self.spec.target(1 << 40, budget)  # the most: not a ratio (graph_refusal)
        return max(1, min(reserve, max(held, target) + self.interval(target) - held))

    def interval(self, target: int) -> int:
        """Steps between compressions (a target of one entry: every step, as ``DecodeCompressor``'s forward of at
        least the target's tokens)."""
        return 1 if target <= 1 else self.spec.interval

    def queries(self, layer_idx: int, rows: int) -> torch.Tensor:
        """The buffered queries ``(rows, Hq, m, D)`` in step order: the newest ``min(count, R)`` steps'."""
        base, _ = self.rings[layer_idx]
        m = min(self.count, self.ring_len)
        columns = torch.tensor([(self.written - m + j) % self.ring_len for j in range(m)], device=base.device)
        return base[:rows].index_select(2, columns)


def graph_refusal(method: Any, spec: DecodeCompression | None, budget: Budget) -> str | None:
    """Why a configured decode compression cannot run inside the captured decode step (``engine.decode=graph``), one
    line, or None. The captured step appends into fixed slots (the target plus one interval) and the host compresses
    every ``interval`` steps between blocks of captured steps; a target that grows with the tokens seen would need
    slots for the whole generation, and a method whose captured step evicts or selects at every step has no host
    compression to interleave with (its eager path runs both)."""
    if spec is None or budget.is_full:
        return None
    if spec.compression_ratio is not None:
        return (f"decode_compression.compression_ratio={spec.compression_ratio} keeps a share of the tokens seen, a "
                "target that grows with the generation (fixed slots would have to hold all of it)")
    if spec.target_size is None and budget.kind != "tokens":
        return (f"budget={budget.label()} is a ratio: the decode target grows with the tokens seen (fixed slots would "
                "have to hold all of it); give budget=<tokens> or decode_compression.target_size")
    policy = method.static_policy(1 << 30)
    if policy is not None and (policy.evict is not None or policy.attend is not None or policy.choose is not None
                               or policy.accumulate or policy.attention is not None or policy.state):
        return "its captured step also evicts or selects at every step (only appending steps are compressed there)"
    return None
