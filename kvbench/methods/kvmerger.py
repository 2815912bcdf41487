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
    keep_entries,
    prompt_column_sums,
)
from kvbench.methods.kvmerger_ops import device_sets, merge_sets, merging_sets, presets, runs_of

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
    capacities_from_content: ClassVar[bool] = True
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
        self._ratios: list[torch.Tensor | float] = []  # per layer of the last forward, read when asked
        self._thetas: list[torch.Tensor | float] = []

    @property
    def last_ratios(self) -> list[float]:
        return [float(x) for x in self._ratios]

    @property
    def last_thetas(self) -> list[float]:
        return [float(x) for x in self._thetas]

    def validate(self, budget: Budget) -> None:
        super().validate(budget)
        self._budget = budget

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    def sample_stats(self, row: int) -> dict:
        """``layer_ratio`` / ``layer_theta``: kept fraction of the prompt and theta per layer (the paper's Fig. 3b/9),
        means over the batch's rows and heads."""
        if not self._ratios:
            return {}
        return {"layer_ratio": self.last_ratios, "layer_theta": self.last_thetas}

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

    def _partition(self, kn, runs, room, enforce):
        """Sets (and theta) for one head or head group: fixed theta, or bisection so that #sets <= room (the budget
        less the protected tokens)."""
        def sets_at(theta, limit=None):
            out = []
            for start, stop in runs:
                out += merging_sets(kn, start, stop, theta, None if limit is None else limit - len(out))
                if limit is not None and len(out) > limit:
                    break
            return out

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
        if ctx.fits():
            return None  # nothing to merge: no column sums needed
        return attend_with_column_sums(layer, ctx)  # the prompt's attention and its column sums in one pass

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self._ratios, self._thetas = [], []
        lens, caps = ctx.host_ints()
        if ctx.fits():
            self._ratios.append(1.0)
            return
        b, h, n, _ = layer.keys.shape
        a = aggregate_group(prompt_column_sums(layer, ctx, self.chunk), ctx.num_kv_heads, self.group_agg)  # (B, H, n)
        enforce = self.enforcing()
        g = 1 if self.shared_sets else h  # partitions per row (head groups), each of h // g heads
        # R and Hh per (row, group): the recent tokens and the top of the group-mean a among the older real tokens
        protect = torch.zeros(b, g, n, dtype=torch.bool, device=a.device)
        rooms = []
        for row, (length, cap) in enumerate(zip(lens, caps)):
            n_rec, n_hh = self.protected_sizes(length, cap)
            pad = n - length  # left padding
            if n_hh:
                older = a[row].view(g, h // g, n).mean(1)[:, pad : n - n_rec]
                protect[row].scatter_(-1, torch.topk(older, n_hh, dim=-1).indices + pad, True)
            protect[row, :, n - n_rec :] = True
            rooms += [cap - n_rec - n_hh] * g
        mergeable = ~protect
        if ctx.key_valid is not None:
            mergeable &= ctx.key_valid.view(b, 1, n)
        kn = F.normalize(layer.keys.float(), dim=-1).double()  # (B, H, n, D)
        if self.shared_sets:  # one partition per row: cosine of the heads' concatenated unit keys = mean cosine
            kn = kn.transpose(1, 2).reshape(b, 1, n, -1) / math.sqrt(h)
        anchors, thetas = self._sets(kn.view(b * g, n, -1), mergeable.view(b * g, n), rooms, enforce, ctx.few_kernels)
        # each mergeable token's set, named by its anchor (the nearest anchor at or after it: its run ends at one),
        # for every head of its group, on the flattened (B * H * n, D) cache
        pos = torch.arange(n, device=a.device)
        anchor = torch.where(anchors, pos, n).flip(-1).cummin(-1).values.flip(-1).view(b, g, 1, n)
        heads = torch.arange(h, device=a.device).view(1, g, h // g, 1) + torch.arange(b, device=a.device).view(
            b, 1, 1, 1) * h
        anchor = torch.where(mergeable.view(b, g, 1, n), anchor + heads * n, -1).reshape(-1)
        score = a.reshape(-1)
        if self.pivot == "random":  # Table 3's ablation, seeded per layer
            gen = torch.Generator().manual_seed(self.seed * 100_003 + ctx.layer_idx)
            score = torch.rand(b * h * n, generator=gen).to(a.device)
        keys, values = layer.keys.reshape(b * h * n, -1), layer.values.reshape(b * h * n, -1)
        pivot, mk, mv = merge_sets(keys, values, score, anchor, self.sigma_mode, self.sigma, self.merge_weights)
        layer.keys = torch.where(pivot[:, None], mk.to(keys.dtype), keys).view(b, h, n, -1)
        layer.values = torch.where(pivot[:, None], mv.to(values.dtype), values).view(b, h, n, -1)
        kept = protect.repeat_interleave(h // g, dim=1) | pivot.view(b, h, n)
        keep_entries(layer, kept, slots=max(caps) if enforce else None)  # enforce: at most the budget by construction
        lens_t = torch.tensor(lens, dtype=torch.float64, device=a.device).view(b, 1)
        self._ratios.append((kept.sum(-1) / lens_t).mean())  # tensors: read once per sample (sample_stats)
        self._thetas.append(thetas.mean())

    def _sets(self, kn, mergeable, rooms, enforce, few_kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """Algorithm 1 on every partition ``(P, n)``: each set's anchor (newest token) ``(P, n)`` bool and each
        partition's theta. ``few_kernels``: on the device (``device_sets``, no host read, a fixed number of kernels);
        else on the host, a galloping scan from each anchor (``merging_sets``; on a CPU, where the host is the device,
        it touches ``O(n)`` similarities instead of ``device_sets``'s ``O(n^2)``). Both give the same sets."""
        if few_kernels:
            return device_sets(kn, mergeable, self.theta, rooms if enforce else None)
        kn_np, merge_np = kn.cpu().numpy(), mergeable.cpu().numpy()
        anchors = np.zeros(merge_np.shape, dtype=bool)
        thetas = []
        for p, room in enumerate(rooms):
            sets, theta = self._partition(kn_np[p], runs_of(np.nonzero(merge_np[p])[0]), room, enforce)
            anchors[p, [hi for _, hi in sets]] = True
            thetas.append(theta)
        return torch.from_numpy(anchors).to(kn.device), torch.tensor(thetas, dtype=torch.float64)
