"""A small random Llama for unit tests: real tokenizer (SmolLM2's), random weights, no weights file.

Tests of methods and of the engine need a model that loads in well under a second and behaves the same on every
run; a seeded ``LlamaForCausalLM`` built from a ``LlamaConfig`` is that. torch and transformers are imported inside
the builder so that validating a ``tiny`` block stays free of heavy imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbench.errors import ConfigError

# Keys of ModelSpec.tiny and their defaults: GQA with 2 query heads per KV head, so grouping bugs show up.
TINY_DEFAULTS: dict[str, int] = {
    "layers": 4,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "hidden": 64,
    "intermediate": 128,
    "seed": 0,
}


def resolve_tiny(tiny: Mapping[str, Any]) -> dict[str, int]:
    """The complete tiny architecture (defaults filled in), or ConfigError naming the bad key or value."""
    unknown = sorted(set(tiny) - set(TINY_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"model.tiny has no key(s) {', '.join(unknown)}; valid keys: {', '.join(TINY_DEFAULTS)}"
        )
    arch = {**TINY_DEFAULTS, **dict(tiny)}
    for key, value in arch.items():
        minimum = 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"model.tiny.{key} must be an integer >= {minimum}, got {value!r}")
    if arch["heads"] % arch["kv_heads"]:
        raise ConfigError(
            f"model.tiny.heads ({arch['heads']}) must be a multiple of model.tiny.kv_heads ({arch['kv_heads']})"
        )
    if arch["hidden"] % arch["heads"]:  # transformers' LlamaConfig rejects it, with a multi-line traceback
        raise ConfigError(
            f"model.tiny.hidden ({arch['hidden']}) must be a multiple of model.tiny.heads ({arch['heads']})"
        )
    return arch


def build_tiny_llama(
    arch: Mapping[str, int],
    *,
    vocab_size: int,
    context_length: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
    attn_implementation: str,
) -> Any:
    """A float32 ``LlamaForCausalLM`` with weights drawn from ``torch.manual_seed(arch['seed'])``.

    The global RNG is forked around construction, so building the model neither depends on nor disturbs the
    caller's random state: two builds with the same ``arch`` give identical weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=arch["hidden"],
        intermediate_size=arch["intermediate"],
        num_hidden_layers=arch["layers"],
        num_attention_heads=arch["heads"],
        num_key_value_heads=arch["kv_heads"],
        head_dim=arch["head_dim"],
        max_position_embeddings=context_length,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(arch["seed"])
        model = LlamaForCausalLM(config)
    return model
