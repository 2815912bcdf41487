"""CaM: cache merging, the value of the token leaving the window is spread over the next ones with a Bernoulli mask.

Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference" (ICML 2024), code zyxxmu/cam
(``cam_hf/utils_lm_eval/modify_llama_cam.py``; ``cam_hf/utils_hh`` for generation). reference/methods.md B6; used by
D2O (paper 000) and KVMerger (paper 003). ``variant="prefill_only"``: KVCache-Factory's ``CAMKVCluster``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvbench.engine.scores import aggregate_group, column_sums, window_attention
from kvbench.errors import ConfigError
from kvbench.methods.base import (
    GRANULARITY,
    DecodeContext,
    Method,
    PrefillContext,
    check_choice,
    check_positive,
    host_ints,
    keep_top,
    real_rank,
    to_query_heads,
)
from kvbench.methods.cam_ops import decode_uniforms, layer_key, leaving_probabilities, masked_output, merge_values

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

VARIANTS = ("paper", "prefill_only")


@dataclass
class CaM(Method):
    """Start tokens + a recent window, and every token that leaves the window is merged into the values after it.

    ``paper`` (default; decode-time): the budget C splits into ``s = ⌈start_share·C⌉`` start tokens and
    ``r = C - s`` recent ones (CaM's scripts set start_ratio = recent_ratio, so 1:1). Prefill is the loop of CaM's
    lm-eval code (B6): every prompt query attends to the first s tokens and its r previous ones (Λ mask), and for each
    ``t`` in ``[s + r, n)`` the token ``x = t - r`` leaves the window with probability

        p_x = clamp(S_x(t) / max_{j ∈ [0, s) ∪ [t-r, t)} S_j(t), 0, 1),     S_j(t) = Σ_{i<t} A[i, j]

    (A: the masked attention averaged over the GQA group; CaM divides both by t). A Bernoulli draw m_x ~ B(p_x)
    decides ``v[x+1 .. x+r] += m_x v[x] / r`` in token order; keys are never merged. As in that code the prompt's
    attention output uses the merged values. Then only the first s and the last r tokens stay (real eviction).
    Decoding continues the same loop: after step t's attention the oldest recent token x = t - r leaves, merged
    with the same formula (S from the queries before t, then step t's row is added) and evicted, so the cache stays
    at C. Deviations from ``cam_hf/utils_hh`` (generation): that code runs full prefill attention and drops the
    prompt's middle unmerged at the first step, merges with the current query's row only, one token early, over a
    fixed span of 32 — kvbench continues B6's loop instead (docs/method_ambiguities.md).

    ``prefill_only``: KVCache-Factory's CAM (DynamicKV/D2O tables): if n >= C, SnapKV-style scores W_j = Σ of the
    last ``window`` queries' attention (no pooling); the same loop with ``s = ⌈start_budget_ratio·n⌉`` and span
    ``window`` over W (``p_x = W_x / max W over [0, s) ∪ [t-w, t)``), then keep the top C - w by W plus the window.
    The prompt's output uses the merged values (KVCache-Factory merges in place before its attention). No decode
    merging. The top C - w are chosen by ``torch.topk`` over the past tokens alone, then the window appended (the
    reference's selection: ties break as its do); kept tokens are stored in position order.

    GQA: ``granularity="kv_head"`` (default): attention averaged over each KV group (merge probabilities and scores;
    KVCache-Factory's ``kv_head`` mode, 2026-07). ``"query_head"``: K/V repeated to the query heads first, so every
    query head merges its own values and keeps its own tokens (KVCache-Factory's default mode; the cache is
    ``Hq / Hkv`` times larger).

    Bernoulli draws are ``m = [u < p]``, so runs are reproducible: in prefill ``u`` is uniform from a per-layer CPU
    ``torch.Generator`` seeded with ``seed + 1_000_003·layer``, drawn ``(steps, B, Hkv)`` in token order; at decode
    the draw for the token leaving the window is a hash of (seed, layer, head, the token's position)
    (``cam_ops.decode_uniforms``): no generator state, so the captured decode step (``engine.decode=graph``,
    ``static_merge``) draws what the host-driven one draws. Both are the same on every device (a GPU run merges what
    a CPU run merges). Batch size 1 (CaM's code indexes row 0).
    """

    name: ClassVar[str] = "cam"
    own_attention: ClassVar[bool] = True
    compression: ClassVar[str] = "prefill"
    needs_decode_probs: ClassVar[bool] = True
    supports_batching: ClassVar[bool] = False
    start_share: float = 0.5
    variant: str = "paper"
    window: int = 32
    start_budget_ratio: float = 0.1
    seed: int = 0
    chunk: int = 512
    granularity: str = "kv_head"

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window, chunk=self.chunk)
        check_choice(self.name, "variant", self.variant, VARIANTS)
        check_choice(self.name, "granularity", self.granularity, GRANULARITY)
        for key in ("start_share", "start_budget_ratio"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"method 'cam': {key}={getattr(self, key)} must be in [0, 1)")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"method 'cam': seed={self.seed!r} must be an integer >= 0")
        self.needs_decode_probs = self.variant == "paper"
        self._rng: dict[int, torch.Generator] = {}

    def min_budget_tokens(self) -> int:
        return self.window + 1 if self.variant == "prefill_only" else 2

    def min_budget_reason(self) -> str:
        if self.variant == "prefill_only":
            return f"the window of {self.window} recent tokens is part of the budget"
        return "at least one start and one recent token"

    def split(self, capacity: int) -> tuple[int, int]:
        """(start tokens s, recent tokens r) of a budget: s = ⌈start_share·C⌉, r = C - s (at least 1)."""
        s = min(math.ceil(self.start_share * capacity), capacity - 1)
        return s, capacity - s

    def _draws(self, layer_idx: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Uniforms from the layer's generator, a CPU one on every device: a GPU run draws what a CPU run draws (a
        CUDA generator's stream is another). On a GPU the draws travel pinned and asynchronously (no wait)."""
        draws = torch.rand(shape, generator=self._rng[layer_idx])
        if torch.device(device).type == "cpu":
            return draws
        return draws.pin_memory().to(device, non_blocking=True)

    # ---- prefill ---------------------------------------------------------------------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        dev = ctx.queries.device
        self._rng[ctx.layer_idx] = torch.Generator().manual_seed(self.seed + 1_000_003 * ctx.layer_idx)
        to_query_heads(layer, ctx, self.granularity)
        b, hq, n, d = ctx.queries.shape
        hkv = layer.keys.shape[1]
        qg = ctx.queries.view(b, hkv, hq // hkv, n, d)
        cap = ctx.host_ints()[1][0]
        if self.variant == "paper":
            s, r = self.split(cap)
            if n <= s + r:
                return None  # every query sees every token: plain causal attention, nothing leaves
            p, colsum = leaving_probabilities(qg, layer.keys, s, r, ctx.scaling)
            first, span = s, r
            layer.state["cam_acc"] = colsum
        else:
            if n < cap:
                return None
            w = self.window
            votes = window_attention(ctx.queries, layer.keys, w, ctx.scaling).sum(2)  # (B, Hq, n)
            votes = aggregate_group(votes, hkv, "mean")
            s = math.ceil(self.start_budget_ratio * n)
            x = torch.arange(s, max(s, n - w), device=dev)
            start_max = votes[..., :s].amax(-1, keepdim=True) if s else torch.zeros_like(votes[..., :1])
            window_max = votes.unfold(-1, w, 1)[..., x, :].amax(-1)  # max over [x, x + w) = [t - w, t)
            p = votes[..., x] / torch.maximum(window_max, start_max)
            p = torch.nan_to_num(p, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
            first, span = s, w
            layer.state["cam_scores"] = torch.cat([votes[..., : n - w], torch.full_like(votes[..., n - w :],
                                                                                         float("inf"))], -1)
        merge = self._draws(ctx.layer_idx, (p.shape[-1], b, hkv), dev).permute(1, 2, 0) < p
        merged = layer.values.clone()
        merge_values(merged, merge, first, span)
        layer.values = merged
        if self.variant == "paper":
            return masked_output(qg, layer.keys, merged, s, r, ctx.scaling).to(merged.dtype)
        g = hq // hkv  # causal attention over the merged values (batch 1: no padding)
        out = F.scaled_dot_product_attention(ctx.queries, layer.keys.repeat_interleave(g, 1),
                                             merged.repeat_interleave(g, 1), is_causal=True, scale=ctx.scaling)
        return out.transpose(1, 2).contiguous()

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        to_query_heads(layer, ctx, self.granularity)  # (prefill_attend did it unless the engine skipped it)
        if self.variant == "prefill_only":
            if "cam_scores" in layer.state:
                keep_top(layer, layer.state.pop("cam_scores"), ctx.capacity, window=self.window)
            return
        if "cam_acc" not in layer.state:  # the prompt fits: accumulated attention of plain causal attention
            sums = column_sums(ctx.queries, layer.keys, ctx.scaling, ctx.key_valid, chunk=self.chunk)
            layer.state["cam_acc"] = aggregate_group(sums, layer.keys.shape[1], "mean")
            return
        s, r = self.split(ctx.host_ints()[1][0])
        rank = real_rank(layer)
        keep = (rank < s) | (rank >= layer.valid_counts().unsqueeze(-1) - r)
        keep_top(layer, torch.where(keep, float("inf"), float("-inf")), ctx.capacity)

    # ---- decode ----------------------------------------------------------------------------------------------------
    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The paper's step in the captured decode (``static_merge``: the same merge, draw and eviction over the slots,
        which are not in position order there); KVCache-Factory's reading does nothing after prefill."""
        from kvbench.engine.static import StaticPolicy

        if self.variant == "prefill_only":
            return StaticPolicy()
        return StaticPolicy(evict=static_merge, needs_probs=True, state=("cam_acc",),
                            params=(self.start_share, layer_key(self.seed, layer_idx)))

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        if self.variant != "paper" or ctx.probs is None:
            return
        cap = host_ints(layer, ctx.capacity)[0]
        s, r = self.split(cap)
        layer.state["cam_step"] = ctx.probs.mean(2).sum(2)  # this step's rows, added after the merge
        while layer.num_entries > cap:
            acc = layer.state["cam_acc"]  # S_j(t): queries before this step
            p = acc[..., s] / acc.amax(-1)  # the newest entries have S = 0: the max is over start ∪ [t - r, t)
            p = torch.nan_to_num(p, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
            u = decode_uniforms(layer_key(self.seed, ctx.layer_idx), layer.positions[..., s])
            m = (u < p).to(layer.values.dtype)
            values = layer.values
            values[:, :, s + 1 : s + 1 + r] += (values[:, :, s] * m.unsqueeze(-1) / r).unsqueeze(2)
            layer.evict_at(s)
        layer.state["cam_acc"] = layer.state["cam_acc"] + layer.state.pop("cam_step")


def static_merge(slots, probs: torch.Tensor, policy) -> None:
    """``CaM.decode`` over a captured step's slots, in place: where a (row, head) holds more than its capacity, the
    entry after the ``s`` start tokens in position order (the oldest recent one) leaves: merged with probability
    ``p = S_x / max S`` (the draw of :func:`decode_uniforms` for its position) into the ``r`` entries after it, then
    its slot freed; then the step's group-mean probabilities are added to ``S`` (``state["cam_acc"]``). The same
    arithmetic as the host-driven step (its division by ``r`` in float32), with ``s`` and ``r`` computed from each
    row's capacity on the device: a job whose capacities differ (a ratio budget, prompts within the budget) replays
    one graph."""
    from kvbench.engine.static import put_slots

    share, key = policy.params
    valid, positions, values = slots.valid, slots.positions, slots.values
    acc = slots.state["cam_acc"]
    capacity = slots.capacity.view(-1, 1)  # (B, 1): s and r follow it on the device (a graph for every capacity)
    s = torch.minimum(torch.ceil(capacity.double() * share).long(), capacity - 1)  # CaM.split, in float64 as Python
    r = capacity - s
    over = valid.sum(-1) > capacity  # (B, H): the step's token made one too many
    ordered = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max)
    leaving = torch.gather(torch.argsort(ordered, dim=-1), -1, s.expand(-1, ordered.shape[1]).unsqueeze(-1))
    leaving_pos = torch.gather(ordered, -1, leaving).squeeze(-1)  # (B, H): the (s+1)-th oldest entry's position
    held = acc.masked_fill(~valid, 0.0)
    p = torch.gather(acc, -1, leaving).squeeze(-1) / held.amax(-1)
    p = torch.nan_to_num(p, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
    m = (decode_uniforms(key, leaving_pos) < p).to(values.dtype)
    source = torch.gather(values, 2, leaving.unsqueeze(-1).expand(-1, -1, 1, values.shape[-1]))  # (B, H, 1, D)
    targets = valid & (positions > leaving_pos.unsqueeze(-1)) & over.unsqueeze(-1)
    # / r as the host-driven step's division by a Python int: in float32, rounded to the values' dtype
    merged = ((source * m.view(*m.shape, 1, 1)).float() / r.view(-1, 1, 1, 1).float()).to(values.dtype)
    values.add_(merged * targets.unsqueeze(-1).to(values.dtype))  # + 0 off the targets: values + merged on them
    put_slots(valid, leaving, torch.gather(valid, -1, leaving) & ~over.unsqueeze(-1))
    acc.add_(probs.mean(2).sum(2))
