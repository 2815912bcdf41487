"""A random Llama built from a config: real tokenizer (SmolLM2's), seeded random weights, no weights file.

Tests of methods and of the engine need a model that loads in well under a second and behaves the same on every
run; a seeded ``LlamaForCausalLM`` built from a ``LlamaConfig`` is that. The same builder makes full-size shapes
(``conf/model/llama3-8b-random.yaml``) for **timing and memory only** where the real weights are not at hand: speed
and memory depend on the shapes, not on the weights, while what a method keeps (and so every quality number) does.
torch and transformers are imported inside the builder so that validating a ``tiny`` block stays free of heavy imports.
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
    "vocab": 0,  # 0: the tokenizer's size (49152); Llama-3's 128256 for its LM head's true size
    "tie_embeddings": 1,  # 1: the LM head shares the embedding (SmolLM2); 0: its own matrix (Llama-3-8B)
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
        minimum = 0 if key in ("seed", "vocab", "tie_embeddings") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"model.tiny.{key} must be an integer >= {minimum}, got {value!r}")
    if arch["tie_embeddings"] not in (0, 1):
        raise ConfigError(f"model.tiny.tie_embeddings must be 0 or 1, got {arch['tie_embeddings']!r}")
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
    device: str = "cpu",
    dtype: Any = None,
) -> Any:
    """A ``LlamaForCausalLM`` with weights drawn from ``torch.manual_seed(arch['seed'])`` on ``device`` in ``dtype``.

    The weights are drawn where the model will run and in its dtype (an 8B model is never materialised in float32
    on the host first); the global RNG (and that device's) is forked around construction, so building the model
    neither depends on nor disturbs the caller's random state: two builds with the same ``arch`` on the same kind of
    device give identical weights (a CUDA build draws from CUDA's generator, so its weights differ from a CPU build's).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = dtype or torch.float32
    target = torch.device(device)
    if arch["vocab"] and arch["vocab"] < vocab_size:
        raise ConfigError(f"model.tiny.vocab ({arch['vocab']}) is smaller than the tokenizer's {vocab_size} tokens; "
                          f"use 0 (the tokenizer's size) or a value >= {vocab_size}")

    config = LlamaConfig(
        vocab_size=arch["vocab"] or vocab_size,
        hidden_size=arch["hidden"],
        intermediate_size=arch["intermediate"],
        num_hidden_layers=arch["layers"],
        num_attention_heads=arch["heads"],
        num_key_value_heads=arch["kv_heads"],
        head_dim=arch["head_dim"],
        max_position_embeddings=context_length,
        tie_word_embeddings=bool(arch["tie_embeddings"]),
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        attn_implementation=attn_implementation,
    )
    rng_devices = [target.index or 0] if target.type == "cuda" else []
    previous = torch.get_default_dtype()
    try:
        with torch.random.fork_rng(devices=rng_devices), target:
            torch.set_default_dtype(dtype)
            torch.manual_seed(arch["seed"])
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype=dtype)
