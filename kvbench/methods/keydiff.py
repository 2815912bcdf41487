"""KeyDiff: keep the keys least similar to the mean key direction.

Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained
Environments" (arXiv:2504.15364); kvpress ``KeyDiffPress`` and ``BlockPress``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvbench.errors import NotAvailableError
from kvbench.methods.base import PrefillContext, check_choice, check_positive, host_ints, keep_entries
from kvbench.methods.scorer import ScorerMethod

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

MODES = ("block", "whole_prompt")


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """``-cos(k_i, a)`` per entry ``(..., n)`` of keys ``(..., n, D)``, with the anchor ``a`` the mean of the
    L2-normalised keys (kvpress's ``KeyDiffPress.score``): the more distinctive a key, the higher its score."""
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)
    return -F.cosine_similarity(keys, anchor, dim=-1)


def block_keep(keys: torch.Tensor, keep: int, block: int) -> torch.Tensor:
    """KeyDiff's block-wise prompt processing on keys ``(B, H, n, D)``: start with the first ``keep`` tokens; for each
    following block of ``block`` tokens, score the kept tokens and the block together (the anchor of that set) and
    keep the top ``keep``. Returns the kept entry indices ``(B, H, keep)`` (kvpress ``BlockPress`` order of work).

    ``keydiff_scores`` of each set, with what depends on a key alone computed once for the prompt: its direction for
    the anchor (``F.normalize``, eps 1e-12) and for the cosine (``F.cosine_similarity``'s ``k / max(|k|, 1e-8)``),
    gathered per block; per block the anchor, its direction and the products remain (13 kernels, not 21: the loop is
    sequential, one step per block). The same operations on the same values: the scores are equal bit for bit."""
    b, h, n, d = keys.shape
    norms = torch.linalg.vector_norm(keys, 2, dim=-1, keepdim=True)
    unit = keys / norms.clamp_min(1e-12)  # F.normalize
    unit_cos = keys / norms.clamp_min(1e-8)  # F.cosine_similarity's division of each key by its norm
    kept = torch.arange(keep, device=keys.device).expand(b, h, keep)
    for start in range(keep, n, block):
        stop = min(start + block, n)
        cand = torch.cat([kept, torch.arange(start, stop, device=keys.device).expand(b, h, stop - start)], dim=-1)
        index = cand.unsqueeze(-1).expand(*cand.shape, d)
        anchor = torch.gather(unit, 2, index).mean(dim=-2, keepdim=True)
        anchor = anchor / torch.linalg.vector_norm(anchor, 2, dim=-1, keepdim=True).clamp_min(1e-8)
        scores = -(torch.gather(unit_cos, 2, index) * anchor).sum(-1)
        kept = torch.gather(cand, -1, scores.topk(keep, dim=-1).indices)
    return kept


@dataclass
class KeyDiff(ScorerMethod):
    """Prefill-only: per layer and KV head, keep the ``budget`` prompt tokens whose keys are least cosine-similar to
    the anchor (the mean of the normalised keys), the paper's eviction score.

    ``mode="block"`` (default): the paper's block-wise iteration (it evicts while the prompt is processed in blocks
    under a fixed cache): the first ``budget`` tokens, then each block of ``block_size`` tokens scored together with
    what is kept so far, the top ``budget`` kept (kvpress ``BlockPress(KeyDiffPress)``, which kvpress names as the
    paper's procedure; like BlockPress the prompt's attention is still computed over the whole prompt in one pass).
    ``block_size=128`` is BlockPress's default. ``mode="whole_prompt"``: one scoring over the whole prompt (kvpress's
    ``KeyDiffPress`` alone). No window and no sinks in either mode.
    ``mode="whole_prompt"`` selects as every scorer does (``ScorerMethod``); the block mode overrides ``prefill``.
    """

    name: ClassVar[str] = "keydiff"
    compression: ClassVar[str] = "prefill"
    mode: str = "block"
    block_size: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "mode", self.mode, MODES)
        check_positive(self.name, block_size=self.block_size)

    def scores_available(self) -> bool:
        return self.mode == "whole_prompt"

    def score(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """The whole-prompt scores (``mode=whole_prompt``). The block mode's kept set comes from a sequence of
        scorings of different sets, not one score per entry: refused (no wrapper can take its place faithfully)."""
        if self.mode != "whole_prompt":
            raise NotAvailableError("method 'keydiff' mode=block has no single score per entry (each block is scored "
                                    "against what is kept so far); use the scorer keydiff with mode=whole_prompt")
        return self._whole_prompt_scores(layer, ctx)

    def _whole_prompt_scores(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        keys = layer.keys.float()
        if ctx.key_valid is None:
            return keydiff_scores(keys)
        scores = torch.full(keys.shape[:3], float("-inf"), device=keys.device)
        for row in range(keys.shape[0]):  # the anchor is the mean over the row's own tokens, padding excluded
            valid = ctx.row_tokens(row)  # (left padding: a slice of host ints, so indexing reads nothing back)
            scores[row][:, valid] = keydiff_scores(keys[row][:, valid])
        return scores

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if self.mode == "whole_prompt":
            super().prefill(layer, ctx)
            return
        if ctx.fits():
            return
        keys, caps = layer.keys.float(), host_ints(layer, ctx.capacity)
        if ctx.key_valid is None and len(set(caps)) == 1:
            kept = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device)
            kept.scatter_(-1, block_keep(keys, caps[0], self.block_size), True)
        else:  # row by row on the row's own tokens, as the row alone
            kept = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device)
            for row, cap in enumerate(caps):
                where = torch.arange(keys.shape[2], device=keys.device)[ctx.row_tokens(row)]  # (no read: a slice)
                if len(where) <= cap:
                    kept[row][:, where] = True
                    continue
                index = block_keep(keys[row : row + 1, :, where], cap, self.block_size)[0]
                kept[row].scatter_(-1, where[index], True)
        keep_entries(layer, kept)
