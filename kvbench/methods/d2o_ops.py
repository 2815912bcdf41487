"""D2O's math as small functions: layer density, per-layer allocation (water-filled), EMA-gated merging.

reference/methods.md A1.4 (steps 1-5) and A1.7 (resolutions); the official code's readings (anchors.md C.1) are the
``official_*`` functions. Everything here is plain tensor code with no model or cache in sight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvbench.methods.cache_ops import position_rank

#: official_code: softmax(-F) of the code's density (the default); paper_literal: softmax(-F) of the paper's raw
#: variance; kvbench_zscore: softmax(-z(F)), kvbench's own reading (methods.md A1.7 item 1); the rest: Table 4
ALLOCATIONS = ("official_code", "paper_literal", "kvbench_zscore", "exponential_decay", "uniform",
               "reciprocal_variance")
#: similarity feature -> passes of (feature the cosine is computed on, tensors merged with its decisions)
PASSES = {"key": [("key", ("keys", "values"))], "value": [("value", ("keys", "values"))],
          "key_value": [("key", ("keys",)), ("value", ("values",))]}


# ---- layer level ---------------------------------------------------------------------------------------------------
def layer_density(sums: torch.Tensor, key_valid) -> torch.Tensor:
    """F_l per row (A1.4 step 1): population variance over the row's real columns of the head-mean column sums.

    sums: ``(B, Hq, n)`` per-query-head column sums; ``key_valid``: None (every column), a ``(B, n)`` mask, or per row
    its columns (``PrefillContext.row_tokens``: a slice where the batch is left-padded); returns ``(B,)`` float64.
    """
    mean_heads = sums.double().mean(1)  # (B, n); column sums are linear, so this is the sum of the head-mean A
    if key_valid is None:
        return mean_heads.var(-1, unbiased=False)
    out = []
    for row in range(sums.shape[0]):
        out.append(mean_heads[row][key_valid[row]].var(unbiased=False))
    return torch.stack(out)


def official_density(sums: torch.Tensor, key_valid) -> torch.Tensor:
    """The official code's F_l: per-query-head (unbiased) variance of the column sums, min-max normalised across
    heads, averaged over heads (``modeling_llama3_7b_13b_d2o.py``, ``multimodal_entropy``), in float32 as the code
    computes it on a float32 model. Values lie in [0, 1), so softmax(-F) is nearly uniform. ``key_valid`` as
    ``layer_density``'s. Returns ``(B,)``."""
    out = []
    for row in range(sums.shape[0]):
        s = sums[row].float() if key_valid is None else sums[row][:, key_valid[row]].float()
        var = s.var(-1)
        out.append(((var - var.min()) / (var.max() - var.min() + 1e-6)).mean())
    return torch.stack(out)


def normalise_density(density: torch.Tensor, how: str) -> torch.Tensor:
    """A1.7 item 1: ``zscore`` maps F to (F - mean) / std over layers (population std; 0 when all equal)."""
    density = density.double()
    if how == "none":
        return density
    std = density.std(unbiased=False)
    return torch.zeros_like(density) if float(std) == 0.0 else (density - density.mean()) / std


def water_fill(weights: torch.Tensor, total: float, lo: float, hi: float) -> torch.Tensor:
    """Real sizes ``clamp(lam * w_l, lo, hi)`` with ``lam`` chosen so they sum to ``total`` (A1.7 item 1).

    Clamped layers give their excess (or take their deficit) proportionally from the others. Layers whose weight
    underflowed to exactly 0 stay at ``lo`` unless the positive-weight layers are all at ``hi``; then they share the
    rest equally (as if their weights were equal infinitesimals). Requires ``L * lo <= total <= L * hi``.
    """
    w = weights.double() / weights.double().sum()
    positive = w > 0

    def sizes(log_lam: float) -> torch.Tensor:
        try:
            return (math.exp(log_lam) * w).clamp(lo, hi)
        except OverflowError:  # lam > 1.8e308 when the smallest positive weight is subnormal (raw F gaps > ~708)
            return torch.exp(log_lam + torch.log(w)).clamp(lo, hi)  # log(0) = -inf: exp gives 0, clamped to lo

    low = math.log(max(lo, 1e-300)) - math.log(float(w.max())) - 1.0
    high = math.log(hi) - math.log(float(w[positive].min())) + 1.0
    if float(sizes(high).sum()) <= total:
        x = sizes(high)
        zero = ~positive
        if bool(zero.any()):
            x[zero] = torch.full((int(zero.sum()),), (total - float(x[positive].sum())) / int(zero.sum()),
                                 dtype=x.dtype).clamp(lo, hi)
        return x
    for _ in range(200):  # bisection in log(lam): weights may span hundreds of orders of magnitude
        mid = (low + high) / 2
        if float(sizes(mid).sum()) < total:
            low = mid
        else:
            high = mid
    return sizes((low + high) / 2)


