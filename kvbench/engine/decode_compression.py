"""Compression during decode (``Method.decode_compression_spec``), kvpress ``DecodingPress``'s loop: per layer, a step
count and a buffer of the recent steps' post-RoPE queries; every ``interval`` decode steps the method compresses the
layer (``Method.compress_decoded``) over everything it holds, with the buffer as the queries. The semantics and where
they differ from kvpress are in ``kvbench.methods.decode_compression``; the engine never names a method."""

from __future__ import annotations

from collections.abc import Callable

import torch

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
