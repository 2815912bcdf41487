"""KVMerger's two algorithms on tensors (paper 003, reference/methods.md A4.3): which consecutive keys form a merging
set (Algorithm 1, the anchor greedy on cosine similarity) and how a set collapses into its pivot (Algorithm 2, Gaussian
weights). ``kvmerger.py`` holds the method: protected tokens, budgets and the cache bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import torch

_EPS = 1e-6


def presets(b: float) -> tuple[float, float]:
    """(recent, heavy) fractions of the prompt for budget fraction ``b`` (paper Sec 6: "0.17 %" read as 17 %)."""
    if math.isclose(b, 0.5):
        return 0.17, 0.12
    if math.isclose(b, 0.35):
        return 0.08, 0.02
    return 0.34 * b, 0.24 * b  # kvbench's extrapolation of the 50 % preset


def runs_of(index: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions in sorted ``index``: ``[(start, stop), ...]`` (stop exclusive)."""
    if index.size == 0:
        return []
    cut = np.nonzero(np.diff(index) != 1)[0] + 1
    starts, stops = np.concatenate([[0], cut]), np.concatenate([cut, [index.size]])
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in zip(starts, stops)]


def merging_sets(kn: np.ndarray, start: int, stop: int, theta: float, limit: int | None = None) -> list:
    """Algorithm 1 on the run ``[start, stop)``: from the last token backwards, add token i to the current set while
    ``cos(k_i, k_anchor) > theta`` (the anchor is the set's newest token, not i's neighbour); otherwise emit the set
    and start a new one at i. The final set is emitted too. ``kn``: ``(n, D)`` unit keys. Returns inclusive
    ``(lo, hi)`` intervals, newest first; stops early once more than ``limit`` sets exist."""
    sets, j, guess = [], stop - 1, 256
    while j >= start:
        lo, i, block = start, j - 1, guess
        while i >= start:  # galloping scan down for the first token not similar to the anchor j
            a = max(start, i - block + 1)
            bad = np.nonzero(kn[a : i + 1] @ kn[j] <= theta)[0]
            if bad.size:
                lo = a + int(bad[-1]) + 1
                break
            i, block = a - 1, block * 2
        if i < start:
            lo = start
        sets.append((lo, j))
        guess = max(8, 2 * (j - lo + 1))  # the next set is likely about as long: one matrix-vector product
        if limit is not None and len(sets) > limit:
            return sets
        j = lo - 1
    return sets


def merge_sets(keys, values, score, lo, hi, sigma_mode="mean_l2", sigma=1.0, weights="gaussian"):
    """Algorithm 2 / eqs. 5-8 for the sets ``[lo_s, hi_s]`` of one head. keys/values ``(n, D)``, ``score`` ``(n,)``
    picks the pivot (argmax, first on ties). Returns pivots ``(S,)`` and merged keys and values ``(S, D)`` float32:
    ``w_i = g_i / sum_j g_j`` with ``g_i = exp(-|k_p - k_i|^2 / (2 sigma^2))`` (so ``g_p = 1``)."""
    sizes = hi - lo + 1
    seg = torch.repeat_interleave(torch.arange(len(lo), device=lo.device), sizes)
    idx = lo[seg] + torch.arange(seg.numel(), device=lo.device) - (torch.cumsum(sizes, 0) - sizes)[seg]

    def per_set(x, how="sum"):  # sets are contiguous in idx: segment reductions (index_add_ is slow on CPU)
        return torch.segment_reduce(x, how, lengths=sizes, axis=0)

    s = score[idx].float()
    cand = torch.where(s == per_set(s, "max")[seg], idx, torch.full_like(idx, keys.shape[0]))
    pivot = per_set(cand.double(), "min").long()  # first maximum on ties
    k, v = keys[idx].float(), values[idx].float()
    d2 = (k - keys[pivot].float()[seg]).pow(2).sum(-1)
    if weights == "average":
        g = torch.ones_like(d2)
    else:
        if sigma_mode == "fixed":
            sig = torch.full((len(lo),), float(sigma), device=d2.device)
        elif sigma_mode == "eq7":  # literal eq. 7: sum of squared distances / (sqrt(2) |S|)
            sig = per_set(d2) / (math.sqrt(2) * sizes)
        else:  # Sec 6.3: mean l2 distance from the pivot to the other members
            sig = per_set(d2.sqrt()) / (sizes - 1).clamp(min=1)
        g = torch.exp(-d2 / (2 * sig.clamp(min=_EPS)[seg] ** 2))
    w = (g / per_set(g)[seg])[:, None]
    merged_k, merged_v = per_set(w * k), per_set(w * v)
    return pivot, merged_k, merged_v
