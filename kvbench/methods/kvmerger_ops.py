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


def merge_sets(keys, values, score, anchor, sigma_mode="mean_l2", sigma=1.0, weights="gaussian"):
    """Algorithm 2 / eqs. 5-8 for every set at once, in fixed shapes (no host read). keys/values ``(N, D)``;
    ``score`` ``(N,)`` picks each set's pivot (argmax, first on ties); ``anchor`` ``(N,)`` long: for each token of a
    set the index of the set's anchor (any index that names the set, one per set), ``-1`` for tokens in no set.

    Returns ``pivot`` ``(N,)`` bool (the token that stores its set) and the merged keys and values ``(N, D)``
    float32, meaningful at the pivots: ``w_i = g_i / sum_j g_j`` over the set with
    ``g_i = exp(-|k_p - k_i|^2 / (2 sigma^2))`` (so ``g_p = 1``); a singleton stays as it is."""
    n = keys.shape[0]
    seg = torch.where(anchor >= 0, anchor, n)  # bucket n collects the tokens outside every set
    idx = torch.arange(n, device=keys.device)

    def per_set(x, how="sum"):  # reduce over each set's tokens into its bucket: (n + 1, ...)
        out = torch.zeros(n + 1, *x.shape[1:], dtype=x.dtype, device=x.device)
        if how == "sum":
            return out.index_add_(0, seg, x)
        return out.scatter_reduce_(0, seg, x, how, include_self=False)

    s = score.float()
    cand = torch.where(s == per_set(s, "amax")[seg], idx, n)
    pivot_of = per_set(cand, "amin")  # first maximum on ties
    k, v = keys.float(), values.float()
    d2 = (k - k[pivot_of[seg].clamp(max=n - 1)]).pow(2).sum(-1)
    sizes = per_set(torch.ones_like(d2))
    if weights == "average":
        g = torch.ones_like(d2)
    else:
        if sigma_mode == "fixed":
            sig = torch.full_like(sizes, float(sigma))
        elif sigma_mode == "eq7":  # literal eq. 7: sum of squared distances / (sqrt(2) |S|)
            sig = per_set(d2) / (math.sqrt(2) * sizes)
        else:  # Sec 6.3: mean l2 distance from the pivot to the other members
            sig = per_set(d2.sqrt()) / (sizes - 1).clamp(min=1)
        g = torch.exp(-d2 / (2 * sig.clamp(min=_EPS)[seg] ** 2))
    w = (g / per_set(g)[seg])[:, None]
    merged_k, merged_v = per_set(w * k)[seg], per_set(w * v)[seg]
    return (anchor >= 0) & (pivot_of[seg] == idx), merged_k, merged_v


#: bytes of one pass of :func:`device_sets` (its n x 2n similarity table, the lag view's copy and its running minima,
#: float64): sequences are taken in passes of at most this size, so the kernels do not grow with the prompt until one
#: sequence's tables exceed it (about 48 n^2 bytes at their peak: 9k tokens per sequence in one 4 GiB pass)
SETS_PASS_BYTES = 4 << 30
#: bisection steps the device search takes at once (``device_sets``): a subtree of ``2**SEARCH_LEVELS - 1`` thetas is
#: evaluated in one batched pass and the bisection's path through it read off on the device, so the 24 steps cost
#: ``ceil(24 / SEARCH_LEVELS)`` passes (fewer where the candidates' memory would pass ``SETS_PASS_BYTES``)
SEARCH_LEVELS = 8


def _subtree_offsets(levels: int, device: torch.device) -> torch.Tensor:
    """Where the bisection's midpoints of the next ``levels`` steps lie in an interval [low, high], as fractions of its
    width, in heap order (node ``k``'s children ``2k + 1``, lower half, and ``2k + 2``): ``(2i + 1) / 2^(l + 1)`` for
    the ``i``-th node of level ``l``. Every midpoint of the theta search is a dyadic rational of at most 26 bits
    (from -2 and 1), so ``low + offset * (high - low)`` is the bisection's own ``(lo + hi) / 2``, exactly."""
    offsets = [(2 * (k + 1 - (1 << (k + 1).bit_length() - 1)) + 1) / (1 << (k + 1).bit_length())
               for k in range((1 << levels) - 1)]
    return torch.tensor(offsets, dtype=torch.float64, device=device)


