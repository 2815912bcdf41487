"""KVzip: keep the context entries the model attends to most while it reconstructs the context (query-agnostic).

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv:2505.23416), code
snu-mllab/KVzip; kvpress ``KVzipPress`` for the repeat prompt, the chunking and the allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.errors import NotAvailableError
from kvbench.methods.base import Method, PrefillContext, check_choice, check_positive, keep_entries
from kvbench.methods.kvzip_ops import (
    BLOCK_ELEMENTS,
    FIRST_CHUNK_PROMPT,
    LATER_CHUNK_PROMPT,
    PASS_ELEMENTS,
    PREVIOUS_TAIL_TOKENS,
    kvzip_keep,
    reconstruction_scores,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: ``ragged`` (default): each head holds only the entries it keeps, flat; ``padded``: each layer as long as its longest
#: head, the other heads' empty slots allocated (and counted in resident bytes)
LAYOUTS = ("ragged", "padded")


def chat_suffix(tokenizer: Any) -> str:
    """What follows the repeat prompt, as kvpress derives it: the chat template's text after a user turn (the
    assistant header), or a newline for a tokenizer without a chat template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "\n"
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
    return text.split(separator)[1]


@dataclass
class KVzip(Method):
    """After the prompt's forward, the model is fed, chunk by chunk (``chunk_size`` prompt tokens), "Repeat the
    previous context exactly." (later chunks: "Repeat the part of the previous context exactly, starting with" and the
    previous chunk's last 8 tokens), the chat template's assistant header and the chunk's own tokens, with the cache
    attached (``needs_reconstruction``: the session runs these forwards and then forgets their tokens). An entry's
    score is the max attention it receives from those queries (over the query heads of its KV group; the softmax over
    the first ``n_sink`` entries, the chunk and the repeat tokens, as kvpress; ``kvzip_ops``). The first ``n_sink``
    entries always stay.

    Budget: C tokens per layer on average. ``layerwise=False`` (kvpress's default): the L·H·(n − C) lowest scores of all
    layers and heads leave, so layers and heads keep different numbers; ``layerwise=True``: H·(n − C) per layer, over
    its heads. Memory (``layout="ragged"``, default): every head holds only the entries it keeps, flat per head
    (``KVLayer.to_ragged``; attention reads a padded copy built per layer per step), so resident bytes are the L·H·C
    kept entries' plus the decoded tokens; ``layout="padded"``: each layer is a ``(B, H, n, D)`` tensor as long as its
    longest head, the other heads' empty slots allocated and counted in resident bytes. The whole prompt is the context
    (kvpress skips the chat template's prefix before the context; kvbench prompts carry no such boundary). Batch 1 only
    (kvpress scores one row); full-attention layers only.
    """

    name: ClassVar[str] = "kvzip"
    compression: ClassVar[str] = "prefill"
    capacities_from_content: ClassVar[bool] = True  # each layer's and head's count follows the scores
    supports_batching: ClassVar[bool] = False
    needs_reconstruction: ClassVar[bool] = True
    layerwise: bool = False
    n_sink: int = 4
    chunk_size: int = 2048
    layout: str = "ragged"

    def __post_init__(self) -> None:
        check_positive(self.name, chunk_size=self.chunk_size)
        check_choice(self.name, "layout", self.layout, LAYOUTS)
        if self.n_sink < 0:
            raise NotAvailableError(f"method 'kvzip': n_sink={self.n_sink} must be >= 0")
        self._scores: dict[int, torch.Tensor] = {}
        self._capacity: int | None = None

    def ragged_cache(self) -> bool:
        return self.layout == "ragged"

    def min_budget_tokens(self) -> int:
        return max(1, self.n_sink)

    def min_budget_reason(self) -> str:
        return f"the {self.n_sink} sink tokens always stay"

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.key_valid is not None or ctx.queries.shape[0] != 1:
            raise NotAvailableError("method 'kvzip' scores one prompt at a time (batch_size=1)")
        self._capacity = ctx.host_ints()[1][0]
        self._scores[ctx.layer_idx] = torch.zeros(layer.keys.shape[:3], dtype=torch.float32, device=layer.keys.device)

    def reconstruction_chunks(self, prompt_ids: list[int], tokenizer) -> list[tuple[int, int, list[int]]]:
        if self._capacity is None or self._capacity >= len(prompt_ids):
            return []  # the prompt fits the budget: nothing to score
        encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        suffix = encode(chat_suffix(tokenizer))
        chunks = [prompt_ids[i : i + self.chunk_size] for i in range(0, len(prompt_ids), self.chunk_size)]
        out, start = [], 0
        for i, chunk in enumerate(chunks):
            prompt = encode(FIRST_CHUNK_PROMPT) if i == 0 else \
                encode(LATER_CHUNK_PROMPT) + chunks[i - 1][-PREVIOUS_TAIL_TOKENS:]
            out.append((start, start + len(chunk), prompt + suffix + chunk))
            start += len(chunk)
        return out

    def score_reconstruction(self, layer_idx: int, layer: KVLayer, query: torch.Tensor, start: int, end: int,
                             scaling: float, few_kernels: bool = False) -> None:
        scores = self._scores[layer_idx]
        if layer.num_entries - query.shape[2] != scores.shape[-1]:
            raise NotAvailableError("method 'kvzip' compresses full-attention layers only (sliding_layers=window)")
        block = PASS_ELEMENTS if few_kernels else BLOCK_ELEMENTS  # a GPU: a few blocks per chunk, not hundreds
        scores[..., start:end] = reconstruction_scores(query, layer.keys, start, end, self.n_sink, scaling,
                                                       block).float()

    def finish_reconstruction(self, layers: list[KVLayer]) -> None:
        scores = torch.stack([self._scores.pop(i) for i in range(len(layers))])  # (L, 1, H, n)
        self._scores.clear()
        n_layers, _, h, n = scores.shape
        if self._capacity is None or self._capacity >= n:
            return
        per_layer = h * (n - self._capacity)
        keep = kvzip_keep(scores, per_layer if self.layerwise else n_layers * per_layer, self.layerwise, self.n_sink)
        for layer, kept in zip(layers, keep):
            if self.layout == "ragged":
                layer.to_ragged(kept)
            else:
                keep_entries(layer, kept)
