"""KVMerger: merge runs of consecutive, cosine-similar keys into their most-attended state (Gaussian weights).

Wang et al., "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on Long-Context Tasks"
(arXiv:2407.08454; no public code). reference/methods.md A4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from kvbench.budget import Budget
from kvbench.engine.scores import aggregate_group
from kvbench.errors import ConfigError
from kvbench.methods.base import (
    Method,
    PrefillContext,
    attend_with_column_sums,
    check_choice,
    check_positive,
    prompt_column_sums,
)
from kvbench.methods.kvmerger_ops import merge_sets, merging_sets, presets, runs_of

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

SIGMA_MODES = ("mean_l2", "eq7", "fixed")
PIVOTS = ("max_attention", "random")
MERGE_WEIGHTS = ("gaussian", "average")
BUDGET_MODES = ("auto", "fixed_theta", "enforce")
GROUP_AGG = ("mean", "max")
@dataclass
class KVMerger(Method):
    """Prefill-only merging, per layer and KV head (reference/methods.md A4; generated tokens are appended).

    a = column sums of the prompt attention over all prompt queries (``column_sums``, chunked, never n x n), averaged
    over each GQA group (``group_agg``, paper Sec 6.1). R = the last ceil(recent_ratio n) tokens; Hh = the top
    ceil(heavy_ratio n) of a outside R (sinks come in through Hh). The rest is split into maximal runs of consecutive
    positions; Algorithm 1 runs on each (``merging_sets``: anchor comparison, final set emitted; keys are the cached
    post-RoPE keys) and Algorithm 2 (``merge_sets``) stores each set's merged k and v at its pivot's slot and
    position. Cache = R + Hh + one state per set.

    Ratios: None takes the paper's presets read as fractions (A4.4 item 1): budget 0.5 -> 17 % recent / 12 % heavy,
    0.35 -> 8 % / 2 %; any other budget fraction B (token budgets: B = budget / n) -> 0.34 B / 0.24 B, kvbench's
    extrapolation of the 50 % preset. ``budget_mode``: ``fixed_theta`` is the paper (theta = 0.75, the realised size
    is data-dependent; heads are padded with invalid slots to the largest head); ``enforce`` bisects theta per (layer,
    head) so |R| + |Hh| + #sets <= budget (the anchor greedy's set count is not monotone in theta, so a head can end a
    few entries short) and pads every head to exactly the budget (resident bytes = the budget's);
    there R and Hh are clamped so that merging each run into one state fits (|R| + 2|Hh| + 1 <= budget); ``auto``
    = fixed_theta for ratio budgets (the paper's 50 % / 35 %), enforce for token budgets.
    ``sigma_mode``: ``mean_l2`` (Sec 6.3, default), ``eq7`` (literal eq. 7), ``fixed`` (``sigma``, Table 5).
    ``pivot="random"`` (Table 3, seeded by ``seed`` and the layer), ``merge_weights="average"`` (Table 4).
    ``shared_sets`` (A4.4 item 5): one partition per layer from the head-mean a (R/Hh) and head-mean cosine
    similarity; pivots and weights stay per head. ``last_ratios``: valid entries / n per layer of the last forward
    (mean over rows and heads, the paper's Fig. 3b/9); ``last_thetas``: theta used per layer (mean).
    Left-padded batches work (padding is never kept). No compression when the prompt fits the budget.
    """

    name: ClassVar[str] = "kvmerger"
    compression: ClassVar[str] = "prefill"
    theta: float = 0.75
    recent_ratio: float | None = None
    heavy_ratio: float | None = None
    sigma_mode: str = "mean_l2"
    sigma: float = 1.0
    pivot: str = "max_attention"
    merge_weights: str = "gaussian"
    budget_mode: str = "auto"
    shared_sets: bool = False
    group_agg: str = "mean"
    chunk: int = 512
    seed: int = 0
    _budget: Budget | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive(self.name, chunk=self.chunk, sigma=self.sigma)
        for key, value, choices in (("sigma_mode", self.sigma_mode, SIGMA_MODES), ("pivot", self.pivot, PIVOTS),
                                    ("merge_weights", self.merge_weights, MERGE_WEIGHTS),
                                    ("budget_mode", self.budget_mode, BUDGET_MODES),
                                    ("group_agg", self.group_agg, GROUP_AGG)):
            check_choice(self.name, key, value, choices)
        if not -1 <= self.theta <= 1:
            raise ConfigError(f"method 'kvmerger': theta={self.theta} must be a cosine similarity in [-1, 1]")
        ratios = [r for r in (self.recent_ratio, self.heavy_ratio) if r is not None]
        if any(not 0 <= r < 1 for r in ratios) or sum(ratios) >= 1:
            raise ConfigError(f"method 'kvmerger': recent_ratio={self.recent_ratio}, heavy_ratio={self.heavy_ratio}"
                              " must be fractions in [0, 1) with a sum below 1")
        self.last_ratios: list[float] = []
        self.last_thetas: list[float] = []

    def validate(self, budget: Budget) -> None:
        super().validate(budget)
        self._budget = budget

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    def sample_stats(self, row: int) -> dict:
        """``layer_ratio`` / ``layer_theta``: kept fraction of the prompt and theta per layer (the paper's Fig. 3b/9),
        means over the batch's rows and heads."""
        if not self.last_ratios:
            return {}
        return {"layer_ratio": [float(x) for x in self.last_ratios],
                "layer_theta": [float(x) for x in self.last_thetas]}

    def min_budget_tokens(self) -> int:
        return 2

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """With the paper's fixed theta (ratio budgets) the kept size is data-dependent: keys that are never similar
        enough (theta = 1) keep every token, legitimately; only the enforced budget must shrink the cache."""
        kind = super().expected_compression(budget, prompt_len, num_layers)
        return kind if self.enforcing() else "none"

    def min_budget_reason(self) -> str:
        return "one recent token and one merged state"

    def enforcing(self) -> bool:
        if self.budget_mode != "auto":
            return self.budget_mode == "enforce"
        return self._budget is None or self._budget.kind != "ratio"

    def protected_sizes(self, length: int, capacity: int) -> tuple[int, int]:
        """|R| and |Hh| for a prompt of ``length`` real tokens (ceil, robust to 0.17 * 1500 = 255.00000000000003)."""
        b = self._budget.value if self._budget is not None and self._budget.kind == "ratio" else capacity / length
        rec, hh = presets(b)
        rec = rec if self.recent_ratio is None else self.recent_ratio
        hh = hh if self.heavy_ratio is None else self.heavy_ratio
        n_rec, n_hh = math.ceil(rec * length - 1e-9), math.ceil(hh * length - 1e-9)
        n_rec, n_hh = min(n_rec, length), min(n_hh, length - min(n_rec, length))
        if self.enforcing():
            n_rec = min(n_rec, capacity - 1)
            n_hh = min(n_hh, max(0, (capacity - 1 - n_rec) // 2))
        return n_rec, n_hh

    def _partition(self, kn, runs, protected, capacity, enforce):
        """Sets (and theta) for one head or head group: fixed theta, or bisection so protected + #sets <= capacity."""
        def sets_at(theta, limit=None):
            out = []
            for start, stop in runs:
                out += merging_sets(kn, start, stop, theta, None if limit is None else limit - len(out))
                if limit is not None and len(out) > limit:
                    break
            return out

        room = capacity - protected
        if not enforce:
            return sets_at(self.theta), self.theta
        if room >= sum(stop - start for start, stop in runs):  # the prompt fits: nothing to merge
            return sets_at(math.inf), 1.0
        lo, hi = -2.0, 1.0  # theta = -2 merges every run into one state, which fits by construction
        best = sets_at(lo)
        for _ in range(24):
            mid = (lo + hi) / 2
            sets = sets_at(mid, room)
            if len(sets) <= room:
                lo, best = mid, sets
                if len(sets) == room:
                    break
            else:
                hi = mid
        return best, lo

    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        if bool((ctx.prompt_lens <= ctx.capacity).all()):
            return None  # nothing to merge: no column sums needed
        return attend_with_column_sums(layer, ctx)  # the prompt's attention and its column sums in one pass

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self.last_ratios, self.last_thetas = [], []
        if bool((ctx.prompt_lens <= ctx.capacity).all()):
            self.last_ratios.append(1.0)
            return
        b, h, n, _ = layer.keys.shape
        a = aggregate_group(prompt_column_sums(layer, ctx, self.chunk), ctx.num_kv_heads, self.group_agg)  # (B, H, n)
        enforce = self.enforcing()
        kn_all = F.normalize(layer.keys.float(), dim=-1).double().cpu().numpy()
        protect_of, sets_of, ratios, thetas = {}, {}, [], []
        groups = [list(range(h))] if self.shared_sets else [[x] for x in range(h)]
        for row in range(b):
            real = torch.arange(n, device=a.device)
            if ctx.key_valid is not None:
                real = real[ctx.key_valid[row]]
            length, cap = real.numel(), int(ctx.capacity[row])
            n_rec, n_hh = self.protected_sizes(length, cap)
            for group in groups:
                older = a[row, group].mean(0)[real[: length - n_rec]]
                heavy = real[torch.topk(older, n_hh).indices] if n_hh else real[:0]
                protect = torch.cat([heavy, real[length - n_rec :]])
                mergeable = np.setdiff1d(real.cpu().numpy(), protect.cpu().numpy())
                kn = kn_all[row, group].transpose(1, 0, 2).reshape(n, -1) / math.sqrt(len(group))
                sets, theta = self._partition(kn, runs_of(mergeable), protect.numel(), cap, enforce)
                thetas.append(theta)
                for head in group:
                    protect_of[row, head], sets_of[row, head] = protect, sets[::-1]
        # Algorithm 2 for every set of the layer at once, on the flattened (B * H * n, D) cache
        flat = [(lo + (row * h + head) * n, hi + (row * h + head) * n)
                for (row, head), sets in sets_of.items() for lo, hi in sets]
        keys, values = layer.keys.clone().reshape(b * h * n, -1), layer.values.clone().reshape(b * h * n, -1)
        pivots = torch.zeros(0, dtype=torch.long, device=a.device)
        if flat:
            lo_hi = torch.tensor(flat, dtype=torch.long, device=a.device)
            score = a.reshape(-1)
            if self.pivot == "random":  # Table 3's ablation, seeded per layer
                gen = torch.Generator().manual_seed(self.seed * 100_003 + ctx.layer_idx)
                score = torch.rand(b * h * n, generator=gen)
            pivots, mk, mv = merge_sets(keys, values, score.to(a.device), lo_hi[:, 0], lo_hi[:, 1], self.sigma_mode,
                                        self.sigma, self.merge_weights)
            keys[pivots], values[pivots] = mk.to(keys.dtype), mv.to(values.dtype)
        kept = {}
        for (row, head), part in zip(sets_of, pivots.split([len(x) for x in sets_of.values()])):
            kept[row, head] = torch.cat([protect_of[row, head], part - (row * h + head) * n]).sort().values
            ratios.append(kept[row, head].numel() / int(ctx.prompt_lens[row]))
        slots = max(max(x.numel() for x in kept.values()), int(ctx.capacity.max()) if enforce else 0)
        index = torch.zeros(b, h, slots, dtype=torch.long, device=a.device)
        keep_valid = torch.zeros(b, h, slots, dtype=torch.bool, device=a.device)
        for (row, head), idx in kept.items():
            index[row, head, : idx.numel()] = idx
            index[row, head, idx.numel() :] = idx[-1]
            keep_valid[row, head, : idx.numel()] = True
        layer.keys, layer.values = keys.view(b, h, n, -1), values.view(b, h, n, -1)
        layer.gather(index, None if bool(keep_valid.all()) else keep_valid)
        self.last_ratios.append(float(np.mean(ratios)))
        self.last_thetas.append(float(np.mean(thetas)))
