"""DynamicKV's arithmetic on tensors and lists (paper 001 eqs. 4-8, code DreamMr/DynamicKV ``dynamic_v11.py``):
the window's votes in the model's dtype (the code's), per-layer counts from the top entries of all layers so far, the
re-allocation of budgets (exact, or in the code's float32 shares), the water-fill to the exact total, and the
bookkeeping of the query-head copies of the code's window. ``dynamickv.py`` holds the method: when to re-allocate and
what each layer keeps."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvbench.engine.cache import KVLayer

KEY = "dynamickv_rank"  # per-entry rank key during prefill: pooled score, window +inf, bug_compat copies < 0


def allocate(counts: list[int], bs: int, base: int, num_layers: int) -> list[int]:
    """Eqs. 6-8 in the code's form: ``Z_i = floor(bs c_i / sum c)``, rescaled to ``sum Z = base L_total`` with
    ``floor(Z_i base L / sum Z)`` and the rounding remainder added to the last entry (exact integer arithmetic)."""
    total = sum(counts)
    z = [bs * c // total for c in counts] if total else [0] * len(counts)
    target, s = base * num_layers, sum(z)
    z = [x * target // s for x in z] if s else [0] * len(z)
    z[-1] += target - sum(z)
    return z


def allocate_official(counts: list[int], bs: int, base: int, num_layers: int) -> list[int]:
    """``allocate`` in the official code's arithmetic (``update_and_reset_budget``): shares ``c_i / sum c`` in float32,
    ``int(bs * share)`` in float32, the rescale ``int(Z_i // (sum Z / (base L)))`` in Python floats, remainder to the
    last entry. Differs from the exact form by one token where a product lands on an integer."""
    total = sum(counts)
    z = [int((bs * (torch.tensor(c) / total)).item()) for c in counts]
    target = base * num_layers
    ratio = sum(z) / target
    z = [int(x // ratio) for x in z]
    z[-1] += target - sum(z)
    return z


def model_dtype_votes(queries: torch.Tensor, keys: torch.Tensor, ws: int, scaling: float,
                      key_valid: torch.Tensor | None) -> torch.Tensor:
    """The official code's window votes ``(B, Hq, n - ws)`` in the model dtype (``budget_compute_per_layer``): logits
    ``q k^T / sqrt(d)`` in the model dtype, softmax in float32 rounded back to the model dtype, summed over the window
    in the model dtype (in bfloat16 the kept sets overlap float32 scoring's by about 0.99)."""
    b, hq, n, d = queries.shape
    k = keys.repeat_interleave(hq // keys.shape[1], dim=1) if keys.shape[1] != hq else keys
    logits = torch.matmul(queries[..., n - ws :, :], k.transpose(2, 3))
    logits = logits / math.sqrt(d) if math.isclose(scaling, d**-0.5) else logits * scaling
    causal = torch.ones(ws, ws, dtype=torch.bool, device=keys.device).triu_(1)
    logits[..., n - ws :] = logits[..., n - ws :].masked_fill(causal, float("-inf"))
    if key_valid is not None:
        logits = logits.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1, dtype=torch.float32), nan=0.0).to(queries.dtype)
    return probs[..., : n - ws].sum(-2)


def water_fill(z: list[int], caps: list[int], target: int) -> list[int]:
    """Clamp ``z_i <= caps_i`` and give the excess to the unclamped layers in proportion to their ``z`` (Eq. 8
    repeated among them, remainder to the last), until nothing exceeds its cap (methods.md A2.6 item 5 fix)."""
    out, free = list(z), list(range(len(z)))
    while True:
        over = [i for i in free if out[i] > caps[i]]
        if not over:
            return out
        for i in over:
            out[i] = caps[i]
            free.remove(i)
        if not free:
            return out
        remaining = target - sum(caps[i] for i in range(len(z)) if i not in free)
        source = sum(z[i] for i in free)
        for i in free:
            out[i] = z[i] * remaining // source if source else 0
        out[free[-1]] += remaining - sum(out[i] for i in free)


def layer_counts(scores: list[torch.Tensor], row: int, base: int) -> list[int]:
    """Eq. 5: flat top-``base H l`` over the window scores of layers ``0..l-1`` (one row); count per layer, then
    ``// l`` as the code does. scores: per layer ``(B, H, n - ws)``, ``-inf`` at padding."""
    flat = torch.stack([s[row] for s in scores]).flatten()
    done, h, past = len(scores), *scores[0].shape[1:]
    top = torch.topk(flat, base * h * done, sorted=False).indices
    return (torch.bincount(top // (h * past), minlength=done) // done).tolist()


def rank_key(scores: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
    """Per-entry rank key of the temporary cache: ``bs - r`` for the r-th of ``torch.topk(scores, bs)`` (the code's
    score-sorted temporary cache, later truncated to a prefix), ``-inf`` for the rest; rows that fit keep their
    scores. Without ties this is the score order; with ties (max pooling makes plateaus) it is the code's order."""
    key = torch.full_like(scores, float("-inf"), dtype=torch.float32)
    for row, (_, base, bs) in enumerate(rows):
        if base < 0:
            key[row] = scores[row].float()
            continue
        index = torch.topk(scores[row], bs, dim=-1).indices  # (H, bs), sorted by score as the code's cache
        ranks = torch.arange(bs, 0, -1, dtype=torch.float32, device=scores.device).expand_as(index)
        key[row].scatter_(-1, index, ranks)
    return key


def window_order(layer: KVLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Window entries (rank key +inf, valid) first, in position order: mask, order, sorted positions, sentinel."""
    key = layer.state[KEY]
    win = torch.isposinf(key) if layer.valid is None else torch.isposinf(key) & layer.valid
    big = int(layer.positions.max()) + 1
    by_pos = torch.where(win, layer.positions, big)
    order = torch.argsort(by_pos, dim=-1, stable=True)
    return win, order, by_pos.gather(-1, order), big


def mark_new_copies(layer: KVLayer) -> None:
    """bug_compat: rank each new window copy below every kept entry and older copy (the code appends them last)."""
    key = layer.state[KEY]
    win, order, sorted_pos, big = window_order(layer)
    older = (torch.isfinite(key) & (key < 0)).sum(-1, keepdim=True)
    second = torch.cat([torch.zeros_like(win[..., :1]), (sorted_pos[..., 1:] == sorted_pos[..., :-1])], -1)
    second &= sorted_pos < big
    rank = (second.cumsum(-1) - 1 + older).float()
    new_sorted = torch.where(second, -(1.0 + rank), key.gather(-1, order))
    layer.state[KEY] = key.scatter(-1, order, new_sorted)
