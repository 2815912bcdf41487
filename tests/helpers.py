"""Small builders shared by the tests (tensor-level method tests need no model)."""

from __future__ import annotations

import torch

from kvbench.engine.cache import KVLayer
from kvbench.methods.base import DecodeContext, PrefillContext


def make_layer(keys: torch.Tensor, values: torch.Tensor) -> KVLayer:
    layer = KVLayer()
    layer.update(keys, values)
    return layer


def prefill_ctx(queries, layer, capacity, layer_idx=0, num_layers=1, key_valid=None) -> PrefillContext:
    b, hq, n, d = queries.shape
    prompt_lens = key_valid.sum(-1) if key_valid is not None else torch.full((b,), n)
    return PrefillContext(
        layer_idx=layer_idx, num_layers=num_layers, num_heads=hq, num_kv_heads=layer.keys.shape[1],
        scaling=d**-0.5, queries=queries, key_valid=key_valid, prompt_lens=prompt_lens,
        capacity=torch.full((b,), capacity) if isinstance(capacity, int) else capacity,
    )


def decode_step(method, layer: KVLayer, query, key, value, capacity: int):
    """Append one token and run the method's decode hook with exact attention probabilities, as the engine does."""
    from kvbench.engine.attention import grouped_attention

    layer.update(key, value)
    _, probs = grouped_attention(query, layer.keys, layer.values, None, query.shape[-1] ** -0.5)
    ctx = DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=layer.keys.shape[1], query=query, probs=probs,
                        capacity=torch.full((query.shape[0],), capacity))
    method.decode(layer, ctx)


def kept_positions(layer: KVLayer, row: int = 0) -> list[list[int]]:
    """Sorted kept original positions per head of one row."""
    out = []
    for h in range(layer.positions.shape[1]):
        pos = layer.positions[row, h]
        if layer.valid is not None:
            pos = pos[layer.valid[row, h]]
        out.append(sorted(int(p) for p in pos))
    return out
