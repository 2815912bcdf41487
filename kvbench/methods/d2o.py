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
    GRANULARITY,
    DecodeContext,
    Method,
    PrefillContext,
    attend_with_column_sums,
    check_choice,
    check_positive,
    expand_to_query_heads,
    prompt_column_sums,
    real_rank,
    unpadded_overflow,
)
from kvbench.methods.d2o_ops import (
    ALLOCATIONS,
    PASSES,
    allocate,
    ema_gate,
    layer_density,
    merge_into,
    nearest_kept,
    official_density,
    official_gate,
    official_ratios,
    official_sizes,
    static_merge_evict,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.budget import Budget
    from kvbench.engine.cache import KVLayer

VARIANTS = ("paper", "official_code")
FEATURES = ("key", "value", "key_value")
MERGE_WEIGHTS = ("weighted", "average")
GROUP_AGG = ("mean", "max")
MERGE_SCORES = ("keep", "add")
# what a field left at None resolves to, per variant (paper: the paper's values; official_code: the official README's
# run, --hh_ratio 0.1 --recent_ratio 0.1 --alpha 0.5 --belta 0.5)
VARIANT_DEFAULTS = {"paper": {"beta": 0.7, "recent_fraction": 0.25},
                    "official_code": {"beta": 0.5, "recent_fraction": 0.5}}
# the official code's behaviours that bug_compat switches on together (each is also a field of its own)
BUG_COMPAT = ("granularity", "keep_edge_layers", "carry_tau")
NEVER = 2**62  # capacity of a layer the official code never compresses


@dataclass
class D2O(Method):
    """Layer level (once, after prefill): S_l from ``allocation``, clamped to [sink_size + 8, n] and water-filled so
    the layers sum to exactly L x budget (``last_allocation``, ``last_density`` per row). The default,
    ``official_code``, is the allocation of the code that produced the paper's numbers: F_l = head mean of the
    min-max-normalised per-query-head variances of the prompt column sums, S_l ~ softmax(-F) (F in [0, 1): nearly
    uniform budgets). ``paper_literal``: the paper's formula, softmax(-F) of the population variance of the head-mean
    column sums (exp(-F) underflows: one-hot before the clamp, A1.7 item 1). ``kvbench_zscore``: softmax over the
    z-scored F, kvbench's own reading (not the paper's, not the code's). ``exponential_decay``, ``uniform``,
    ``reciprocal_variance``: Table 4's alternatives on the paper's F.

    Token level, per (layer, KV head): keep ``sink_size`` sinks + N heavy hitters by accumulated attention + M recent
    tokens (N:M = 3:1 of S_l - T); each evicted token is merged into its most similar kept token (cosine of keys) iff
    its maximum similarity reaches the threshold tau, with GAT-style weights (self logit 1). tau_0 = mean of the
    prefill maxima; every decode step evicts the lowest-score non-sink, non-recent token, gates it with tau_{t-1} and
    updates tau_t = beta m_t + (1 - beta) tau_{t-1}. The cache of layer l stays at S_l. Merge targets keep their
    position and, by default, their accumulated score (A1.7 items 9-10); ``merge_score="add"`` adds each merged
    token's accumulated score to its target's (the other reading; with ``similarity_feature="key_value"`` the key
    pass's decisions move the scores).

    ``variant="official_code"`` (AIoT-MLSys-Lab/D2O 12c99d8): ratios softmax(-F) L rho clamped to [0.01, 1] and not
    renormalised (float32, as the code); compression starts at the first generated token (the whole prompt stays
    until then) with heavy = int((n + 1) r (1 - recent_fraction)) and recent = int((n + 1) r recent_fraction); the
    sinks count inside the heavy part; merge decisions are shared by the heads (head-mean maximum similarity against
    one tau per layer, tau updated before the comparison); merging is ``scatter_reduce(mean, include_self)`` of
    similarity-weighted evicted vectors. ``beta`` and ``recent_fraction`` left at None resolve to the paper's 0.7 /
    0.25 or, for official_code, to the README run's 0.5 / 0.5 (``--hh_ratio 0.1 --recent_ratio 0.1``, the code's
    ``alpha * tau + belta * m`` with alpha = belta = 0.5). The code's other behaviours are fields, off unless
    ``bug_compat=True`` (official_code only) switches them all on:

    * ``granularity="query_head"``: the code's ``repeat_kv`` cache; heavy hitters, eviction and merge targets per
      query head (the default ``kv_head`` scores each KV head by its group's mean attention, DESIGN principle 3);
    * ``keep_edge_layers``: layers 0, 1 and the last are never compressed (hard-coded in the code);
    * ``carry_tau``: each layer's tau carries over from the previous sample (the code never resets
      ``D2O_LayerKVCache.threshold`` between samples; kvbench's default resets it at every prefill).

    Resolved values are what ``describe()`` records, so a preset and its spelled-out fields hash the same.

    Batches (left padding) work: each row gets its own S_l (shorter rows hold empty slots) and its own tau. The
    per-(row, head) tau lives in ``layer.row_state`` (KVLayer.state is per entry), reset at every prefill unless
    ``carry_tau`` (then the last row's tau of the previous batch starts every row: the code runs batch 1).
    """

    name: ClassVar[str] = "d2o"
    capacities_from_content: ClassVar[bool] = True
    compression: ClassVar[str] = "prefill"
    needs_decode_probs: ClassVar[bool] = True
    beta: float | None = None
    recent_fraction: float | None = None
    sink_size: int = 4
    allocation: str = "official_code"
    tau_alloc: float = 1.0
    similarity_feature: str = "key"
    merge_weights: str = "weighted"
    group_agg: str = "mean"
    chunk: int = 512
    variant: str = "paper"
    merge_score: str = "keep"
    bug_compat: bool = False
    granularity: str | None = None
    keep_edge_layers: bool | None = None
    carry_tau: bool | None = None

    def __post_init__(self) -> None:
        check_choice(self.name, "variant", self.variant, VARIANTS)
        for key, value in VARIANT_DEFAULTS[self.variant].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        if self.bug_compat and self.variant != "official_code":
            raise ConfigError("method 'd2o': bug_compat=true reproduces the official code's behaviours and needs "
                              "variant=official_code")
        if self.granularity is None:
            self.granularity = "query_head" if self.bug_compat else "kv_head"
        for key in ("keep_edge_layers", "carry_tau"):
            if getattr(self, key) is None:
                setattr(self, key, self.bug_compat)
            elif getattr(self, key) and self.variant != "official_code":
                raise ConfigError(f"method 'd2o': {key}=true is the official code's behaviour and needs "
                                  f"variant=official_code")
        check_positive(self.name, beta=self.beta, tau_alloc=self.tau_alloc, chunk=self.chunk)
        for key, value, choices in (("allocation", self.allocation, ALLOCATIONS),
                                    ("similarity_feature", self.similarity_feature, FEATURES),
                                    ("merge_weights", self.merge_weights, MERGE_WEIGHTS),
                                    ("group_agg", self.group_agg, GROUP_AGG),
                                    ("merge_score", self.merge_score, MERGE_SCORES),
                                    ("granularity", self.granularity, GRANULARITY)):
            check_choice(self.name, key, value, choices)
        if self.variant == "official_code" and (self.allocation != "official_code" or self.tau_alloc != 1.0):
            raise ConfigError(f"method 'd2o': variant=official_code sizes layers as the code does (allocation="
                              f"official_code, tau_alloc=1.0), got allocation={self.allocation!r}, "
                              f"tau_alloc={self.tau_alloc!r}")
        if not 0 < self.beta < 1 or not 0 < self.recent_fraction < 1 or self.sink_size < 0:
            raise ConfigError(f"method 'd2o': beta={self.beta} and recent_fraction={self.recent_fraction} must be in "
                              f"(0, 1), sink_size={self.sink_size} >= 0")
        self._density: dict[int, torch.Tensor] = {}
        self.last_density: list[list[float]] = []  # per row, F_l per layer (D2O Figure 4)
        self.last_allocation: list[list[int]] = []  # per row, realised S_l per layer
        self._host_split: dict[int, tuple[list[int], list[int]]] = {}  # layer -> (T per row, M per row), host ints
        self._carried_tau: dict[tuple[int, str], torch.Tensor] = {}  # carry_tau: (layer, feature) -> last tau

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """The official code evicts from the first decode step on (the paper's reading at the end of prefill); with
        ``keep_edge_layers`` never in layers 0, 1 and the last: a model with no other layer keeps everything."""
        kind = super().expected_compression(budget, prompt_len, num_layers)
        if self.variant != "official_code" or kind == "none":
            return kind
        return "decode" if num_layers > 3 or not self.keep_edge_layers else "none"

    def min_budget_tokens(self) -> int:
        return self.sink_size + 2

    def sample_stats(self, row: int) -> dict:
        """``layer_variance``: F_l per layer (Figure 4's quantity; the code's F for allocation=official_code);
        ``layer_allocation``: realised S_l per layer."""
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
            sizes = allocate(density, n, capacity, self.allocation, self.tau_alloc, self.sink_size + 8)
            return [(s, *self._split(s)) for s in sizes]
        plan = []
        # the code sizes the cache at the first generated token: n + 1 entries
        sizes = official_sizes(official_ratios(density, capacity / n), n + 1, self.recent_fraction)
        for layer, (heavy, recent) in enumerate(sizes):
            # a layer whose cache holds the n + 1 entries of the first step is never compressed by the code
            if heavy + recent >= n + 1 or self.keep_edge_layers and layer in (0, 1, num_layers - 1):
                plan.append((NEVER, 0, 0))
                continue
            plan.append((heavy + recent, min(self.sink_size, heavy), recent))
        return plan

    # ---- engine hooks --------------------------------------------------------------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        return attend_with_column_sums(layer, ctx)  # the prompt's attention and its column sums in one pass

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        sums = prompt_column_sums(layer, ctx, self.chunk)  # (B, Hq, n)
        density = official_density if self.allocation == "official_code" else layer_density
        rows = None if ctx.key_valid is None else [ctx.row_tokens(row) for row in range(sums.shape[0])]
        self._density[ctx.layer_idx] = density(sums, rows)  # (left padding: slices of host ints, no read per row)
        if self.granularity == "query_head" and ctx.num_heads > layer.keys.shape[1]:
            expand_to_query_heads(layer, ctx.num_heads // layer.keys.shape[1])  # the code's repeat_kv cache
            layer.state["acc"] = sums
        else:
            layer.state["acc"] = aggregate_group(sums, ctx.num_kv_heads, self.group_agg)

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        # (B, L): one read of L floats per row; the allocation (a bisection over a few dozen numbers) then runs on the
        # host, as it does on a CPU, instead of reading the device at each of its steps (220 reads per prompt)
        density = torch.stack([self._density.pop(i) for i in range(len(layers))], 1).cpu()
        lens, caps = ctx.host_ints()
        plans = [self._row_plan(density[row], n, c) for row, (n, c) in enumerate(zip(lens, caps))]
        self.last_density = density.tolist()
        self.last_allocation = [[int(n) if s == NEVER else s for s, _, _ in plan]
                                for n, plan in zip(lens, plans)]
        for idx, layer in enumerate(layers):
            device = layer.keys.device
            size, sinks, recent = (torch.tensor([plan[idx][j] for plan in plans], device=device) for j in range(3))
            layer.set_capacity(size, [plan[idx][0] for plan in plans])  # the host's ints: no read back
            heads = 1 if self.variant == "official_code" else layer.keys.shape[1]
            layer.row_state.update({"d2o_sinks": sinks, "d2o_recent": recent})
            for feat, _ in PASSES[self.similarity_feature]:
                tau = torch.full((len(plans), heads), float("nan"), dtype=torch.float64, device=device)
                if self.carry_tau and (idx, feat) in self._carried_tau:  # the code's threshold outlives the sample
                    tau[:] = self._carried_tau[(idx, feat)].to(device)
                layer.row_state[f"d2o_tau_{feat}"] = tau
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

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """``engine.compile``: the same step on a fixed-capacity layer (``d2o_ops.static_merge_evict``): one
        eviction per step, merged through the EMA gate, the state in ``row_state``. ``variant=official_code``
        compresses the whole prompt at the first decode step (many evictions at once): that step runs on the default
        path and the layers become static after it (``static_after_first_step``); a row the code never compresses
        (capacity ``NEVER``) never holds more than its capacity, so it never evicts."""
        from kvbench.engine.static import StaticPolicy

        official = self.variant == "official_code"
        weights = "official" if official else self.merge_weights
        return StaticPolicy(evict=static_evict, accumulate=True, acc_agg=self.group_agg,
                            params=(self.beta, self.similarity_feature, weights, self.merge_score == "add", official))

    def static_after_first_step(self) -> bool:
        return self.variant == "official_code"

    def keeps_state_after_generation(self) -> bool:
        return self.carry_tau

    def after_generation(self, layers: list[KVLayer]) -> None:
        """``carry_tau`` after a captured generation: each layer's last row's thresholds as the captured step left them
        (what ``_merge`` records at every merge on the host-driven path)."""
        for idx, layer in enumerate(layers):
            for feat, _ in PASSES[self.similarity_feature]:
                tau = layer.row_state.get(f"d2o_tau_{feat}")
                if tau is not None and not bool(torch.isnan(tau[-1]).all()):  # NaN: no merge yet (nothing recorded)
                    self._carried_tau[(idx, feat)] = tau[-1].detach().clone()

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
                self._evict_one(layer, layer_idx, t[0], r[0])
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
            self._merge(layer, layer_idx, evicted, e_valid, everything, valid.scatter(-1, evicted, False))
            layer.evict_one(victim)
            return
        keep = torch.minimum(counts, size)
        host = None
        if layer.valid is None:  # every entry valid, none scored -inf: the sizes are host ints (no read)
            n = layer.num_entries
            host = [min(n, c) for c in layer.capacity_list()]
            most, evicted_most = max(host), n - min(host)
        else:
            most = int(keep.max())
        index = torch.topk(scores, most, dim=-1).indices
        slots = torch.arange(index.shape[-1], device=index.device)
        keep_valid = (slots < keep.unsqueeze(-1)) & (torch.gather(scores, -1, index) > float("-inf"))
        gone = valid & ~torch.zeros_like(valid).scatter(-1, index, keep_valid)
        if host is None:
            evicted_most = int(gone.sum(-1).max())
        evicted = torch.sort(gone.int(), dim=-1, descending=True, stable=True).indices[..., :evicted_most]
        self._merge(layer, layer_idx, evicted, torch.gather(gone, -1, evicted), index, keep_valid)
        if host is not None and min(host) == most:  # every row keeps ``most``: no empty slot (host ints)
            layer.gather(index)
        else:  # host ints say a row keeps fewer (no read), or set_valid reads the mask
            layer.gather(index, keep_valid, partial=host is not None)

    def _evict_one(self, layer: KVLayer, layer_idx: int, sinks: int, recent: int) -> None:
        """A decode step on an unpadded cache whose rows share (T, M): the victim is the lowest score between the
        sinks and the recent window (the general path's masked argmin, without building the masks)."""
        victim = layer.state["acc"][..., sinks : layer.num_entries - recent].argmin(-1) + sinks
        evicted = victim.unsqueeze(-1)
        self._merge(layer, layer_idx, evicted, None, None, None)
        layer.evict_one(victim)

    def _merge(self, layer: KVLayer, layer_idx: int, evicted: torch.Tensor, e_valid: torch.Tensor | None,
               kept: torch.Tensor | None, kept_valid: torch.Tensor | None) -> None:
        """Nearest kept token by cosine, EMA gate, weighted merge into keys/values (entry indices). ``kept=None``
        and ``e_valid=None``: one real evicted entry per (row, head), every other entry kept (``_evict_one``)."""
        official = self.variant == "official_code"
        for feat, tensors in PASSES[self.similarity_feature]:
            m, target = nearest_kept(layer.keys if feat == "key" else layer.values, evicted, kept, kept_valid)
            tau = layer.row_state[f"d2o_tau_{feat}"]
            if official:  # one decision per evicted slot from the head-mean maximum similarity, one tau per row
                merge, tau = official_gate(m, None if e_valid is None else e_valid[:, 0], tau, self.beta)
                if e_valid is not None:
                    merge = merge & e_valid
            else:
                merge, tau = ema_gate(m, e_valid, tau, self.beta)
            layer.row_state[f"d2o_tau_{feat}"] = tau
            if self.carry_tau:
                self._carried_tau[(layer_idx, feat)] = tau[-1].detach().clone()
            if self.merge_score == "add" and feat == PASSES[self.similarity_feature][0][0]:
                acc = layer.state["acc"]
                moved = torch.gather(acc, -1, evicted).masked_fill(~merge, 0.0)
                layer.state["acc"] = acc.scatter_add(-1, target, moved)
            weights = "official" if official else self.merge_weights
            for attr in tensors:
                setattr(layer, attr, merge_into(getattr(layer, attr), evicted, target, m, merge, weights))


def static_evict(slots, probs, policy) -> None:
    """D2O's decode step on a static layer (``engine.static.StaticPolicy.evict``): one eviction where a (row, head)
    is over its capacity, merged into its most similar slot through the EMA gate (``d2o_ops.static_merge_evict``;
    ``params``: beta, the similarity feature, the merge weights, whether the merged score is added, the official
    code's gate)."""
    static_merge_evict(slots.keys, slots.values, slots.positions, slots.valid, slots.acc, slots.capacity,
                       slots.row_state, *policy.params)
