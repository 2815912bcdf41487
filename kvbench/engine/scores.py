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
    """Attention of the last ``window`` queries over all keys, causal inside the window (SnapKV's observation). The
    queries are those of the newest keys: the prompt's (as many as keys), or during decode the buffered recent ones
    (fewer; ``methods.decode_compression``).

    Returns probabilities ``(B, Hq, window, n)`` in float32.
    """
    n = keys.shape[-2]
    num_kv = keys.shape[1]
    q = grouped(queries[..., queries.shape[-2] - window :, :], num_kv)  # (B, Hkv, g, w, D)
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
    few_kernels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prompt attention and H2O's column sums, without the backend's attention plus a second pass (no padding).

    The same probabilities ``A = softmax(q k^T * scaling)`` (causal) give the layer's attention output ``A v`` and
    ``column_sums``'s ``s[j] = sum_i A[i, j]``, so methods that need the column sums compute attention once instead of
    the backend's attention plus a second pass (``Method.prefill_attend``). Returns the output ``(B, n, Hq, D)`` in
    ``values.dtype`` (the backend's layout) and the sums ``(B, Hq, n)`` float32. Two forms, equal up to float rounding:

    * ``few_kernels=False`` (a CPU's compute-bound regime): one pass over chunks of 64 queries, float32, memory
      ``O(chunk * n)`` per head; a chunk's logits stay in cache. On SmolLM2's shapes at 4k tokens (9 query / 3 KV
      heads) one layer takes 137-149 ms at 2 CPU threads (as a 5-d einsum: 147-156 ms) vs 80-85 ms for sdpa alone, which
      plus a separate ``column_sums`` pass (chunk 512, 328 ms) was the alternative; chunk 128 is 10-15 % slower. The
      number of kernels grows with ``n / chunk``.
    * ``few_kernels=True`` (a GPU's launch-bound regime; the session's default on CUDA): two fused attention kernels
      whatever ``n`` (:func:`causal_column_sums`), memory ``O(n)``. At 4k on this CPU it is 0.37 s vs 0.32 s per
      layer at 2 threads, 0.40 s vs 0.27 s at 1 thread: the chunked pass stays the CPU's.
    """
    if few_kernels:
        g = queries.shape[1] // keys.shape[1]
        k, v = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)  # transient, per query head
        out, lse = attention_with_lse(queries, k, v, scaling)
        return out.transpose(1, 2).to(values.dtype), causal_column_sums(queries, k, lse, scaling)
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


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` over ``k``/``v`` (all ``(B, H, n, D)``, the same heads) in one fused kernel that also
    returns each query's log-sum-exp ``lse[i] = log sum_{j <= i} exp(scaling q_i k_j)`` ``(B, H, n)`` float32.

    The kernel is PyTorch's own scaled-dot-product attention entry that returns the log-sum-exp: the CPU flash kernel,
    CUDA's flash kernel (half precision, head dim a multiple of 8 up to 256) or its memory-efficient kernel (else).
    """
    n = q.shape[-2]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scaling)
    elif q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scaling)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True,
                                                                          scale=scaling)[:2]
    return out, lse[..., :n].float()  # the memory-efficient kernel pads the log-sum-exp to a multiple of 32


def causal_column_sums(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """H2O's column sums ``s[j] = sum_{i >= j} exp(scaling q_i k_j - lse[i])`` of causal attention, from the queries'
    log-sum-exp (:func:`attention_with_lse`), as one more fused attention kernel: no n x n tensor, no loop.

    ``s[j]`` is the softmax denominator of a "transposed" attention in which key j is the query and the prompt
    queries are the keys, each biased by ``-lse[i]``: its log-sum-exp is ``log s[j]``. The bias rides in extra
    channels (``[k_j, 1, 1] . [q_i, hi_i, lo_i]`` with ``hi_i + lo_i = -lse[i] / scaling``: two parts, so that a
    bfloat16 kernel carries the bias to ~16 bits), and reversing both sequences turns ``i >= j`` into the kernel's
    causal mask. q, k: ``(B, H, n, D)`` with the same heads; returns ``(B, H, n)`` float32.
    """
    b, h, n, d = q.shape
    width = d + 2 if q.device.type == "cpu" else -(-(d + 2) // 8) * 8  # CUDA kernels want a multiple of 8
    bias = -lse.flip(-1) / scaling
    hi = bias.to(q.dtype)
    qt = torch.zeros(b, h, n, width, dtype=q.dtype, device=q.device)
    kt = torch.zeros(b, h, n, width, dtype=q.dtype, device=q.device)
    qt[..., :d] = k.flip(2)
    qt[..., d : d + 2] = 1
    kt[..., :d] = q.flip(2)
    kt[..., d] = hi
    kt[..., d + 1] = (bias - hi.float()).to(q.dtype)
    _, lse_t = attention_with_lse(qt, kt, kt, scaling)  # the values are never read: any tensor of the right shape
    return lse_t.exp().flip(-1)


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
