"""Sampled decoding: the settings, the per-row seeds, and the token choice from one step's logits.

``Sampling`` holds what ``model.generate(do_sample=True)`` takes (temperature, top-k, top-p) plus ``n``, the samples
drawn per prompt; greedy decoding is no ``Sampling`` object at all (``Sampling.greedy()`` is None), so every greedy
path stays what it was.

The choice (``choose``) filters the logits as transformers' logits warpers do, in their order
(``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``, float32, ``min_tokens_to_keep=1``), then
draws by inverse CDF with one uniform per row and step. The uniforms come from one CPU ``torch.Generator`` per row,
seeded with the row's own seed (``sample_seed``) and drawn once per step whatever the other rows do (``RowStreams``),
so that

* a rerun, or a resumed job that regenerates a row, gives the row the same tokens (the seed depends on the job's seed,
  the sample's id and the sample's index among the prompt's n, never on the batch or the order of work);
* a row's tokens never depend on the other rows of its batch (one stream per row; the filtering is per row);
* the same seed gives the same tokens on a CPU and on CUDA up to ties of the logits (the uniforms are drawn on the
  CPU and the cumulative sum runs in float64).

Shapes: logits ``(B, V)``, uniforms ``(B,)`` in [0, 1), chosen ids ``(B,)``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding (transformers' ``do_sample=True``): ``temperature`` > 0 divides the logits, ``top_k`` keeps
    the k most likely tokens (0: off), ``top_p`` the smallest set whose probability reaches ``top_p`` (1.0: off),
    ``n`` samples are drawn per prompt."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1

    def __post_init__(self):
        problem = invalid(self.temperature, self.top_p, self.top_k, self.n)
        if problem:
            raise ValueError(problem)

    @staticmethod
    def greedy() -> None:
        """Greedy decoding is the absence of a ``Sampling``."""
        return None

    def describe(self) -> dict:
        return asdict(self)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def invalid(temperature, top_p, top_k, n) -> str | None:
    """The first bad setting in one line naming the value and what is valid, or None."""
    if not _is_number(temperature) or temperature <= 0:
        return f"sampling.temperature={temperature!r} must be a number > 0 (0 or null: greedy)"
    if not _is_number(top_p) or not 0 < top_p <= 1:
        return f"sampling.top_p={top_p!r} must be a number in (0, 1] (1.0: off)"
    if not _is_int(top_k) or top_k < 0:
        return f"sampling.top_k={top_k!r} must be an integer >= 0 (0: off)"
    if not _is_int(n) or n < 1:
        return f"sampling.n={n!r} must be an integer >= 1 (samples per prompt)"
    return None


def sample_seed(job_seed: int, sample_id: str, index: int) -> int:
    """The seed of sample ``index`` (0-based among the prompt's n) of sample ``sample_id`` in a job seeded
    ``job_seed``: the first 8 bytes of a sha256, below 2**63 (a ``torch.Generator`` seed)."""
    digest = hashlib.sha256(f"kvbench-sample:{int(job_seed)}:{sample_id}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class RowStreams:
    """One CPU generator per row, each seeded with its row's seed; ``next(k)`` draws the uniforms of the next ``k``
    steps ``(B, k)`` float64 (a row draws exactly one per step, so its stream is the same in any batch and whether
    the steps are drawn one at a time or ``k`` at a time)."""

    def __init__(self, seeds: Sequence[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def next(self, k: int = 1) -> torch.Tensor:
        return torch.stack([torch.rand(k, generator=g, dtype=torch.float64) for g in self.generators])


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``logits`` ``(B, V)`` as float32 after transformers' temperature, top-k and top-p warpers (in that order,
    ``min_tokens_to_keep=1``): the removed tokens are ``-inf``."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        k = min(sampling.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - sampling.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def choose(logits: torch.Tensor, sampling: Sampling, uniforms: torch.Tensor) -> torch.Tensor:
    """The sampled ids ``(B,)``: per row, the first token (in vocabulary order) whose cumulative probability (float64)
    exceeds ``uniform * total``, over the filtered distribution. Device tensors only (no host read): the captured
    decode step runs it."""
    probs = filter_logits(logits, sampling).softmax(dim=-1).double()
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(device=cdf.device, dtype=torch.float64).reshape(-1, 1) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return chosen.clamp(max=logits.shape[-1] - 1)


def next_tokens(logits: torch.Tensor, sampling: Sampling | None, uniforms: torch.Tensor | None) -> torch.Tensor:
    """The greedy choice (``sampling`` None: ``argmax``, what the engine always did) or the sampled one."""
    if sampling is None:
        return logits.argmax(-1)
    return choose(logits, sampling, uniforms)