def round_to_total(x: torch.Tensor, total: int, lo: int, hi: int) -> list[int]:
    """Integers within [lo, hi] summing to ``total``, by largest remainders of the real sizes ``x``."""
    base = torch.floor(x + 1e-9).long().clamp(lo, hi)
    missing = total - int(base.sum())
    frac = x - base.double()
    if missing > 0:
        order = torch.argsort(frac.masked_fill(base >= hi, -math.inf), descending=True)
        base[order[:missing]] += 1
    elif missing < 0:
        order = torch.argsort(frac.masked_fill(base <= lo, math.inf))
        base[order[:-missing]] -= 1
    return base.tolist()


def allocate(density: torch.Tensor, n: int, capacity: int, rule: str, tau_alloc: float = 1.0,
             s_min: int = 12) -> list[int]:
    """S_l for every layer of one row (A1.4 step 2): n prompt tokens, ``capacity`` tokens per layer on average.

    * ``official_code`` and ``paper_literal``: S_l = softmax(-F/tau)_l * L * capacity (= alpha_l * n with
      rho = capacity / n); ``density`` is then the code's F (``official_density``, in [0, 1): nearly uniform budgets)
      or the paper's raw variance (``layer_density``: exp(-F) underflows and the softmax is one-hot, A1.7 item 1);
    * ``kvbench_zscore``: the same softmax over the z-scored F (kvbench's own reading, A1.7 item 1);
    * ``reciprocal_variance``: shares (1/F_l) / sum(1/F), on the raw F (a z-scored F can be <= 0);
    * ``exponential_decay``: alpha_l = exp(-F_l), S_l = alpha_l * n on the raw F, *unnormalised* as in Table 4:
      the only rule whose total is not L * capacity (clamped to [S_min, n], not redistributed). With real
      variances (F >> 1) most layers sit at S_min, i.e. far below the budget -- consistent with it scoring below
      uniform in Table 4 (a z-scored F would instead put half the layers at n, far above the budget);
    * ``uniform``: S_l = capacity.

    The normalised rules are clamped to [min(s_min, capacity), n] and water-filled so that sum S_l = L * capacity
    exactly.
    """
    num_layers = density.shape[0]
    lo, hi, total = min(s_min, capacity), n, num_layers * capacity
    if rule == "uniform" or num_layers == 1:
        return [capacity] * num_layers
    if rule == "exponential_decay":
        alpha = torch.exp(-density.double())
        return [int(v) for v in torch.round(alpha * n).clamp(lo, hi).long()]
    if rule in ("official_code", "paper_literal", "kvbench_zscore"):
        how = "zscore" if rule == "kvbench_zscore" else "none"
        weights = torch.softmax(-normalise_density(density, how) / tau_alloc, dim=0)
    elif rule == "reciprocal_variance":
        weights = 1.0 / density.double().clamp(min=1e-300)
    else:
        raise ValueError(f"unknown allocation {rule!r}; valid: {', '.join(ALLOCATIONS)}")
    return round_to_total(water_fill(weights, total, lo, hi), total, lo, hi)


def official_ratios(density: torch.Tensor, rho: float) -> torch.Tensor:
    """The official code's per-layer cache ratio: softmax(-F) * L * rho clamped to [0.01, 1], not renormalised
    (``modeling_llama3_new.py``, LlamaModel.forward), in float32 and in the code's order of operations."""
    weights = torch.softmax(-density.float(), dim=0)
    return torch.clamp(weights * density.shape[0] * rho, min=0.01, max=1.0)


