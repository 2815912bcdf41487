"""CaM's tensor operations: the start+recent (Λ) attention of a prompt in chunks, the merge probabilities of the
token leaving the window, and the value merge (CaM's token-order loop as a banded triangular solve). Used by
``kvbench/methods/cam.py``.

Shapes: queries grouped per KV head ``(B, Hkv, g, n, D)``, keys/values ``(B, Hkv, n, D)``; attention statistics are
averaged over each GQA group (``(B, Hkv, ...)``), as reference/methods.md B6 asks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def lambda_chunks(qg: torch.Tensor, keys: torch.Tensor, s: int, r: int, scaling: float, chunk: int
                  ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Attention of every prompt query over its first ``s`` tokens and its ``r`` previous tokens (and itself),
    CaM's lm-eval mask: ``allowed(i, j) = j <= i and (j < s or j >= i - r)``. ``s = 0, r = n`` is causal attention.

    Yields ``(start, stop, key_index, probs)`` per chunk of query rows (at most ``chunk``, about one window when r is
    smaller, so that few keys of a chunk are masked): ``key_index`` ``(T,)`` lists the start tokens then the band
    ``[max(s, start - r), stop)``; ``probs`` ``(B, Hkv, g, stop - start, T)`` float32.
    """
    n = keys.shape[2]
    dev = keys.device
    rows = max(64, min(chunk, r + 1))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        lo = max(s, start - r)
        idx = torch.cat([torch.arange(min(s, stop), device=dev), torch.arange(lo, stop, device=dev)])
        i = torch.arange(start, stop, device=dev).view(-1, 1)
        j = idx.view(1, -1)
        allowed = (j <= i) & ((j < s) | (j >= i - r))
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, start:stop], keys[:, :, idx]).float() * scaling
        yield start, stop, idx, torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)


def masked_output(qg, keys, values, s, r, scaling, chunk) -> torch.Tensor:
    """The layer's prompt output ``(B, n, Hq, D)`` under the :func:`lambda_chunks` mask."""
    b, hkv, g, n, d = qg.shape
    outs = [torch.einsum("bhgqk,bhkd->bhgqd", p.to(values.dtype), values[:, :, idx])
            for _, _, idx, p in lambda_chunks(qg, keys, s, r, scaling, chunk)]
    return torch.cat(outs, dim=3).reshape(b, hkv * g, n, d).transpose(1, 2).contiguous()


def leaving_probabilities(qg, keys, s: int, r: int, scaling: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The B6 loop's merge probabilities under the Λ mask, without the loop.

    For every step ``t`` in ``[s + r, n)`` the token ``x = t - r`` leaves the window, and with
    ``S_j(t) = Σ_{i<t} A[i, j]`` (group-mean probabilities of the masked attention; CaM's ``mean`` over the first t
    rows, whose 1/t cancels): ``p_x = S_x(t) / max_{j in [0, s) ∪ [t - r, t)} S_j(t)``.

    Returns ``p`` ``(B, Hkv, n - s - r)`` (NaN from 0/0 -> 0, +inf -> 1, clamped to [0, 1]) and the column sums over
    every prompt row ``(B, Hkv, n)``, exact for the tokens that stay (the first s and the last r).
    """
    b, hkv, g, n, d = qg.shape
    dev = keys.device
    start_cum = torch.zeros(b, hkv, s, device=dev)
    start_max = torch.zeros(b, hkv, n + 1, device=dev)  # [t] = max_{j<s} S_j(t)
    band = torch.zeros(b, hkv, n, r, device=dev)  # [i, d] = A[i, i - d] for i - d >= s, d < r
    dd = torch.arange(r, device=dev)
    for start, stop, _idx, probs in lambda_chunks(qg, keys, s, r, scaling, chunk):
        mean = probs.mean(2)
        ns = min(s, stop)
        if ns:
            cum = mean[..., :ns].cumsum(2) + start_cum[..., :ns].unsqueeze(2)
            start_cum[..., :ns] = cum[:, :, -1]
            start_max[..., start + 1 : stop + 1] = cum.amax(-1)
        lo = min(max(s, start - r), stop)  # where the band starts in idx (idx[ns]), known without reading idx
        col = torch.arange(start, stop, device=dev).view(-1, 1) - dd.view(1, -1) - lo  # (c, r)
        rows = mean[..., ns:]
        if rows.shape[-1]:
            got = torch.gather(rows, -1, col.clamp(min=0).expand(b, hkv, -1, -1))
            band[..., start:stop, :] = got.masked_fill(col < 0, 0.0)
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


def merge_values(values: torch.Tensor, merge: torch.Tensor, first: int, span: int, block: int = 128) -> None:
    """CaM's merge, in place and in token order: for the token ``x = first + k`` with ``merge[..., k]`` set,
    ``v[x + 1 : x + 1 + span] += v[x] / span`` (``v[x]`` already holds what earlier tokens merged into it).

    values ``(B, H, n, D)``; merge ``(B, H, steps)`` bool. Keys are never merged.

    The loop is the recurrence ``v'[y] = v[y] + Σ_{y - span <= x < y} m_x v'[x] / span``, a unit lower-triangular
    banded system ``(I - A) v' = v``. It is solved by block forward substitution over blocks of ``K = max(span,
    block)`` rows: a row depends only on its own block and the one before, so
    ``V'_k = (I - A_kk)^{-1} (V_k + A_{k,k-1} V'_{k-1})`` with one triangular solve per block, in float32 at least (one
    iteration per K tokens instead of one per merged token, and no read of ``merge`` by the host).
    """
    b, h, n, d = values.shape
    steps = merge.shape[-1]
    stop = min(n, first + steps + span)  # rows that are sources or targets
    length = stop - first
    if steps == 0 or length <= 1:
        return
    k = max(span, block)
    nb = -(-length // k)
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
    out, prev = [], None
    for blk in range(nb):
        rhs = v[:, :, blk] if prev is None else v[:, :, blk] + (behind * m[:, :, blk - 1]) @ prev
        prev = torch.linalg.solve_triangular(eye - inside * m[:, :, blk], rhs, upper=False, unitriangular=True)
        out.append(prev)
    values[:, :, first:stop] = torch.cat(out, 2)[:, :, :length].to(values.dtype)
