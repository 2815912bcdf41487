"""OmniKV's token selection at a filter layer (paper 002 §3, code ``antgroup/OmniKV``; reference/methods.md A3.3-A3.4):
the top-k prompt tokens by the current query's attention (``last``, ``softmax_before_last``) or by a window of recent
queries (``uniform``, ``exp``), the latter in the official code's reading by default. Pure tensor functions; the method
(``omnikv.py``) holds the filter layers, the window of queries and the context bank."""

from __future__ import annotations

import torch

from kvbench.engine.rope import rotate_keys
from kvbench.methods.cache_ops import top_k_mask


def select_by_last_query(query: torch.Tensor, keys: torch.Tensor, scaling: float, k: int,
                         softmax: bool) -> torch.Tensor:
    """Top-``k`` prompt entries ``(B, k)`` by the last query's logits (``last``) or probabilities
    (``softmax_before_last``), max over query heads; query ``(B, Hq, q, D)``, keys ``(B, Hkv, n, D)``."""
    logits = _logits(query[..., -1:, :], keys, scaling)[..., 0, :]  # (B, Hkv, g, n)
    if not softmax:
        return _top(logits.amax(dim=(1, 2)), k)
    return _top(torch.softmax(logits, dim=-1).amax(dim=(1, 2)), k)  # probabilities, then max over heads


def select_by_window(recent: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, scaling: float, k: int,
                     selector: str, window_reading: str, rope_inv_freq: torch.Tensor | None) -> torch.Tensor:
    """Top-``k`` prompt entries by the window's queries ``recent`` ``(B, Hq, w, D)`` at ``positions`` ``(B, w)``,
    weighted uniformly or by 2^(u - (w-1)) (``exp``). ``window_reading="paper"``: softmax over all n prompt tokens,
    the window's own prompt positions always kept and counted in k; ``"official_code"``: every window query rotated
    to the current position, the window's p prompt tokens kept outside the softmax and the top-k, which choose
    max(1, k - p) among the first n - p tokens."""
    n = keys.shape[2]
    w = recent.shape[2]
    weights = torch.ones(w, device=recent.device)
    if selector == "exp":  # 2^(u - (w-1)); the code's running sum (sum / 2 + new) gives the same weights
        weights = 2.0 ** (torch.arange(w, device=recent.device) - (w - 1)).float()
    prompt_rows = int((positions[0] < n).sum())  # window rows that are still prompt queries (batch size 1)
    if window_reading == "paper":
        probs = torch.softmax(_logits(recent, keys, scaling), dim=-1).amax(dim=(1, 2))  # (B, w, n)
        scores = (probs * weights.view(1, -1, 1)).sum(1)  # (B, n)
        if prompt_rows:  # the window's own prompt positions are always kept and count against k
            scores[:, n - prompt_rows :] = float("inf")
        return _top(scores, k)
    b, hq = recent.shape[:2]
    delta = (positions[:, -1:] - positions).float().view(b, 1, w).expand(b, hq, w)
    rotated = rotate_keys(recent.float(), delta, rope_inv_freq.to(recent.device)).to(keys.dtype)
    consider = n - prompt_rows
    forced = torch.arange(consider, n, device=keys.device).expand(b, -1)
    if consider == 0:
        return forced
    probs = torch.softmax(_logits(rotated, keys[:, :, :consider], scaling), dim=-1).amax(dim=(1, 2))
    scores = (probs * weights.view(1, -1, 1)).sum(1)  # (B, n - p)
    chosen = _top(scores, min(consider, max(1, k - prompt_rows)))
    return torch.cat([chosen, forced], dim=-1)


def slide_window(recent: torch.Tensor, positions: torch.Tensor, query: torch.Tensor, position: torch.Tensor) -> None:
    """In place (``engine.compile``): the window's queries ``(B, Hq, w, D)`` and positions ``(B, w)`` move up by one
    row and take the step's query ``(B, Hq, 1, D)`` at ``position`` ``(B,)``; rows at position -1 are empty (a prompt
    shorter than the window)."""
    recent.copy_(torch.cat([recent[:, :, 1:], query[:, :, -1:]], dim=2))
    positions.copy_(torch.cat([positions[:, 1:], position.view(-1, 1)], dim=1))


def last_query_choice(query: torch.Tensor, keys: torch.Tensor, prompt: torch.Tensor, scaling: float, k: torch.Tensor,
                      softmax: bool) -> torch.Tensor:
    """``select_by_last_query``'s choice as a mask ``(B, C)`` over slots whose first ``prompt`` ``(B, 1)`` hold the
    prompt (a device count: a job's prompts replay one graph), of a device ``k`` ``(B, 1)``."""
    logits = _logits(query[..., -1:, :], keys, scaling)[..., 0, :]  # (B, Hkv, g, C)
    inside = torch.arange(keys.shape[2], device=keys.device).view(1, -1) < prompt  # (B, C)
    logits = logits.masked_fill(~inside.view(inside.shape[0], 1, 1, -1), float("-inf"))
    scores = (torch.softmax(logits, dim=-1) if softmax else logits).amax(dim=(1, 2))
    return top_k_mask(scores.masked_fill(~inside, float("-inf")), k) & inside