def device_sets(kn: torch.Tensor, mergeable: torch.Tensor, theta: float, rooms: list[int] | None = None,
                iters: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 for P sequences at once, on their device, with no host read: the sets :func:`merging_sets` emits on
    every run of mergeable tokens, and for ``rooms`` the theta bisection of ``KVMerger._partition`` (budget_mode
    ``enforce``), step for step.

    kn ``(P, n, D)`` float64 unit keys; mergeable ``(P, n)`` bool (runs are its maximal stretches of True); theta: the
    fixed threshold (``rooms`` None) or unused; rooms: the sets each sequence may hold (host ints). Returns
    ``anchors`` ``(P, n)`` bool, each set's newest token (a set is its anchor and the mergeable tokens down to the next
    anchor of its run), and the theta of each sequence ``(P,)`` float64 (1.0 when its prompt fits without merging, as
    the host code reports).

    How: ``nxt_theta(j)``, the newest token before j in its run with ``cos(k_i, k_j) <= theta``, ends the set anchored
    at j and is the next anchor. From the similarities in lag order, ``T[j, d] = cos(k_j, k_{j-d})`` (+inf past the
    run), their running minimum over d is non-increasing, so for any theta the first lag at or below it is one
    ``searchsorted``: the ``O(n^2)`` table is built once and every theta costs ``O(n log n)``. The anchors are the
    chains ``j -> nxt(j)`` from each run's newest token, marked by pointer doubling in a fixed number of rounds (a
    chain longer than the room is only counted as too long). ``O(n^2)`` float64 memory per sequence, in passes of
    ``SETS_PASS_BYTES``.

    The bisection (its count need not be monotone in theta, so the path is followed, not searched for) takes
    ``SEARCH_LEVELS`` steps per pass: the ``2^L - 1`` midpoints those steps could visit are counted in one batched
    pass, then each sequence's path through them is followed by ``L`` gathers (a midpoint meeting the room exactly
    ends the search there, as on the host), and low / high become the path's last accepted / rejected midpoints. The
    24 steps took about 1,500 kernels per layer one step at a time, each dispatched by the host (a GPU prefill of
    KVMerger at 4k was 11x FullKV's); in passes of 8 they take a few hundred.
    """
    p, n, _ = kn.shape
    step = max(1, SETS_PASS_BYTES // max(1, 48 * n * n))
    if p > step:
        parts = [device_sets(kn[i : i + step], mergeable[i : i + step], theta,
                             None if rooms is None else rooms[i : i + step], iters) for i in range(0, p, step)]
        return tuple(torch.cat(x) for x in zip(*parts))
    dev = kn.device
    pos = torch.arange(n, device=dev)
    before = torch.nn.functional.pad(mergeable[:, :-1], (1, 0))
    after = torch.nn.functional.pad(mergeable[:, 1:], (0, 1))
    run_start = torch.where(mergeable & ~before, pos, -1).cummax(-1).values
    roots = mergeable & ~after  # each run's newest token
    # lag table: row j of [S reversed | +inf] read with stride 2n - 1 gives cos(k_j, k_{j-d}) at column d - 1
    table = torch.full((p, n, 2 * n), math.inf, dtype=kn.dtype, device=dev)
    table[..., :n] = kn @ kn.flip(1).transpose(-1, -2)
    lags = table.as_strided((p, n, n - 1), (2 * n * n, 2 * n - 1, 1), table.storage_offset() + n)
    lag = torch.arange(1, n, device=dev)
    outside = lag.view(1, 1, -1) > (pos - run_start).unsqueeze(-1)  # k_{j-d} before j's run
    floor = -lags.masked_fill(outside, math.inf).cummin(-1).values  # non-decreasing in d
    del table, lags, outside
    in_run = (mergeable.unsqueeze(-1), run_start.unsqueeze(-1))

    def anchors_at(th: torch.Tensor, rounds: int) -> torch.Tensor:
        """The anchors at each of K thetas ``th`` ``(P, K)``: ``(P, K, n)`` bool."""
        k = th.shape[1]
        first = torch.searchsorted(floor, (-th).view(p, 1, k).expand(p, n, k).contiguous())  # (P, n, K)
        nxt = pos.view(1, n, 1) - first - 1  # the newest token at or below theta, or before the run
        parent = torch.where(in_run[0] & (nxt >= in_run[1]), nxt, n).transpose(1, 2)  # (P, K, n)
        jump = torch.nn.functional.pad(parent, (0, 1), value=n)  # the sentinel n points to itself
        jumps = [jump]
        for _ in range(rounds - 1):
            jumps.append(torch.gather(jumps[-1], -1, jumps[-1]))
        marked = torch.nn.functional.pad(roots, (0, 1)).long().unsqueeze(1).expand(p, k, n + 1)
        for jump in reversed(jumps):  # nodes at distance t < 2^rounds from a root, bit by bit
            marked = marked.scatter_reduce(-1, jump, marked, "amax")  # a node's mark joins its parent's
        return marked[..., :n].bool()

    if rooms is None:
        th = torch.full((p,), float(theta), dtype=torch.float64, device=dev)
        return anchors_at(th.view(p, 1), max(1, n.bit_length()))[:, 0], th
    rounds = (max(rooms) + 1).bit_length()
    room = torch.tensor(rooms, device=dev).view(p, 1)
    fits = room[:, 0] >= mergeable.sum(-1)
    low = torch.full((p,), -2.0, dtype=torch.float64, device=dev)
    high = torch.ones(p, dtype=torch.float64, device=dev)
    done = fits.clone()
    # the most levels whose candidates' index tensors (the pointer-doubling rounds and a few more) fit in a pass
    levels = max(1, min(SEARCH_LEVELS, (SETS_PASS_BYTES // (p * (n + 1) * 8 * (rounds + 6)) + 1).bit_length() - 1))
    offsets = {}
    left = iters
    while left:
        m = min(levels, left)
        if m not in offsets:
            offsets[m] = _subtree_offsets(m, dev)
        k = offsets[m].numel()
        mids = low.view(p, 1) + offsets[m].view(1, k) * (high - low).view(p, 1)  # (P, K), heap order
        count = anchors_at(mids, rounds).sum(-1)
        accept = count <= room
        stop = accept & (count == room)  # the host's break
        child = 2 * torch.arange(k, device=dev) + 1 + accept.long()
        nodes = torch.arange(k, device=dev).expand(p, k)
        follow = torch.where(stop | (child >= k), nodes, child)  # a stop or a last-level node: the path stays
        node = torch.zeros(p, 1, dtype=torch.long, device=dev)
        path = [node]
        for _ in range(m - 1):
            node = follow.gather(1, node)
            path.append(node)
        path = torch.cat(path, 1)  # (P, m): the bisection's nodes in step order
        taken = accept.gather(1, path)
        depth = torch.arange(m, device=dev)
        last_acc = torch.where(taken, depth, -1).amax(1, keepdim=True)
        last_rej = torch.where(~taken, depth, -1).amax(1, keepdim=True)
        on_path = mids.gather(1, path)
        low = torch.where(done | (last_acc[:, 0] < 0), low, on_path.gather(1, last_acc.clamp(min=0))[:, 0])
        high = torch.where(done | (last_rej[:, 0] < 0), high, on_path.gather(1, last_rej.clamp(min=0))[:, 0])
        done = done | stop.gather(1, path).any(1)
        left -= m
    return anchors_at(torch.where(fits, math.inf, low).view(p, 1), rounds)[:, 0], torch.where(fits, 1.0, low)
