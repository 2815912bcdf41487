"""K-norm: keep the keys with the lowest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024,
arXiv:2406.11430); kvpress ``KnormPress``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.methods.base import PrefillContext
from kvbench.methods.scorer import ScorerMethod

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


def knorm_scores(keys: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``-||k||_2`` per entry ``(B, H, n)`` from keys ``(B, H, n, D)`` (post-RoPE, as cached: RoPE is a rotation and
    leaves the norm unchanged), accumulated in at least float32 as kvpress does so that a bfloat16 cache does not tie
    distinct norms; padding ``-inf``."""
    dtype = torch.promote_types(keys.dtype, torch.float32)
    scores = -torch.linalg.vector_norm(keys, dim=-1, dtype=dtype)
    if key_valid is not None:
        scores = scores.masked_fill(~key_valid[:, None], float("-inf"))
    return scores


@dataclass
class KNorm(ScorerMethod):
    """Prefill-only: per layer and KV head, keep the ``budget`` prompt tokens whose keys have the smallest L2 norm
    (the paper's finding: low-norm keys draw high attention). No window, no sinks: the score alone decides, as in the
    paper and kvpress (a first token with a small norm is kept because of its norm). Every layer is compressed.
    Selection is ``torch.topk`` of the scores (kvpress's ``ScorerPress.compress``; ``ScorerMethod``); kept tokens stay
    in position order.
    """

    name: ClassVar[str] = "knorm"
    compression: ClassVar[str] = "prefill"

    def score(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        return knorm_scores(layer.keys, ctx.key_valid)