def official_sizes(ratios: torch.Tensor, seen: int, recent_fraction: float) -> list[tuple[int, int]]:
    """(heavy, recent) per layer as the code sizes them at the first generated token (``D2O_LayerKVCache``):
    ``int(seen * ratio * hh_split)`` and ``int(seen * ratio * recent_split)`` in float32, ``seen`` = prompt + 1."""
    heavy = torch.tensor(float(seen)) * (ratios.float() * (1 - recent_fraction))
    recent = torch.tensor(float(seen)) * (ratios.float() * recent_fraction)
    return [(int(h), int(r)) for h, r in zip(heavy.tolist(), recent.tolist())]


# ---- token level ---------------------------------------------------------------------------------------------------
#: bytes of one pass of :func:`nearest_kept`'s similarities (float32): evicted entries are compared with the kept
#: set in passes of at most this size (one pass for any prompt whose table fits: the kernels do not grow with it)
NEAREST_PASS_BYTES = 1 << 30


def nearest_kept(features: torch.Tensor, evicted: torch.Tensor, kept: torch.Tensor | None,
                 kept_valid: torch.Tensor | None):
    """Cosine similarity of each evicted entry to its most similar kept entry (A1.4 step 4.1-2).

    features: ``(B, H, n, D)``; evicted: ``(B, H, e)`` entry indices; kept: ``(B, H, k)`` entry indices of the
    kept set, ``kept_valid`` ``(B, H, k)`` False at empty slots. Returns ``m`` ``(B, H, e)`` (max cosine) and
    ``target`` ``(B, H, e)`` (entry index). Memory is ``e x k`` per head, in passes of at most
    ``NEAREST_PASS_BYTES`` (never n x n: k is the budget).
    ``kept=None``: one evicted entry per (row, head) and every other entry kept (a decode step on an unpadded cache):
    the same result without gathering the kept set or building its mask.
    """
    f = F.normalize(features.float(), dim=-1)
    d = f.shape[-1]
    if kept is None:
        fe = torch.gather(f, 2, evicted.unsqueeze(-1).expand(*evicted.shape, d))
        u = torch.einsum("bhed,bhkd->bhek", fe, f).scatter(-1, evicted.unsqueeze(-1), float("-inf"))
        return u.max(-1)
    fk = torch.gather(f, 2, kept.unsqueeze(-1).expand(*kept.shape, d))
    ms, targets = [], []
    b, h, k = kept.shape
    rows = max(1, NEAREST_PASS_BYTES // (4 * b * h * k))
    for start in range(0, evicted.shape[-1], rows):
        idx = evicted[..., start : start + rows]
        fe = torch.gather(f, 2, idx.unsqueeze(-1).expand(*idx.shape, d))
        u = torch.einsum("bhed,bhkd->bhek", fe, fk).masked_fill(~kept_valid.unsqueeze(2), float("-inf"))
        m, slot = u.max(-1)
        ms.append(m)
        targets.append(torch.gather(kept, -1, slot))
    return torch.cat(ms, -1), torch.cat(targets, -1)


def ema_gate(m: torch.Tensor, e_valid: torch.Tensor | None, tau: torch.Tensor, beta: float):
    """Merge decisions and the next threshold (A1.4 steps 4.3-4 and 5.3-4, A1.7 item 6).

    m, e_valid: ``(B, H, e)``; tau: ``(B, H)`` (NaN = not yet initialised). An uninitialised tau becomes the mean of
    this call's maxima and gates them (tau_0); an initialised one gates them first and is then updated
    tau = beta * mean(m) + (1 - beta) * tau (one evicted token per decode step, so mean(m) = m_t).
    ``e_valid=None``: one real evicted entry per (row, head) (``e = 1``), the same arithmetic with half the kernels.
    """
    if e_valid is None:
        mean_m = m[..., 0].double()
        fresh = torch.isnan(tau)
        merge = m.double() >= torch.where(fresh, mean_m, tau).unsqueeze(-1)
        return merge, torch.where(fresh, mean_m, beta * mean_m + (1 - beta) * tau)
    count = e_valid.sum(-1)
    mean_m = (m.masked_fill(~e_valid, 0.0).sum(-1) / count.clamp(min=1)).double()
    fresh = torch.isnan(tau) & (count > 0)
    threshold = torch.where(fresh, mean_m, tau)
    merge = e_valid & (m.double() >= threshold.unsqueeze(-1))
    updated = torch.where(fresh, mean_m, beta * mean_m + (1 - beta) * tau)
    return merge, torch.where(count > 0, updated, tau)


def official_gate(m: torch.Tensor, e_valid: torch.Tensor | None, tau: torch.Tensor, beta: float):
    """The official code's merge decisions (``D2O_LayerKVCache.__call__``): tau is updated first,
    ``tau = m_bar`` (first call) or ``(1 - beta) tau + beta m_bar`` with ``m_bar`` the mean maximum similarity over
    every head and evicted slot, and evicted slot i is merged in every head iff the head mean of its maxima reaches
    the updated tau. In float32, as the code computes it.

    m: ``(B, H, e)`` per-head maxima; e_valid ``(B, e)`` (False at empty slots) or None; tau ``(B, 1)`` (NaN = not
    initialised). Returns merge ``(B, H, e)`` and tau ``(B, 1)``. One evicted token per head (a decode step) makes
    update-then-compare equal to compare-then-update (methods.md A1.4); several (the first eviction) do not.
    """
    m = m.float()
    slot = m.mean(1)  # (B, e)
    if e_valid is None:
        count = torch.full(slot.shape[:1], slot.shape[-1], device=m.device)
        m_bar = slot.mean(-1)
    else:
        count = e_valid.sum(-1)
        m_bar = slot.masked_fill(~e_valid, 0.0).sum(-1) / count.clamp(min=1)
    old = tau[:, 0].float()
    new = torch.where(torch.isnan(old), m_bar, (1 - beta) * old + beta * m_bar)
    new = torch.where(count > 0, new, old)
    merge = slot >= new.unsqueeze(-1)
    if e_valid is not None:
        merge &= e_valid
    return merge.unsqueeze(1).expand_as(m), new.double().unsqueeze(-1)


def _merge_weights(m: torch.Tensor, merge: torch.Tensor, weights: str) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The self weight, the evicted entries' weights and their counts ``(B, H, e)`` of a merge (see ``merge_into``)."""
    flag = merge.float()
    m = m.float().masked_fill(~merge, 0.0)
    if weights == "weighted":
        w = torch.exp(m) * flag
        return math.e, w, w
    if weights == "average":
        return 1.0, flag, flag
    if weights == "official":
        return 1.0, m * flag, flag
    raise ValueError(f"unknown merge weights {weights!r}")


def _merged_rows(x: torch.Tensor, idx_t: torch.Tensor, evicted: torch.Tensor, self_w: float, w: torch.Tensor,
                 cnt: torch.Tensor) -> torch.Tensor:
    """The one target row per (row, head) ``(B, H, 1, D)`` after a decode step's merge of the evicted entry (the row
    unchanged where nothing merges): shared by ``merge_into`` and the static step, so both compute the same bits."""
    xc = torch.gather(x, 2, idx_t)
    xe = torch.gather(x, 2, evicted.unsqueeze(-1).expand(*evicted.shape, x.shape[-1])).float()
    merged = (self_w * xc.float() + w.unsqueeze(-1) * xe) / (self_w + cnt).unsqueeze(-1)
    return torch.where((cnt > 0).unsqueeze(-1), merged.to(x.dtype), xc)


def merge_into(x: torch.Tensor, evicted: torch.Tensor, target: torch.Tensor, m: torch.Tensor, merge: torch.Tensor,
               weights: str) -> torch.Tensor:
    """Merge the flagged evicted entries of ``x`` ``(B, H, n, D)`` into their targets; returns the new tensor.

    ``weighted`` (A1.4 step 4.5): x_c <- (e x_c + sum exp(u_e) x_e) / (e + sum exp(u_e)), a softmax over
    {self} u G_c with self logit 1; ``average``: (x_c + sum x_e) / (1 + |G_c|); ``official``: the official code's
    ``scatter_reduce(mean, include_self)`` of ``u_e * x_e``, i.e. (x_c + sum u_e x_e) / (1 + |G_c|).
    """
    self_w, w, cnt = _merge_weights(m, merge, weights)
    d = x.shape[-1]
    if evicted.shape[-1] == 1:  # a decode step: one target per (row, head); update its row only
        idx_t = target.unsqueeze(-1).expand(*target.shape, d)
        return x.scatter(2, idx_t, _merged_rows(x, idx_t, evicted, self_w, w, cnt))
    xf = x.float()
    xe = torch.gather(xf, 2, evicted.unsqueeze(-1).expand(*evicted.shape, d))
    num = torch.zeros_like(xf).scatter_add_(2, target.unsqueeze(-1).expand(*target.shape, d), w.unsqueeze(-1) * xe)
    den = torch.zeros(x.shape[:3], dtype=torch.float32, device=x.device).scatter_add_(2, target, cnt)
    merged = (self_w * xf + num) / (self_w + den).unsqueeze(-1)
    return torch.where((den > 0).unsqueeze(-1), merged.to(x.dtype), x)


# ---- the decode step on a fixed-capacity cache (engine.compile) -----------------------------------------------------
def _first_by_position(tie: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The slot ``(B, H, 1)`` of the lowest position among the slots ``tie`` marks: the entry the default path's
    ``argmin``/``max`` picks among equal values (its entries are in position order, the first one wins)."""
    return torch.argmin(positions.masked_fill(~tie, torch.iinfo(positions.dtype).max), dim=-1, keepdim=True)


def static_merge_evict(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                       acc: torch.Tensor, capacity: torch.Tensor, row_state: dict[str, torch.Tensor], beta: float,
                       feature: str, weights: str, add_score: bool, official: bool = False) -> None:
    """D2O's decode step (``D2O._compress`` of one step) on a static layer, in place: where a (row, head) holds more
    than ``capacity`` ``(B, 1, 1)`` valid slots, the entry with the lowest ``acc`` outside its ``d2o_sinks`` first and
    ``d2o_recent`` newest entries (ranks by position among the valid slots; per row in ``row_state``) is merged into
    its most similar other valid entry when the EMA gate lets it (``ema_gate``, tau per (row, head) in ``row_state``;
    ``official``: ``official_gate``, one decision per row from the head mean, tau per row), and its ``valid`` bit is
    cleared. Ties go to the lowest position, as on the default path, whose entries are in position order. No host
    read, no data-dependent shape."""
    from kvbench.engine.static import put_slots

    b, h, c = valid.shape
    _, rank = position_rank(positions, valid)  # valid slots first, by position
    counts = valid.sum(-1, keepdim=True)
    sinks, recent = row_state["d2o_sinks"].view(-1, 1, 1), row_state["d2o_recent"].view(-1, 1, 1)
    protect = (rank < sinks) | (rank >= counts - recent)
    score = acc.masked_fill(protect | ~valid, float("inf"))
    lowest = score.amin(-1, keepdim=True)  # inf where every valid entry is protected: the first one goes, as there
    victim = _first_by_position(valid & (score == lowest), positions)  # (B, H, 1)
    over = counts > capacity  # (B, H, 1): a cache within its size keeps growing up to it
    others = valid.scatter(-1, victim, False)
    for number, (feat, tensors) in enumerate(PASSES[feature]):
        f = F.normalize((keys if feat == "key" else values).float(), dim=-1)
        fe = torch.gather(f, 2, victim.unsqueeze(-1).expand(b, h, 1, f.shape[-1]))
        u = torch.einsum("bhed,bhkd->bhek", fe, f)[:, :, 0].masked_fill(~others, float("-inf"))  # (B, H, C)
        m = u.amax(-1, keepdim=True)
        target = _first_by_position(others & (u == m), positions)
        tau = row_state[f"d2o_tau_{feat}"]
        if official:  # every head of a row evicts at once (one capacity per row): the row's first head says when
            merge, updated = official_gate(m, None, tau, beta)
            tau.copy_(torch.where(over[:, :1, 0], updated, tau))
        else:
            merge, updated = ema_gate(m, None, tau, beta)
            tau.copy_(torch.where(over[..., 0], updated, tau))
        merge = merge & over
        if add_score and number == 0:
            put_slots(acc, target, torch.gather(acc, -1, victim).masked_fill(~merge, 0.0), accumulate=True)
        self_w, w, cnt = _merge_weights(m, merge, weights)
        for x in ({"keys": keys, "values": values}[name] for name in tensors):
            idx_t = target.unsqueeze(-1).expand(b, h, 1, x.shape[-1])
            put_slots(x, target, _merged_rows(x, idx_t, victim, self_w, w, cnt))
    put_slots(valid, victim, torch.gather(valid, -1, victim) & ~over)
