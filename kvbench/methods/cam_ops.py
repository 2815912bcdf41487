"""CaM's tensor operations: the start+recent (Λ) attention of a prompt in chunks, the merge probabilities of the
token leaving the window, and the value merge (CaM's token-order loop as a banded triangular solve). Used by
``kvbench/methods/cam.py``.

Shapes: queries grouped per KV head ``(B, Hkv, g, n, D)``, keys/values ``(B, Hkv, n, D)``; attention statistics are
averaged over each GQA group (``(B, Hkv, ...)``), as reference/methods.md B6 asks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: query rows per block of the Λ attention: a block attends its sinks and the ``r + BLOCK`` keys ending at its last row
BLOCK = 64
#: logits of one pass of the Λ attention, in bytes (float32): blocks are processed in passes of at most this size, so
#: the number of kernels does not grow with the prompt until its logits exceed it
PASS_BYTES = 1 << 30


def lambda_blocks(qg: torch.Tensor, keys: torch.Tensor, s: int, r: int, scaling: float
                  ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Attention of every prompt query over its first ``s`` tokens and its ``r`` previous tokens (and itself),
    CaM's lm-eval mask: ``allowed(i, j) = j <= i and (j < s or j >= i - r)``. ``s = 0, r = n`` is causal attention.

    Queries go in blocks of ``BLOCK`` rows, all blocks of a pass in one batched product: block ``m`` (rows
    ``[mc, mc + c)``) sees the sinks ``[0, s)`` and the window ``[mc - r, mc + c)`` of keys (an ``unfold`` of the
    keys, no copy per block), so the work is ``O(n (s + r + c))`` and the kernels are the same for any prompt that fits
    one pass (``PASS_BYTES`` of logits). Yields ``(m0, m1, sink, window)`` per pass of blocks ``[m0, m1)``: ``sink``
    ``(B, Hkv, g, m1 - m0, c, s)`` and ``window`` ``(B, Hkv, g, m1 - m0, c, r + c)`` float32 probabilities, one softmax
    over both (entry ``t`` of a window is key ``mc - r + t``; keys of the window below ``s`` are the sinks' and get 0).
    Rows past the prompt (the last block's padding) are garbage.
    """
    b, hkv, g, n, d = qg.shape
    c, dev = BLOCK, keys.device
    nb = -(-n // c)
    qb = torch.nn.functional.pad(qg, (0, 0, 0, nb * c - n)).view(b, hkv, g, nb, c, d)
    windows = torch.nn.functional.pad(keys, (0, 0, r, nb * c - n)).unfold(2, r + c, c)  # (B, Hkv, nb, D, r + c)
    u = torch.arange(c, device=dev).view(-1, 1)
    t = torch.arange(r + c, device=dev).view(1, -1)
    band = (t >= u) & (t <= u + r)  # key mc - r + t within [i - r, i] of query i = mc + u
    per_block = b * hkv * g * c * (s + r + c) * 4
    step = max(1, PASS_BYTES // per_block)
    for m0 in range(0, nb, step):
        m1 = min(nb, m0 + step)
        rows = torch.arange(m0 * c, m1 * c, device=dev).view(m1 - m0, c, 1)
        win = torch.matmul(qb[:, :, :, m0:m1], windows[:, :, None, m0:m1]).float() * scaling
        key_pos = rows[:, :1] - r + t  # (blocks, 1, r + c)
        win.masked_fill_(~(band & (key_pos >= s)), float("-inf"))
        sink = torch.matmul(qb[:, :, :, m0:m1], keys[:, :, None, None, :s].transpose(-1, -2)).float() * scaling
        sink.masked_fill_(torch.arange(s, device=dev).view(1, 1, -1) > rows, float("-inf"))
        probs = torch.softmax(torch.cat([sink, win], dim=-1), dim=-1)
        yield m0, m1, probs[..., :s], probs[..., s:]


def masked_output(qg, keys, values, s, r, scaling) -> torch.Tensor:
    """The layer's prompt output ``(B, n, Hq, D)`` under the :func:`lambda_blocks` mask."""
    b, hkv, g, n, d = qg.shape
    c = BLOCK
    nb = -(-n // c)
    windows = torch.nn.functional.pad(values, (0, 0, r, nb * c - n)).unfold(2, r + c, c)  # (B, Hkv, nb, D, r + c)
    outs = []
    for m0, m1, sink, win in lambda_blocks(qg, keys, s, r, scaling):
        out = torch.matmul(win.to(values.dtype), windows[:, :, None, m0:m1].transpose(-1, -2))
        if s:
            out = out + torch.matmul(sink.to(values.dtype), values[:, :, None, None, :s])
        outs.append(out)
    out = torch.cat(outs, dim=3).reshape(b, hkv * g, nb * c, d)[:, :, :n]
    return out.transpose(1, 2).contiguous()


def leaving_probabilities(qg, keys, s: int, r: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The B6 loop's merge probabilities under the Λ mask, without the loop.

    For every step ``t`` in ``[s + r, n)`` the token ``x = t - r`` leaves the window, and with
    ``S_j(t) = Σ_{i<t} A[i, j]`` (group-mean probabilities of the masked attention; CaM's ``mean`` over the first t
    rows, whose 1/t cancels): ``p_x = S_x(t) / max_{j in [0, s) ∪ [t - r, t)} S_j(t)``.

    Returns ``p`` ``(B, Hkv, n - s - r)`` (NaN from 0/0 -> 0, +inf -> 1, clamped to [0, 1]) and the column sums over
    every prompt row ``(B, Hkv, n)``, exact for the tokens that stay (the first s and the last r).
    """
    b, hkv, g, n, d = qg.shape
    dev, c = keys.device, BLOCK
    nb = -(-n // c)
    sink_rows = torch.zeros(b, hkv, nb * c, s, device=dev)  # group-mean A[i, j], j < s
    band = torch.zeros(b, hkv, nb * c, r, device=dev)  # [i, d] = A[i, i - d] for i - d >= s, d < r
    dd = torch.arange(r, device=dev)
    pick = (r + torch.arange(c, device=dev).view(-1, 1) - dd.view(1, -1))  # window entry of key i - d: (c, r)
    for m0, m1, sink, win in lambda_blocks(qg, keys, s, r, scaling):
        sink_rows[:, :, m0 * c : m1 * c] = sink.mean(2).flatten(2, 3)
        mean = win.mean(2)  # (B, Hkv, blocks, c, r + c)
        band[:, :, m0 * c : m1 * c] = torch.gather(mean, -1, pick.expand(*mean.shape[:-1], r)).flatten(2, 3)
    sink_rows, band = sink_rows[:, :, :n], band[:, :, :n]
    cum = sink_rows.cumsum(2)  # [i, j] = S_j(i + 1)
    start_cum = cum[:, :, -1]
    start_max = torch.zeros(b, hkv, n + 1, device=dev)  # [t] = max_{j<s} S_j(t)
    if s:
        start_max[..., 1:] = cum.amax(-1)
    # column view: acol[j, d] = A[j + d, j]; ccol[j, m] = Σ_{d<=m} acol[j, d] = S_j(j + m + 1)
    rows_idx = torch.arange(n, device=dev).view(-1, 1) + dd.view(1, -1)
    acol = band[..., rows_idx.clamp(max=n - 1), dd.view(1, -1).expand(n, -1)].masked_fill(rows_idx >= n, 0.0)
    ccol = acol.cumsum(-1)
    t = torch.arange(s + r, n, device=dev)
    x = t - r
    s_x = ccol[..., x, r - 1]
    win_rows = t.view(-1, 1) - 1 - dd.view(1, -1)
    window_max = ccol[..., win_rows, dd.view(1, -1).expand(t.numel(), -1)].amax(-1)
    p = s_x / torch.maximum(window_max, start_max[..., t])
    p = torch.nan_to_num(p, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
    colsum = torch.zeros(b, hkv, n, device=dev)
    colsum[..., :s] = start_cum
    tail = torch.arange(max(s, n - r), n, device=dev)
    colsum[..., tail] = ccol[..., tail, n - 1 - tail]
    return p, colsum


def merge_values(values: torch.Tensor, merge: torch.Tensor, first: int, span: int, blocks: int = 16) -> None:
    """CaM's merge, in place and in token order: for the token ``x = first + k`` with ``merge[..., k]`` set,
    ``v[x + 1 : x + 1 + span] += v[x] / span`` (``v[x]`` already holds what earlier tokens merged into it).

    values ``(B, H, n, D)``; merge ``(B, H, steps)`` bool. Keys are never merged.

    The loop is the recurrence ``v'[y] = v[y] + Σ_{y - span <= x < y} m_x v'[x] / span``, a unit lower-triangular
    banded system ``(I - A) v' = v``. It is solved by block forward substitution over ``blocks`` blocks of
    ``K = max(span, ⌈rows / blocks⌉)`` rows (zero rows past the last): a row depends only on its own block and the
    one before, so
    ``V'_k = (I - A_kk)^{-1} (V_k + A_{k,k-1} V'_{k-1})`` with one triangular solve per block, in float32 at least.
    A fixed number of blocks whatever the prompt (the kernels do not grow with it; the work is ``O(n² D / blocks)``),
    and no read of ``merge`` by the host.
    """
    b, h, n, d = values.shape
    steps = merge.shape[-1]
    stop = min(n, first + steps + span)  # rows that are sources or targets
    length = stop - first
    if steps == 0 or length <= 1:
        return
    k = max(span, -(-length // blocks))
    nb = blocks  # rows past the last one are zeros: a fixed number of blocks whatever the prompt
    dev, dt = values.device, torch.promote_types(values.dtype, torch.float32)
    v = torch.zeros(b, h, nb * k, d, dtype=dt, device=dev)
    v[:, :, :length] = values[:, :, first:stop]
    m = torch.zeros(b, h, nb * k, dtype=dt, device=dev)
    m[..., :steps] = merge.to(dt) / span
    v, m = v.view(b, h, nb, k, d), m.view(b, h, nb, 1, k)
    diff = torch.arange(k, device=dev).view(-1, 1) - torch.arange(k, device=dev).view(1, -1)  # y - x in a block
    inside = ((diff > 0) & (diff <= span)).to(dt)  # x earlier in the same block, at most span back
    behind = (diff + k <= span).to(dt)  # x in the previous block, at most span back
    eye = torch.eye(k, dtype=dt, device=dev)
    # every block's own system and its sources in the block before it, at once, block-major (each block's matrix
    # contiguous, as the solver and the product get it one block at a time: the same results bit for bit)
    lower = (eye - inside * m).movedim(2, 0).contiguous()  # (nb, B, H, K, K)
    couple = (behind * m[:, :, :-1]).movedim(2, 0).contiguous()  # (nb - 1, B, H, K, K)
    out, prev = [], None
    for blk in range(nb):  # 3 kernels per block (the products above, per block, were 3 more)
        rhs = v[:, :, blk] if prev is None else v[:, :, blk] + couple[blk - 1] @ prev
        prev = torch.linalg.solve_triangular(lower[blk], rhs, upper=False, unitriangular=True)
        out.append(prev)
    values[:, :, first:stop] = torch.cat(out, 2)[:, :, :length].to(values.dtype)


# ---- decode draws --------------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor | int, m: int) -> torch.Tensor | int:
    """``x * m mod 2**32`` for ``x`` in ``[0, 2**32)`` (int64) without an int64 overflow: two 16-bit halves."""
    low = (x & 0xFFFF) * m
    high = ((x >> 16) * m) & 0xFFFF
    return (low + (high << 16)) & _M32


def _hash32(x: torch.Tensor | int) -> torch.Tensor | int:
    """Wellons' ``lowbias32`` integer hash of ``x`` in ``[0, 2**32)`` (int64 tensors, every op exact; or an int)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def layer_key(seed: int, layer_idx: int) -> int:
    """The host part of a layer's draws (:func:`decode_uniforms`): a 32-bit key of (seed, layer), on Python ints
    (:func:`_hash32`'s operators are theirs too)."""
    return _hash32((seed & _M32) ^ _hash32(((seed >> 32) ^ _hash32(layer_idx & _M32)) & _M32))


def decode_uniforms(key: int, positions: torch.Tensor) -> torch.Tensor:
    """CaM's decode-time Bernoulli draws: a uniform in ``[0, 1)`` (float32, 24 bits) for every (row, head) of
    ``positions`` ``(B, H)`` (the position of the token leaving the window there), a hash of the layer's ``key``
    (:func:`layer_key` of seed and layer), the head and the position. Counter-based rather than a generator's stream,
    so a token's draw is the same whichever path decodes it (the host-driven step, the captured one: no generator
    state in a graph) and on every device (exact integer ops: a CUDA run draws what the CPU draws)."""
    heads = torch.arange(positions.shape[1], device=positions.device).view(1, -1)
    x = _hash32(_hash32(heads ^ key) ^ (positions & _M32))
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))
