"""D2O: Dynamic Discriminative Operations -- per-layer budgets from attention density, eviction + EMA-gated merging.

Wan et al., "D2O: Dynamic Discriminative Operations for Efficient Generative Inference of LLMs" (ICLR 2025,
arXiv:2406.13035; shared/papers/000), code AIoT-MLSys-Lab/D2O. reference/methods.md A1, reference/anchors.md C.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import aggregate_group
from kvbench.errors import ConfigError
from kvbench.methods.base import (
    DecodeContext,
    Method,
    PrefillContext,
    attend_with_column_sums,
    check_choice,
    check_positive,
    prompt_column_sums,
    real_rank,
    unpadded_overflow,
)
from kvbench.methods.d2o_ops import (
    ALLOCATIONS,
    VARIANCE_NORMS,
    allocate,
    ema_gate,
    layer_density,
    merge_into,
    nearest_kept,
    official_density,
    official_ratios,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

VARIANTS = ("paper", "official_code")
FEATURES = ("key", "value", "key_value")
MERGE_WEIGHTS = ("weighted", "average")
GROUP_AGG = ("mean", "max")
MERGE_SCORES = ("keep", "add")
NEVER = 2**62  # capacity of a layer the official code never compresses
# similarity feature -> passes of (feature the cosine is computed on, tensors merged with its decisions)
PASSES = {"key": [("key", ("keys", "values"))], "value": [("value", ("keys", "values"))],
          "key_value": [("key", ("keys",)), ("value", ("values",))]}


@dataclass
class D2O(Method):
    """Layer level (once, after prefill): F_l = population variance over columns of the head-mean prompt column
    sums; S_l from ``allocation`` (default inverse-variance softmax of the z-scored F, A1.7 item 1), clamped to
    [sink_size + 8, n] and water-filled so the layers sum to exactly L x budget (``last_allocation``,
    ``last_density`` per row). Token level, per (layer, KV head): keep ``sink_size`` sinks + N heavy hitters by
    accumulated attention + M recent tokens (N:M = 3:1 of S_l - T); each evicted token is merged into its most
    similar kept token (cosine of keys) iff its maximum similarity reaches the threshold tau, with GAT-style
    weights (self logit 1). tau_0 = mean of the prefill maxima; every decode step evicts the lowest-score non-sink,
    non-recent token, gates it with tau_{t-1} and updates tau_t = beta m_t + (1 - beta) tau_{t-1}. The cache of
    layer l stays at S_l. Merge targets keep their position and, by default, their accumulated score (A1.7 items
    9-10); ``merge_score="add"`` adds each merged token's accumulated score to its target's (the other reading;
    with ``similarity_feature="key_value"`` the key pass's decisions move the scores).

    ``variant="official_code"`` (AIoT-MLSys-Lab/D2O): F_l is the head mean of the min-max-normalised per-head
    variances; ratios softmax(-F) L rho clamped to [0.01, 1] and not renormalised; layers 0, 1 and the last are
    never compressed; compression starts at the first generated token (the whole prompt stays until then); the
    sinks count inside the heavy part; merge decisions and tau are shared by the KV heads (head-mean maximum
    similarity); merging is ``scatter_reduce(mean, include_self)`` of similarity-weighted evicted vectors.
    The code's EMA ``alpha * tau + belta * m`` is ``beta = belta`` here (its comment's 0.3/0.7 is beta 0.7).
    The code keeps query-head caches scored per query head; kvbench stays KV-head granular (group mean). The
    code's N:M comes from its CLI (0.1/0.1 = 1:1); here it stays ``recent_fraction``.

    Batches (left padding) work: each row gets its own S_l (shorter rows hold empty slots) and its own tau. The
    per-(row, head) tau lives in ``layer.row_state`` (KVLayer.state is per entry), reset at every prefill.
    """

    name: ClassVar[str] = "d2o"
    needs_decode_probs: ClassVar[bool] = True
    beta: float = 0.7
    recent_fraction: float = 0.25
    sink_size: int = 4
    allocation: str = "variance_softmax"
    variance_norm: str = "zscore"
    tau_alloc: float = 1.0
    similarity_feature: str = "key"
    merge_weights: str = "weighted"
    group_agg: str = "mean"
    chunk: int = 512
    variant: str = "paper"
    merge_score: str = "keep"

    def __post_init__(self) -> None:
        check_positive(self.name, beta=self.beta, tau_alloc=self.tau_alloc, chunk=self.chunk)
        for key, value, choices in (("allocation", self.allocation, ALLOCATIONS), ("variant", self.variant, VARIANTS),
                                    ("variance_norm", self.variance_norm, VARIANCE_NORMS),
                                    ("similarity_feature", self.similarity_feature, FEATURES),
                                    ("merge_weights", self.merge_weights, MERGE_WEIGHTS),
                                    ("group_agg", self.group_agg, GROUP_AGG),
                                    ("merge_score", self.merge_score, MERGE_SCORES)):
            check_choice(self.name, key, value, choices)
        if not 0 < self.beta < 1 or not 0 < self.recent_fraction < 1 or self.sink_size < 0:
            raise ConfigError(f"method 'd2o': beta={self.beta} and recent_fraction={self.recent_fraction} must be in "
                              f"(0, 1), sink_size={self.sink_size} >= 0")
        self._density: dict[int, torch.Tensor] = {}
        self.last_density: list[list[float]] = []  # per row, F_l per layer (D2O Figure 4)
        self.last_allocation: list[list[int]] = []  # per row, realised S_l per layer
        self._host_split: dict[int, tuple[list[int], list[int]]] = {}  # layer -> (T per row, M per row), host ints

    def min_budget_tokens(self) -> int:
        return self.sink_size + 2

    def sample_stats(self, row: int) -> dict:
        """``layer_variance``: F_l per layer (Figure 4's quantity); ``layer_allocation``: realised S_l per layer."""
        if row >= len(self.last_density):
            return {}
        return {"layer_variance": [float(x) for x in self.last_density[row]],
                "layer_allocation": [int(x) for x in self.last_allocation[row]]}

    def min_budget_reason(self) -> str:
        return f"{self.sink_size} sinks, one heavy hitter and one recent token"

    # ---- allocation --------------------------------------------------------------------------------------------
    def _split(self, size: int) -> tuple[int, int]:
        """Sinks T and recent M of a paper layer of S tokens: N = round(3/4 (S - T)), M = S - T - N."""
        sinks = min(self.sink_size, size)
        return sinks, size - sinks - round((1 - self.recent_fraction) * (size - sinks))

    def _row_plan(self, density: torch.Tensor, n: int, capacity: int) -> list[tuple[int, int, int]]:
        """(S_l, T_l, M_l) for every layer of one row."""
        num_layers = density.shape[0]
        if self.variant == "paper":
            sizes = allocate(density, n, capacity, self.allocation, self.variance_norm, self.tau_alloc,
                             self.sink_size + 8)
            return [(s, *self._split(s)) for s in sizes]
        plan = []
        for layer, ratio in enumerate(official_ratios(density, capacity / n).tolist()):
            if layer in (0, 1, num_layers - 1):
                plan.append((NEVER, 0, 0))
                continue
            seen = (n + 1) * ratio  # the code sizes the cache at the first generated token
            heavy, recent = int(seen * (1 - self.recent_fraction)), int(seen * self.recent_fraction)
            plan.append((heavy + recent, min(self.sink_size, heavy), recent))
        return plan

    # ---- engine hooks --------------------------------------------------------------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        return attend_with_column_sums(layer, ctx)  # the prompt's attention and its column sums in one pass

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        sums = prompt_column_sums(layer, ctx, self.chunk)  # (B, Hq, n)
        layer.state["acc"] = aggregate_group(sums, ctx.num_kv_heads, self.group_agg)
        density = official_density if self.variant == "official_code" else layer_density
        self._density[ctx.layer_idx] = density(sums, ctx.key_valid)

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        density = torch.stack([self._density.pop(i) for i in range(len(layers))], 1)  # (B, L)
        plans = [self._row_plan(density[row], int(n), int(c))
                 for row, (n, c) in enumerate(zip(ctx.prompt_lens, ctx.capacity))]
        self.last_density = density.tolist()
        self.last_allocation = [[int(n) if s == NEVER else s for s, _, _ in plan]
                                for n, plan in zip(ctx.prompt_lens, plans)]
        for idx, layer in enumerate(layers):
            device = layer.keys.device
            size, sinks, recent = (torch.tensor([plan[idx][j] for plan in plans], device=device) for j in range(3))
            layer.capacity = size
            heads = 1 if self.variant == "official_code" else layer.keys.shape[1]
            layer.row_state.update({"d2o_sinks": sinks, "d2o_recent": recent})
            for feat, _ in PASSES[self.similarity_feature]:
                layer.row_state[f"d2o_tau_{feat}"] = torch.full(
                    (len(plans), heads), float("nan"), dtype=torch.float64, device=device
                )
            self._host_split[idx] = ([plan[idx][1] for plan in plans], [plan[idx][2] for plan in plans])
            if self.variant == "paper":
                self._compress(layer, idx)

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        if ctx.probs is None or "acc" not in layer.state:
            return
        step = ctx.probs.sum(3)  # over the step's queries: (B, Hkv, g, entries)
        step = step.mean(2) if self.group_agg == "mean" else step.amax(2)
        layer.state["acc"] = layer.state["acc"] + step
        self._compress(layer, ctx.layer_idx)

    # ---- eviction + merging ---------------------------------------------------------------------------------------
    def _compress(self, layer: KVLayer, layer_idx: int) -> None:
        """Evict down to ``layer.capacity`` valid entries per (row, head), merging evicted entries (EMA gate)."""
        size, sinks, recent = layer.capacity.view(-1, 1), layer.row_state["d2o_sinks"], layer.row_state["d2o_recent"]
        if layer.valid is None:  # host-side checks (no wait for the GPU at every layer of every step)
            overflow = unpadded_overflow(layer, layer.capacity)
            if overflow == 0:
                return
            one_eviction = overflow == 1
            t, r = self._host_split.get(layer_idx, ([], []))
            if one_eviction and len(set(t)) == 1 and len(set(r)) == 1 and t[0] < layer.num_entries - r[0]:
                self._evict_one(layer, t[0], r[0])
                return
        counts = layer.valid_counts()  # (B, H)
        if layer.valid is not None:
            if bool((counts <= size).all()):
                return
            one_eviction = False
        rank = real_rank(layer)
        protect = (rank < sinks.view(-1, 1, 1)) | (rank >= (counts - recent.view(-1, 1)).unsqueeze(-1))
        scores = layer.state["acc"].masked_fill(protect & (rank >= 0), float("inf"))
        valid = layer.valid if layer.valid is not None else torch.ones_like(scores, dtype=torch.bool)
        scores = scores.masked_fill(~valid, float("-inf"))
        if one_eviction:  # one eviction per decode step
            victim = scores.argmin(-1)
            evicted, e_valid = victim.unsqueeze(-1), torch.ones_like(victim, dtype=torch.bool).unsqueeze(-1)
            everything = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
            self._merge(layer, evicted, e_valid, everything, valid.scatter(-1, evicted, False))
            layer.evict_one(victim)
            return
        keep = torch.minimum(counts, size)
        index = torch.topk(scores, int(keep.max()), dim=-1).indices
        slots = torch.arange(index.shape[-1], device=index.device)
        keep_valid = (slots < keep.unsqueeze(-1)) & (torch.gather(scores, -1, index) > float("-inf"))
        gone = valid & ~torch.zeros_like(valid).scatter(-1, index, keep_valid)
        evicted = torch.sort(gone.int(), dim=-1, descending=True, stable=True).indices[..., : int(gone.sum(-1).max())]
        self._merge(layer, evicted, torch.gather(gone, -1, evicted), index, keep_valid)
        layer.gather(index, None if bool(keep_valid.all()) else keep_valid)

    def _evict_one(self, layer: KVLayer, sinks: int, recent: int) -> None:
        """A decode step on an unpadded cache whose rows share (T, M): the victim is the lowest score between the
        sinks and the recent window (the general path's masked argmin, without building the masks)."""
        victim = layer.state["acc"][..., sinks : layer.num_entries - recent].argmin(-1) + sinks
        evicted = victim.unsqueeze(-1)
        self._merge(layer, evicted, None, None, None)
        layer.evict_one(victim)

    def _merge(self, layer: KVLayer, evicted: torch.Tensor, e_valid: torch.Tensor | None, kept: torch.Tensor | None,
               kept_valid: torch.Tensor | None) -> None:
        """Nearest kept token by cosine, EMA gate, weighted merge into keys/values (entry indices). ``kept=None``
        and ``e_valid=None``: one real evicted entry per (row, head), every other entry kept (``_evict_one``)."""
        official = self.variant == "official_code"
        for feat, tensors in PASSES[self.similarity_feature]:
            m, target = nearest_kept(layer.keys if feat == "key" else layer.values, evicted, kept, kept_valid,
                                     self.chunk)
            tau = layer.row_state[f"d2o_tau_{feat}"]
            if official:  # one decision per evicted slot from the head-mean maximum similarity, one tau per row
                merge, tau = ema_gate(m.mean(1, keepdim=True), None if e_valid is None else e_valid[:, :1], tau,
                                      self.beta)
                merge = merge.expand_as(m) if e_valid is None else merge.expand_as(m) & e_valid
            else:
                merge, tau = ema_gate(m, e_valid, tau, self.beta)
            layer.row_state[f"d2o_tau_{feat}"] = tau
            if self.merge_score == "add" and feat == PASSES[self.similarity_feature][0][0]:
                acc = layer.state["acc"]
                moved = torch.gather(acc, -1, evicted).masked_fill(~merge, 0.0)
                layer.state["acc"] = acc.scatter_add(-1, target, moved)
            weights = "official" if official else self.merge_weights
            for attr in tensors:
                setattr(layer, attr, merge_into(getattr(layer, attr), evicted, target, m, merge, weights))