def window_choice(recent: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, prompt: torch.Tensor,
                  scaling: float, k: torch.Tensor, selector: str, window_reading: str,
                  rope_inv_freq: torch.Tensor | None) -> torch.Tensor:
    """``select_by_window``'s choice as a mask ``(B, C)`` over slots whose first ``prompt`` ``(B, 1)`` hold the prompt,
    with the window's prompt rows ``p`` a tensor (no host read, fixed shapes: ``engine.compile``; the prompt's length
    and ``k`` ``(B, 1)`` device values, so a job's prompts replay one graph): the columns the official reading leaves
    out of the softmax are masked instead of cut, and its ``max(1, k - p) + p`` tokens are the best by a sort with the
    forced ones at +inf. Empty window rows (position -1) weigh nothing, and ``exp``'s weights count from the newest row,
    as the default path's shorter window does."""
    b, hq, w, _ = recent.shape
    c = keys.shape[2]
    held = positions >= 0
    weights = torch.ones(w, device=recent.device)
    if selector == "exp":
        weights = 2.0 ** (torch.arange(w, device=recent.device) - (w - 1)).float()
    weights = (weights.view(1, w) * held).unsqueeze(-1)  # (B, w, 1)
    column = torch.arange(c, device=keys.device).view(1, c)
    inside = column < prompt  # (B, C): the prompt's slots
    prompt_rows = (held & (positions < prompt)).sum(-1, keepdim=True)  # (B, 1)
    forced = inside & (column >= prompt - prompt_rows)  # (B, C)
    outside = ~inside.view(b, 1, 1, 1, c)
    if window_reading == "paper":
        logits = _logits(recent, keys, scaling).masked_fill(outside, float("-inf"))
        probs = torch.softmax(logits, dim=-1).amax(dim=(1, 2))  # (B, w, C)
        scores = (probs * weights).sum(1).masked_fill(forced, float("inf")).masked_fill(~inside, float("-inf"))
        return top_k_mask(scores, k) & inside
    delta = (positions[:, -1:] - positions).float().view(b, 1, w).expand(b, hq, w)
    rotated = rotate_keys(recent.float(), delta, rope_inv_freq.to(recent.device)).to(keys.dtype)
    logits = _logits(rotated, keys, scaling).masked_fill(forced.view(b, 1, 1, 1, c) | outside, float("-inf"))
    probs = torch.softmax(logits, dim=-1).amax(dim=(1, 2))
    scores = (probs * weights).sum(1).masked_fill(forced, float("inf"))  # every column forced: NaNs replaced
    total = torch.minimum(torch.clamp(k - prompt_rows, min=1) + prompt_rows, prompt)  # (B, 1)
    return top_k_mask(scores.masked_fill(~inside, float("-inf")), total) & inside


def _logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``(B, Hkv, g, w, n)`` float logits of queries ``(B, Hq, w, D)`` against keys ``(B, Hkv, n, D)`` (query head h
    uses KV head ``h // g``, as ``repeat_kv``)."""
    b, hkv, _, d = keys.shape
    q = queries.reshape(b, hkv, -1, queries.shape[2], d)
    return torch.einsum("bhgwd,bhnd->bhgwn", q, keys).float() * scaling


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest ``scores`` ``(B, n)``, in position order."""
    return torch.topk(scores, k, dim=-1).indices.sort(-1).values


def static_choice(slots, policy) -> None:
    """OmniKV's filter layer on a static layer (``engine.static.StaticPolicy.choose``): the ``k`` best of the prompt's
    slots (the first ``n``; ``slots.row_state["omnikv_sizes"]`` ``(B, 2)``: ``n``, ``k``, device values) by this
    step's query (``selector="last"`` / ``softmax_before_last``), or by the window of recent queries in
    ``slots.row_state`` (``uniform`` / ``exp``), written into ``slots.chosen`` ``(B, 1, C)`` in place: the selection
    its segment's sparse layers attend. ``params``: (selector, window reading)."""
    selector, window_reading = policy.params
    query, keys, chosen, row_state = slots.query, slots.keys, slots.chosen, slots.row_state
    sizes = row_state["omnikv_sizes"]
    prompt, k = sizes[:, :1], sizes[:, 1:]
    if selector in ("uniform", "exp"):
        newest = slots.positions[:, 0].masked_fill(~slots.valid[:, 0], -1).amax(-1)  # (B,): this step's token
        rope = slots.rope_inv_freq if window_reading == "official_code" else None
        slide_window(row_state["omnikv_window_q"], row_state["omnikv_window_pos"], query, newest)
        chosen.copy_(window_choice(row_state["omnikv_window_q"], row_state["omnikv_window_pos"], keys, prompt,
                                   slots.scaling, k, selector, window_reading, rope).unsqueeze(1))
    else:
        chosen.copy_(last_query_choice(query, keys, prompt, slots.scaling, k, softmax=selector != "last").unsqueeze(1))


def static_segment(slots, policy) -> torch.Tensor:
    """A sparse layer of OmniKV's segment on a static layer (``engine.static.StaticPolicy.attend``): the valid slots
    among its filter layer's choice of prompt slots (``slots.chosen`` ``(B, 1, C)``) and every slot after the prompt's
    ``n`` (``slots.row_state["omnikv_sizes"]``)."""
    b, _, c = slots.valid.shape
    after = torch.arange(c, device=slots.valid.device).view(1, 1, c) >= slots.row_state["omnikv_sizes"][:, :1, None]
    return slots.valid & (slots.chosen | after)
