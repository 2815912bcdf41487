"""Attention statistics that methods score tokens with, computed without n x n matrices.

Shapes: queries ``(batch, q_heads, n, head_dim)``, keys ``(batch, kv_heads, n, head_dim)`` (GQA-native: keys are
never repeated; queries are viewed as ``(batch, kv_heads, group, n, head_dim)`` instead).
``key_valid`` ``(batch, n)`` is False at left padding; those keys get zero attention and their query rows are
ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``(B, Hq, n, D)`` -> ``(B, Hkv, g, n, D)`` (query heads of one KV group side by side)."""
    b, hq, n, d = queries.shape
    return queries.view(b, num_kv_heads, hq // num_kv_heads, n, d)


def aggregate_group(x: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Per-query-head statistics ``(B, Hq, ...)`` -> per-KV-head ``(B, Hkv, ...)`` by mean or max over the group."""
    b, hq = x.shape[:2]
    x = x.view(b, num_kv_heads, hq // num_kv_heads, *x.shape[2:])
    if how == "mean":
        return x.mean(2)
    if how == "max":
        return x.amax(2)
    if how == "sum":
        return x.sum(2)
    raise ValueError(f"unknown group aggregation {how!r}; valid: mean, max, sum")


def _masked_probs(logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, key_valid: torch.Tensor | None):
    """Softmax over keys with the causal mask (key position <= query position) and padding mask."""
    allowed = k_pos.view(1, -1) <= q_pos.view(-1, 1)  # (q, n)
    allowed = allowed.view(1, 1, 1, *allowed.shape)
    if key_valid is not None:
        allowed = allowed & key_valid.view(key_valid.shape[0], 1, 1, 1, -1)
    logits = logits.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.nan_to_num(probs, nan=0.0)  # fully masked rows (padding queries) -> 0


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, window: int, scaling: float, key_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of the last ``window`` queries over all keys, causal inside the window (SnapKV's observation).

    Returns probabilities ``(B, Hq, window, n)`` in float32.
    """
    n = keys.shape[-2]
    num_kv = keys.shape[1]
    q = grouped(queries[..., n - window :, :], num_kv)  # (B, Hkv, g, w, D)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", q, keys) * scaling
    pos = torch.arange(n, device=keys.device)
    probs = _masked_probs(logits, pos[n - window :], pos, key_valid)
    b, h, g, w, _ = probs.shape
    return probs.reshape(b, h * g, w, n)


def column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    key_valid: torch.Tensor | None = None,
    chunk: int = 512,
    query_start: int = 0,
) -> torch.Tensor:
    """H2O's accumulated attention ``s[j] = sum_{i >= j} A[i, j]`` per query head, in query chunks.

    Only queries ``i >= query_start`` contribute. A chunk of queries ``[start, stop)`` only needs keys
    ``[0, stop)``; memory is ``O(chunk * n)`` per head instead of ``O(n^2)``. Returns ``(B, Hq, n)`` float32.
    """
    b, hq, n, _ = queries.shape
    num_kv = keys.shape[1]
    total = torch.zeros(b, num_kv, hq // num_kv, n, dtype=torch.float32, device=keys.device)
    qg = grouped(queries, num_kv)
    for start in range(query_start, n, chunk):
        stop = min(n, start + chunk)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg[..., start:stop, :], keys[:, :, :stop]).float()
        logits.mul_(scaling)
        # causal mask: only the chunk's own diagonal block has keys after some of its queries
        q_idx = torch.arange(start, stop, device=keys.device).view(-1, 1)
        k_idx = torch.arange(start, stop, device=keys.device).view(1, -1)
        logits[..., start:stop].masked_fill_(k_idx > q_idx, float("-inf"))
        if key_valid is not None:
            logits.masked_fill_(~key_valid[:, :stop].view(b, 1, 1, 1, stop), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if key_valid is not None:  # padded query rows are all -inf (NaN after softmax): they contribute nothing
            probs = torch.nan_to_num_(probs, nan=0.0) * key_valid[:, start:stop].view(b, 1, 1, -1, 1)
        total[..., :stop] += probs.sum(-2)
    return total.view(b, hq, n)


def window_causal_column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    window: int,
    scaling: float,
    key_valid: torch.Tensor | None = None,
    chunk: int = 512,
) -> torch.Tensor:
    """Column sums over all queries of attention that is causal only inside the last ``window`` x ``window`` block:
    queries before the window see every key, later ones included (KVCache-Factory's H2O from 98e8228, 2024-10-13, to
    9f9aa2e, 2026-06-22, which added its causal mask to that block only). In query chunks; padded keys get no weight
    and padded query rows add nothing. Returns ``(B, Hq, n)`` float32."""
    b, hq, n, _ = queries.shape
    num_kv = keys.shape[1]
    total = torch.zeros(b, num_kv, hq // num_kv, n, dtype=torch.float32, device=keys.device)
    qg = grouped(queries, num_kv)
    k_idx = torch.arange(n, device=keys.device).view(1, -1)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg[..., start:stop, :], keys).float()
        logits.mul_(scaling)
        q_idx = torch.arange(start, stop, device=keys.device).view(-1, 1)
        future = (k_idx > q_idx) & (q_idx >= n - window) & (k_idx >= n - window)  # the window block's upper triangle
        logits.masked_fill_(future, float("-inf"))
        if key_valid is not None:
            logits.masked_fill_(~key_valid.view(b, 1, 1, 1, n), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if key_valid is not None:
            probs = torch.nan_to_num_(probs, nan=0.0) * key_valid[:, start:stop].view(b, 1, 1, -1, 1)
        total += probs.sum(-2)
    return total.view(b, hq, n)


def attention_and_column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prompt attention and H2O's column sums from one pass over query chunks (no padding).

    The same probabilities ``A = softmax(q k^T * scaling)`` (causal) give the layer's attention output ``A v`` and
    ``column_sums``'s ``s[j] = sum_i A[i, j]``, so methods that need the column sums compute attention once instead of
    the backend's attention plus a second pass (``Method.prefill_attend``). Float32 inside, memory ``O(chunk * n)`` per
    head. Returns the output ``(B, n, Hq, D)`` in ``values.dtype`` (the backend's layout) and the sums ``(B, Hq, n)``
    float32. Chunks of 64 queries keep a chunk's logits in cache: on SmolLM2's shapes at 4k tokens (9 query / 3 KV
    heads, 2 CPU threads) one layer takes 137-149 ms (as a 5-d einsum: 147-156 ms) vs 80-85 ms for sdpa alone,
    which plus a separate ``column_sums`` pass (chunk 512, 328 ms) was the alternative; chunk 128 is 10-15 % slower.
    """
    b, hq, n, d = queries.shape
    num_kv = keys.shape[1]
    g = hq // num_kv
    total = torch.zeros(b, num_kv, g, n, dtype=torch.float32, device=keys.device)
    out = torch.empty(b, num_kv, g, n, d, dtype=torch.float32, device=keys.device)
    qg = grouped(queries, num_kv).float() * scaling  # the scale folded into the queries: one pass less
    kt, v32 = keys.float().transpose(-1, -2), values.float()
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=keys.device).triu_(1)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        c = stop - start
        # a KV head's g query heads x c queries as one (g c, D) x (D, stop) product (einsum's 5-d form was ~8 % slower)
        logits = torch.matmul(qg[..., start:stop, :].reshape(b, num_kv, g * c, d), kt[..., :stop])
        logits = logits.view(b, num_kv, g, c, stop)
        logits[..., start:stop].masked_fill_(causal[:c, :c], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        total[..., :stop] += probs.sum(-2)
        out[..., start:stop, :] = torch.matmul(probs.view(b, num_kv, g * c, stop), v32[:, :, :stop]).view(
            b, num_kv, g, c, d)
    return out.view(b, hq, n, d).transpose(1, 2).to(values.dtype), total.view(b, hq, n)


def pool1d(scores: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """SnapKV's clustering: 1-D pooling over positions, stride 1, padding kernel//2 (same length)."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    if kind == "max":
        out = F.max_pool1d(flat, kernel_size=kernel, padding=kernel // 2, stride=1)
    elif kind == "avg":
        out = F.avg_pool1d(flat, kernel_size=kernel, padding=kernel // 2, stride=1)
    else:
        raise ValueError(f"unknown pooling {kind!r}; valid: max, avg")
    return out.reshape(shape)


def page_bounds(query: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Quest's criticality of each page: ``Σ_c max(q_c m_c, q_c M_c)``, an upper bound on ``q · k`` in the page.

    query: ``(B, Hkv, g, D)``; mins / maxs: ``(B, Hkv, P, D)`` per-channel min / max keys of each page.
    Since ``M >= m``, ``max(q m, q M) = q⁺ M + q⁻ m`` with ``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)`` (two matmuls, no
    ``(P, D)`` temporary per query head). Returns ``(B, Hkv, g, P)`` float32.
    """
    q = query.float()
    pos, neg = q.clamp(min=0), q.clamp(max=0)
    return pos @ maxs.float().transpose(-1, -2) + neg @ mins.float().transpose(-1, -2)
