"""Paired statistics for the report: bootstrap confidence intervals and an exact sign-flip test, deterministic.

The unit is a sample. Compared series are *paired*: value ``i`` of every series belongs to the same sample (the same
prompt, joined on the sample id), so what varies between resamples is which samples were drawn, never which method
ran on them. Samples come in *strata* (the tasks of a claim; the datasets of a benchmark whose score is the mean of
its datasets' means), each with a fixed weight: a statistic is ``sum_s w_s * mean_i x_si``, which is how the report
averages "% of FullKV" over tasks.

* ``bootstrap``: the stratified bootstrap. Each resample draws ``n_s`` samples with replacement inside every stratum
  (the same draw for every series: paired) and recomputes the weighted means. ``RESAMPLES`` = 10,000 resamples from
  ``numpy.random.default_rng(SEED)``, fresh for every call, so a number does not depend on what was computed before.
* ``interval``: the percentile interval of the resamples (2.5 % and 97.5 % quantiles for ``ALPHA`` = 0.05).
* ``sign_flip_p``: the two-sided paired randomisation (sign-flip) test of "the two series are exchangeable on every
  sample", i.e. of a zero mean difference. Under that null each paired difference is as likely to have either sign;
  the p-value is the share of sign assignments whose weighted mean difference is at least as far from zero as the
  observed one. Exact (all ``2**k`` assignments of the ``k`` non-zero differences) up to ``EXACT_MAX`` = 16 of them,
  else ``RESAMPLES`` random assignments with the ``(1 + hits) / (1 + RESAMPLES)`` estimate. Identical series give
  p = 1. It is exact at any sample size, where a bootstrap test is too liberal at the 10 samples per task of a CPU
  miniature (its percentile intervals are narrower than the data warrant: they are descriptive, the test decides).
* ``bootstrap_p``: the two-sided bootstrap p-value of "the statistic equals ``value``" (a one-sample question such as
  "at least 95 % of FullKV", where no pairing exists to flip): twice the smaller tail share of the resamples.
* ``holm``: Holm's step-down adjustment of a family of p-values (one claim's comparisons at one budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEED = 20240601
RESAMPLES = 10_000
ALPHA = 0.05
EXACT_MAX = 16
_CHUNK = 1_000  # resamples per vectorised block (bounds memory at large sample counts)


@dataclass(frozen=True)
class Strata:
    """``k`` paired series: per stratum an array ``(k, n_s)`` of per-sample values, and the stratum's weight."""

    values: tuple[np.ndarray, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[Sequence[Sequence[float]] | np.ndarray], weights: Sequence[float] | None = None
           ) -> Strata:
        """``values[s]`` is stratum ``s`` as ``(k, n_s)``; equal weights summing to 1 unless given."""
        arrays = tuple(np.atleast_2d(np.asarray(v, dtype=np.float64)) for v in values)
        if not arrays or any(a.shape[1] == 0 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
            raise ValueError("every stratum needs at least one sample and the same number of series")
        w = tuple(float(x) for x in weights) if weights is not None else (1.0 / len(arrays),) * len(arrays)
        if len(w) != len(arrays):
            raise ValueError(f"{len(w)} weights for {len(arrays)} strata")
        return cls(arrays, w)

    @property
    def series(self) -> int:
        return int(self.values[0].shape[0])

    @property
    def samples(self) -> int:
        return int(sum(a.shape[1] for a in self.values))

    def means(self) -> np.ndarray:
        """The weighted means, one per series ``(k,)``."""
        return sum(w * a.mean(axis=1) for a, w in zip(self.values, self.weights))  # type: ignore[return-value]


def bootstrap(strata: Strata, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``(resamples, k)``: the weighted means of every series on each stratified paired resample."""
    rng = np.random.default_rng(seed)
    out = np.zeros((resamples, strata.series))
    for values, weight in zip(strata.values, strata.weights):
        n = values.shape[1]
        for start in range(0, resamples, _CHUNK):
            stop = min(resamples, start + _CHUNK)
            idx = rng.integers(0, n, size=(stop - start, n))
            out[start:stop] += weight * values[:, idx].mean(axis=-1).T
    return out


def interval(draws: np.ndarray, alpha: float = ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """The percentile interval of bootstrap ``draws`` (per column): ``(low, high)``."""
    low, high = np.nanquantile(draws, [alpha / 2, 1 - alpha / 2], axis=0)  # nan: a ratio over a zero resample
    return low, high


def bootstrap_p(draws: np.ndarray, value: float) -> float:
    """Two-sided bootstrap p-value of "the statistic equals ``value``" from its resamples ``draws`` (1-D)."""
    draws = np.asarray(draws, dtype=np.float64).ravel()
    tail = min(float(np.mean(draws <= value)), float(np.mean(draws >= value)))
    return min(1.0, 2.0 * tail)


def sign_flip_p(differences: Sequence[Sequence[float] | np.ndarray], weights: Sequence[float] | None = None,
                resamples: int = RESAMPLES, seed: int = SEED) -> float:
    """Two-sided paired sign-flip test of a zero weighted mean difference; ``differences[s]``: stratum ``s``'s
    per-sample differences (see the module docstring)."""
    arrays = [np.asarray(d, dtype=np.float64).ravel() for d in differences]
    w = list(weights) if weights is not None else [1.0 / len(arrays)] * len(arrays)
    terms = np.concatenate([wi * a / len(a) for a, wi in zip(arrays, w) if len(a)])
    scale = float(np.abs(terms).sum())
    terms = terms[np.abs(terms) > 1e-12 * max(scale, 1e-300)]
    if terms.size == 0:
        return 1.0
    observed = abs(float(terms.sum()))
    tol = 1e-9 * scale
    k = terms.size
    if k <= EXACT_MAX:
        codes = np.arange(2**k, dtype=np.int64)[:, None] >> np.arange(k, dtype=np.int64)
        stats = ((codes & 1) * 2 - 1) @ terms
        return float(np.mean(np.abs(stats) >= observed - tol))
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, resamples, _CHUNK):
        size = min(_CHUNK, resamples - start)
        signs = rng.integers(0, 2, size=(size, k), dtype=np.int8) * 2 - 1
        hits += int(np.sum(np.abs(signs @ terms) >= observed - tol))
    return (1 + hits) / (1 + resamples)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as given)."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    out = [1.0] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = running
    return out


__all__ = ["ALPHA", "EXACT_MAX", "RESAMPLES", "SEED", "Strata", "bootstrap", "bootstrap_p", "holm", "interval",
           "sign_flip_p"]
