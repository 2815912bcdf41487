"""ChunkKV: keep whole chunks of consecutive tokens, ranked by a scorer's summed scores.

Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference"
(arXiv:2502.00299); kvpress ``ChunkKVPress``. Wraps any method with ``prefill_scores``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.errors import ConfigError
from kvbench.methods.base import PrefillContext, check_choice, check_positive, host_ints, keep_entries
from kvbench.methods.scorer_wrapper import ScorerWrapper

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: ``paper``: the scorer's must-keep entries stay, the others are chunked and ``(budget - kept) // chunk_length``
#: chunks kept; ``kvpress``: kvpress's ChunkKVPress (every token chunked, must-keep entries scored as the maximum + 1,
#: a partial last chunk scored by its mean, ``max(1, int(chunks * budget / n))`` chunks)
VARIANTS = ("paper", "kvpress")


def chunk_keep(scores: torch.Tensor, capacity: int, chunk: int) -> torch.Tensor:
    """One row's kept entries ``(n,)`` bool (the same for every head) from scores ``(H, n)``, the paper's reading:
    entries +inf in any head stay; the other valid entries, in position order, form chunks of ``chunk`` tokens (a
    remainder shorter than a chunk, the last candidates, is never kept); a chunk's score is the sum of its scores over
    its tokens and all heads; the top ``(capacity - stay) // chunk`` chunks are kept."""
    return chunk_keep_counted(scores, capacity, chunk)[0]


def chunk_keep_counted(scores: torch.Tensor, capacity: int, chunk: int,
                       must_keep: int | None = None) -> tuple[torch.Tensor, int]:
    """``chunk_keep`` and the number of entries it keeps (host arithmetic on the one read it makes, or on ``must_keep``:
    the number of ``+inf`` entries, the same in every head, of scores without padding, where the scorer knows it)."""
    stay = (torch.isinf(scores) & (scores > 0)).any(0)
    valid = (scores > float("-inf")).all(0)
    free = valid & ~stay
    if must_keep is not None:  # no padding, and the scorer's count (``Method.must_keep_count``): no read
        n_stay, n_cand = must_keep, scores.shape[-1] - must_keep
    else:
        n_stay, n_cand = torch.stack([stay.sum(), free.sum()]).tolist()  # one read for both counts
    kept = stay.clone()
    k = max(0, capacity - n_stay) // chunk
    complete = n_cand // chunk  # a remainder shorter than a chunk is never a candidate
    if k == 0 or complete == 0:
        return kept, n_stay
    # the candidates in position order (a stable sort, not a nonzero: its count is known)
    cand = torch.sort((~free).to(torch.uint8), stable=True).indices[:n_cand]
    summed = scores[:, cand[: complete * chunk]].sum(0)  # over heads
    chunk_scores = summed.view(complete, chunk).sum(-1)
    top = chunk_scores.topk(min(k, complete)).indices
    kept[cand[: complete * chunk].view(complete, chunk)[top].flatten()] = True
    return kept, n_stay + min(k, complete) * chunk


def chunk_keep_kvpress(scores: torch.Tensor, capacity: int, chunk: int) -> torch.Tensor:
    """kvpress ``ChunkKVPress.compress`` on one row's scores ``(H, n)`` (no padding): +inf entries scored as the
    largest finite score + 1 (its scorers' padding value), chunks over all n tokens, a chunk scored by the mean over
    its tokens of the scores summed over heads, ``max(1, chunks * capacity // n)`` chunks kept (kvpress:
    ``int(chunks * (1 - compression_ratio))``)."""
    h, n = scores.shape
    finite = scores[torch.isfinite(scores)]
    scores = torch.where(torch.isinf(scores) & (scores > 0), finite.max() + 1, scores)
    complete, rest = divmod(n, chunk)
    if complete == 0:  # kvpress delegates to the scorer's own top-k
        kept = torch.zeros(n, dtype=torch.bool, device=scores.device)
        return kept.scatter_(0, scores.sum(0).topk(capacity).indices, True)  # (not reached for n >= chunk)
    summed = scores.sum(0)
    chunk_scores = summed[: complete * chunk].view(complete, chunk).mean(-1)
    if rest:
        chunk_scores = torch.cat([chunk_scores, summed[-rest:].mean(-1, keepdim=True)])
    count = max(1, (len(chunk_scores) * capacity) // n)
    top = chunk_scores.topk(count).indices
    return torch.isin(torch.arange(n, device=scores.device) // chunk, top)


@dataclass
class ChunkKV(ScorerWrapper):
    """Prefill-only: per layer, the scorer's must-keep entries (+inf: SnapKV's window, sinks) plus the
    ``(budget - kept) // chunk_length`` chunks of ``chunk_length`` consecutive tokens with the highest summed scores
    (over the chunk's tokens and the layer's heads: every head keeps the same chunks, as kvpress). At most ``budget``
    entries: a budget remainder smaller than a chunk stays unused, and so do the candidates after the last complete
    chunk. Chunk length 20 is the paper's default.

    ``layer_reuse=1`` (default): every layer selects its own chunks. ``layer_reuse=r``: the paper's layer-wise index
    reuse, the chunks selected at layer ``l`` (``l`` a multiple of r) are kept at layers ``l+1 .. l+r-1`` too, which
    are not scored. ``variant="kvpress"``: kvpress's ChunkKVPress arithmetic (``chunk_keep_kvpress``).
    """

    name: ClassVar[str] = "chunkkv"
    chunk_length: int = 20
    layer_reuse: int = 1
    variant: str = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("chunkkv", chunk_length=self.chunk_length, layer_reuse=self.layer_reuse)
        check_choice("chunkkv", "variant", self.variant, VARIANTS)
        if self.variant == "kvpress" and self.layer_reuse != 1:
            raise ConfigError("method 'chunkkv': variant=kvpress has no layer reuse (layer_reuse=1)")
        self._reused: tuple[torch.Tensor, list[int] | None] | None = None  # the last scored layer's mask and counts

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.fits():
            return
        if ctx.layer_idx % self.layer_reuse and self._reused is not None and \
                self._reused[0].shape[-1] == layer.num_entries:
            kept, counts = self._reused  # positions are the same in every layer at prefill
        else:
            scores = self.scorer_scores(layer, ctx)
            caps = host_ints(layer, ctx.capacity)
            kept = torch.zeros(scores.shape[0], scores.shape[2], dtype=torch.bool, device=scores.device)
            counts = []  # entries each row keeps (the paper's reading knows them from its one read)
            for row, cap in enumerate(caps):  # each row on its own tokens, as it would be alone
                where = ctx.row_tokens(row)  # (left padding: a slice, no read)
                if self.variant == "kvpress":
                    kept[row][where] = chunk_keep_kvpress(scores[row][:, where], cap, self.chunk_length)
                else:
                    kept[row][where], count = chunk_keep_counted(scores[row][:, where], cap, self.chunk_length,
                                                                 self.scorer_must_keep(ctx, row))
                    counts.append(count)
            counts = counts or None
            self._reused = kept, counts
        full = kept[:, None].expand(-1, layer.keys.shape[1], -1)
        if layer.valid is not None:
            full = full & layer.valid
        keep_entries(layer, full, counts=counts)
