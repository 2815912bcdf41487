"""POD's block map: the JSON ``python -m kvbench.analysis.pod_grouping`` writes (consecutive layers grouped per KV head,
paper 004 §2.1) read and checked, and what the method needs from it: each layer's source layer per KV head, and the
layers whose distant keys can go (non-lowest for every KV head)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvbench.errors import ConfigError


def load_block_map(path: str | Path) -> dict:
    """Read a block map written by ``kvbench.analysis.pod_grouping`` and normalise ``blocks`` to per KV head.

    ``granularity: kv_head``: ``blocks[h]`` is the list of blocks of KV head h; ``granularity: layer``: ``blocks``
    is one list of blocks shared by every KV head.
    """
    try:
        raw = Path(path).read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"method 'pod': block_map={str(path)!r} cannot be read ({exc})") from None
    data["sha256"] = hashlib.sha256(raw).hexdigest()
    blocks = data.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        raise ConfigError(f"method 'pod': block_map={str(path)!r} has no 'blocks' list")
    if data.get("granularity", "kv_head") == "layer" or isinstance(blocks[0][0], int):
        data["per_head"] = None
    else:
        data["per_head"] = blocks
    return data


def lowest_layers(blocks: list[list[int]], num_layers: int) -> list[int]:
    """For one head: the lowest layer of each layer's block. Blocks must be consecutive and cover 0..L-1."""
    flat = [layer for block in blocks for layer in block]
    if flat != list(range(num_layers)):
        raise ConfigError(f"method 'pod': blocks {blocks} are not consecutive blocks covering {num_layers} layers")
    return [min(block) for block in blocks for _ in block]


def lowest_per_layer(block_map: dict | None, num_layers: int, num_kv_heads: int) -> list[list[int]]:
    """``lowest[layer][h]``: the lowest layer of ``layer``'s block for KV head h (the layer itself without a map)."""
    if block_map is None:
        return [[layer] * num_kv_heads for layer in range(num_layers)]
    if block_map.get("num_layers", num_layers) != num_layers:
        raise ConfigError(f"method 'pod': block_map is for {block_map['num_layers']} layers, the model has "
                          f"{num_layers}")
    blocks = block_map["per_head"] or [block_map["blocks"]] * num_kv_heads
    if len(blocks) != num_kv_heads:
        raise ConfigError(f"method 'pod': block_map has {len(blocks)} KV heads, the model has {num_kv_heads}")
    per_head = [lowest_layers(b, num_layers) for b in blocks]
    return [[per_head[h][layer] for h in range(num_kv_heads)] for layer in range(num_layers)]


def trimmed_layers(block_map: dict) -> set[int]:
    """Layers that are non-lowest for every KV head: they keep keys only for their proximal tokens."""
    heads = block_map["per_head"] or [block_map["blocks"]]
    return set.intersection(*({layer for block in blocks for layer in block if layer != min(block)}
                              for blocks in heads))
