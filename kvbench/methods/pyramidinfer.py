"""PyramidInfer: each layer keeps the pivotal context the layer below chose, in prefill and decode.

Yang et al., "PyramidInfer: Pyramid KV Cache Compression for High-throughput LLM Inference" (ACL 2024 Findings),
code mutonix/pyramidinfer (``models/modeling_llama_pyramidinfer.py``, ``configs/llama2_7b.json``).
reference/methods.md B13.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_choice, check_positive
from kvbench.methods.cache_ops import position_rank

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

STRATEGIES = ("cosine", "constant")
ALLOCATIONS = ("budget", "paper")
#: float32 logits of one pass of the masked prefill attention with ``PrefillContext.few_kernels`` (a GPU's form): its
#: kernels do not grow with the prompt until the prompt's logits exceed this (the CPU's form: passes of 512 queries)
PASS_BYTES = 1 << 30


def decay(layer: int, num_layers: int, ratio: float, strategy: str) -> float:
    """Retention factor of layer ``layer``: cosine ``(1 - r) (cos(π l / L) + 1) / 2 + r`` (1 at layer 0, r at depth
    L), or the constant ``r``."""
    if strategy == "constant":
        return ratio
    return (1.0 - ratio) * (math.cos(math.pi * layer / num_layers) + 1) / 2 + ratio


def paper_contexts(n: int, num_layers: int, recent_ratio: float, ratio: float, strategy: str,
                   min_context: int) -> tuple[int, list[int]]:
    """The official code's sizes: recent window ``W = 1 + int(r n)`` and context entries per layer, compounding
    ``c_{l+1} = int(c_l s(l))`` unless that is ``<= min_context`` (then ``c_l`` stays), from ``c_0 = n - W``."""
    recent = int(n * recent_ratio)
    min_ctx = min(min_context, n - 1 - recent)
    contexts = [n - 1 - recent]
    for layer in range(num_layers - 1):
        c, s = contexts[-1], decay(layer, num_layers, ratio, strategy)
        contexts.append(int(c * s) if s < 1.0 and int(c * s) > min_ctx else c)  # int(c s) > min implies c > min
    return 1 + recent, contexts


def budget_contexts(n: int, budget: int, window: int, num_layers: int, ratio: float, strategy: str,
                    min_context: int) -> list[int]:
    """Context entries per layer with the compounding profile ``Π_{i<l} s(i)`` scaled so that ``Σ_l (W + c_l)``
    is exactly ``L * budget``, each ``c_l`` in ``[min(min_context, budget - W), n - W]``, non-increasing."""
    hi = n - window
    target = num_layers * (budget - window)
    if target >= hi * num_layers:
        return [hi] * num_layers
    profile = [1.0]
    for layer in range(num_layers - 1):
        profile.append(profile[-1] * decay(layer, num_layers, ratio, strategy))
    lo = min(min_context, budget - window)
    low, high = 0.0, hi / min(profile)
    for _ in range(200):  # bisect the scale whose clamped profile sums to the target
        mid = (low + high) / 2
        low, high = (mid, high) if sum(min(hi, max(lo, mid * p)) for p in profile) < target else (low, mid)
    counts = [math.floor(min(hi, max(lo, high * p))) for p in profile]
    remainder = target - sum(counts)
    for layer in range(num_layers):  # +1 to the first layers with room: stays non-increasing
        if remainder and counts[layer] < hi:
            counts[layer] += 1
            remainder -= 1
    return counts


def generated_entries(window: int, chunk: int, keep: int, frozen: int, held: int, steps: int) -> int:
    """The entries a layer holding ``held`` (``frozen`` of them never compressed again) holds ``steps`` decode steps
    later: one more per step, and whenever ``gen_chunk`` entries past the frozen ones have left the last-W window
    the chunk keeps ``keep`` (``PyramidInfer.decode``'s schedule in closed form: the generated entries beyond the
    frozen ones and the window, ``g``, grow by one per step and fall by ``chunk`` at each compression)."""
    compressions = max(0, (held - window - frozen + steps) // chunk)
    return held + steps - compressions * (chunk - keep)


def window_weights(window: torch.Tensor, width: int, distance_weight: float) -> torch.Tensor:
    """``torch.linspace(1, distance_weight, W)`` in the last ``W`` of ``width`` columns, zero before them, for a
    device ``window`` W ``(B, 1, 1)``: linspace's own arithmetic (a float32 step; from the start below half, from the
    end above, each product and sum rounded once, as its fused multiply-add: here in float64, then float32), so the
    captured step weighs each query row as ``PyramidInfer._scores`` does. ``(B, 1, 1, width)`` float32."""
    i = (torch.arange(width, device=window.device) - (width - window)).unsqueeze(-2)  # (B, 1, 1, width)
    w = window.unsqueeze(-1)
    end = torch.full((), distance_weight, dtype=torch.float32, device=window.device)
    step = ((end - 1.0) / (w - 1).clamp(min=1).float()).double()
    weights = torch.where(i < w // 2, 1.0 + step * i.double(), end.double() - step * (w - 1 - i).double()).float()
    return torch.where(i >= 0, torch.where(w > 1, weights, 1.0), 0.0)


def static_decode(slots, probs: torch.Tensor, policy) -> None:
    """``PyramidInfer.decode`` over a static layer's slots (batch 1, the same entries in every head): the step's
    head-mean attention row joins the last rows (``slots.state["pyramidinfer_rows"]`` ``(B, 1, C, R)``, oldest
    first, the window's W in the last columns; a new entry's earlier rows are zero) and, where ``gen_chunk`` entries
    after the frozen ones have left the window, the chunk (the next ``gen_chunk`` entries by position after the first
    ``frozen``) keeps its ``keep`` entries of highest distance-weighted mean attention over the W rows and frees the
    others; ``frozen`` grows by ``keep``. W (``row_state["pyramidinfer_window"]``) is a device value: the prompt sets
    it (allocation=paper, ratio budgets) and the job's samples replay one graph."""
    chunk, keep, distance_weight = policy.params
    rows, valid = slots.state["pyramidinfer_rows"], slots.valid
    frozen = slots.row_state["pyramidinfer_frozen"]  # (B, 1, 1)
    window = slots.row_state["pyramidinfer_window"]  # (B, 1, 1)
    b, _, c, width = rows.shape  # (B, 1, C, R): one head, the heads hold the same slots
    rows.copy_(torch.cat([rows[..., 1:], probs.mean(dim=(1, 2)).view(b, 1, c, 1)], dim=-1))
    _, rank = position_rank(slots.positions, valid)
    due = valid.sum(-1, keepdim=True) - window - frozen >= chunk  # (B, H, 1)
    in_chunk = valid & (rank >= frozen) & (rank < frozen + chunk)
    weighted = (rows * window_weights(window, width, distance_weight)).sum(-1) / window.float()
    scores = weighted.masked_fill(~in_chunk, float("-inf"))
    kept = torch.zeros_like(valid).scatter_(-1, torch.topk(scores, keep, dim=-1).indices, True)
    valid.logical_and_(~(in_chunk & ~kept & due))
    frozen.add_(due[:, :1] * keep)


@dataclass
class PyramidInfer(Method):
    """Layer ``l`` keeps the *pivotal context* (PvC) chosen by layer ``l - 1`` plus the recent window of W tokens
    (layer 0: its own choice). A layer's PvC: the context tokens it holds with the highest attention from the W
    recent queries, mean over query heads, weighted ``linspace(1, distance_weight)`` from the oldest to the newest
    query and averaged; the first ``sink_size`` tokens always stay (``streamingllm_sink_len``); one PvC for all heads.

    Prefill: with ``prefill_mask`` (default) layer ``l``'s prompt attention only sees the keys layer ``l - 1`` kept,
    which is what the code computes by dropping the other tokens' hidden states (kvbench still computes those rows;
    nothing reads them). ``prefill_mask=false``: full prompt attention, eviction only.

    Sizes: ``allocation=budget`` (default): ``W = 1 + int(recent_ratio C)``, context entries per layer following the
    code's compounding profile ``Π_{i<l} s(i)``, ``s(l) = (1 - r)(cos(π l / L) + 1)/2 + r`` (r = ``decay_ratio``),
    scaled so layers average exactly the budget C (so layer 0 evicts too, which the code never does).
    ``allocation=paper``: the code's sizes, budget unused: ``W = 1 + int(0.2 n)``, layers 0-1 keep the prompt,
    ``c_{l+1} = int(c_l s(l))`` unless that is ``<= min_context``.

    Decode (the README's intent): prompt entries are never compressed again; every ``gen_chunk`` generated entries
    that left the last-W window keep ``max(1, int(gen_chunk * gen_compress_ratio * s_gen(l)))`` by the same score
    over the last W queries' rows (``s_gen``: cosine of ``gen_decay_ratio``). The code compares tokens seen with the
    layer's own length and so re-compresses kept prompt entries at every step; not reproduced. The captured decode
    step runs the same decode over the slots (``static_decode``).
    Defaults: ``configs/llama2_7b.json`` (= ``llama3_8b.json``). Batch size 1.
    """

    name: ClassVar[str] = "pyramidinfer"
    own_attention: ClassVar[bool] = True
    decode_state_outside_cache: ClassVar[bool] = True  # its attention rows per layer (_rows, _frozen)
    compression: ClassVar[str] = "prefill"
    supports_batching: ClassVar[bool] = False
    needs_decode_probs: ClassVar[bool] = True
    recent_ratio: float = 0.2
    decay_ratio: float = 0.9
    decay_strategy: str = "cosine"
    min_context: int = 64
    sink_size: int = 4
    distance_weight: float = 1.2
    gen_decay_ratio: float = 0.1
    gen_compress_ratio: float = 0.9
    gen_chunk: int = 16
    allocation: str = "budget"
    prefill_mask: bool = True

    def __post_init__(self) -> None:
        for key in ("recent_ratio", "decay_ratio", "gen_decay_ratio", "gen_compress_ratio"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(f"method 'pyramidinfer': {key}={value} must be in (0, 1]")
        check_positive(self.name, gen_chunk=self.gen_chunk, distance_weight=self.distance_weight)
        if self.min_context < 1 or self.sink_size < 0:
            raise ConfigError(f"method 'pyramidinfer': min_context={self.min_context} must be >= 1 and "
                              f"sink_size={self.sink_size} >= 0")
        check_choice(self.name, "decay_strategy", self.decay_strategy, STRATEGIES)
        check_choice(self.name, "allocation", self.allocation, ALLOCATIONS)
        self._plan: tuple[int, list[int]] | None = None  # (W, context entries per layer) of the current sample
        self._chosen: torch.Tensor | None = None  # positions the layer below kept for this layer
        self._rows: dict[int, torch.Tensor] = {}  # layer -> (W, entries) head-mean attention of the last W queries
        self._frozen: dict[int, int] = {}  # layer -> leading entries never compressed again
        self._stash: torch.Tensor | None = None  # recent rows computed by prefill_attend for prefill

    def _gen_keep(self, layer_idx: int, num_layers: int) -> int:
        """Entries a chunk of ``gen_chunk`` generated entries keeps at layer ``layer_idx``."""
        s = decay(layer_idx, num_layers, self.gen_decay_ratio, self.decay_strategy)
        return max(int(self.gen_chunk * self.gen_compress_ratio * s), 1)

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured step (``static_decode``): the layer's last-W attention rows travel as a vector per entry,
        its frozen count as row state, the schedule of what it holds as host arithmetic (``generated_entries``)."""
        from kvbench.engine.static import StaticPolicy

        if self._plan is None:  # before any prompt (has_static_step): the step exists; its sizes come with the plan
            return StaticPolicy(evict=static_decode, needs_probs=True, state=("pyramidinfer_rows",))
        window, contexts = self._plan
        keep = self._gen_keep(layer_idx, len(contexts))
        frozen = self._frozen.get(layer_idx, 0)
        return StaticPolicy(evict=static_decode, needs_probs=True, state=("pyramidinfer_rows",),
                            params=(self.gen_chunk, keep, self.distance_weight),
                            entries=partial(generated_entries, window, self.gen_chunk, keep, frozen))

    def static_state(self, layer: KVLayer, layer_idx: int, slots: int):
        """The layer's last-W attention rows in the last W of ``R = max(W, 1 + int(recent_ratio slots))`` columns
        ``(1, 1, entries, R)`` (one head: every head holds the same slots; R follows the slots, which a job shares, not
        the prompt's W), W itself and the frozen count."""
        rows = self._rows[layer_idx]  # (W, entries), oldest query first
        window, n = rows.shape
        width = max(window, 1 + int(self.recent_ratio * slots))
        per_entry = torch.zeros(1, 1, n, width, device=rows.device)  # one head: every head holds the same slots
        per_entry[..., width - window :] = rows.t()
        frozen = torch.full((1, 1, 1), self._frozen[layer_idx], dtype=torch.long, device=rows.device)
        w = torch.full((1, 1, 1), window, dtype=torch.long, device=rows.device)
        return {"pyramidinfer_rows": per_entry}, {"pyramidinfer_frozen": frozen, "pyramidinfer_window": w}

    def window(self, budget: int) -> int:
        return 1 + int(self.recent_ratio * budget)

    def _sizes(self, n: int, budget: int, num_layers: int) -> tuple[int, list[int]]:
        """The recent window and each layer's context entries for a prompt of ``n`` tokens (``budget`` tokens per
        layer, unused by ``allocation=paper``)."""
        if self.allocation == "paper":
            return paper_contexts(n, num_layers, self.recent_ratio, self.decay_ratio, self.decay_strategy,
                                  self.min_context)
        w = min(n, self.window(budget))
        return w, budget_contexts(n, budget, w, num_layers, self.decay_ratio, self.decay_strategy, self.min_context)

    def prompt_entries(self, budget: Budget, prompt_len: int, num_layers: int) -> list[int]:
        """Layer l keeps its window and ``contexts[l]`` of what layer l - 1 kept (``prefill``; the contexts do not
        grow with depth and the first is at most the prompt's, ``n - W``)."""
        window, contexts = self._sizes(prompt_len, budget.tokens_for(prompt_len), num_layers)
        return [window + c for c in contexts]

    def min_budget_tokens(self) -> int:
        if self.allocation == "paper":
            return 1  # the code's sizes: the budget is unused
        c = 1
        while c - self.window(c) < self.sink_size + 1:
            c += 1
        return c

    def min_budget_reason(self) -> str:
        return f"the recent window ({self.recent_ratio:g} of the budget), {self.sink_size} sinks and one more token"

    def validate(self, budget: Budget) -> None:
        if self.allocation == "budget":
            super().validate(budget)

    def budget_label(self, budget: Budget) -> str | None:
        if self.allocation == "paper":
            return f"ratios{self.recent_ratio:g}-{self.decay_ratio:g}"
        return None

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    # ---- attention of the recent window ------------------------------------------------------------------------
    def _recent_rows(self, queries, keys, key_pos, window: int, scaling: float) -> torch.Tensor:
        """Head-mean causal attention ``(W, K)`` of the last ``window`` queries over ``keys`` at ``key_pos``."""
        b, hq, n, d = queries.shape
        hkv = keys.shape[1]
        q = queries[:, :, n - window :].float().view(b, hkv, hq // hkv, window, d)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", q, keys.float()) * scaling
        qpos = torch.arange(n - window, n, device=keys.device)
        logits = logits.masked_fill(key_pos.view(1, -1) > qpos.view(-1, 1), float("-inf"))
        return torch.softmax(logits, dim=-1).mean(dim=(1, 2))[0]

    def _scores(self, rows: torch.Tensor) -> torch.Tensor:
        """Distance-weighted mean over the recent queries: ``(K,)``."""
        weights = torch.linspace(1.0, self.distance_weight, rows.shape[0], device=rows.device)
        return (rows * weights.view(-1, 1)).mean(0)

    # ---- engine hooks ------------------------------------------------------------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        if layer.valid is not None or ctx.queries.shape[0] != 1:
            raise NotAvailableError("method 'pyramidinfer' runs one sequence at a time (batch_size=1, no padding)")
        if ctx.layer_idx == 0:
            self._plan = self._sizes(ctx.n, ctx.host_ints()[1][0], ctx.num_layers)
            self._chosen, self._rows, self._frozen = None, {}, {}
        self._stash = None
        chosen = self._chosen
        if not self.prefill_mask or chosen is None or chosen.numel() == ctx.n:
            return None
        # layer l attends only to what layer l - 1 kept (causal), in query chunks
        q, keys, values = ctx.queries, layer.keys[:, :, chosen], layer.values[:, :, chosen]
        b, hq, n, d = q.shape
        hkv = keys.shape[1]
        rows = 512
        if ctx.few_kernels:  # a launch-bound device: as few passes as PASS_BYTES allows
            rows = max(rows, PASS_BYTES // (b * hq * keys.shape[2] * 4))
        outs = []
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            qg = q[:, :, start:stop].float().view(b, hkv, hq // hkv, stop - start, d)
            logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys.float()) * ctx.scaling
            qpos = torch.arange(start, stop, device=q.device).view(-1, 1)
            probs = torch.softmax(logits.masked_fill(chosen.view(1, -1) > qpos, float("-inf")), dim=-1)
            outs.append(torch.einsum("bhgqk,bhkd->bhgqd", probs.to(values.dtype), values).reshape(b, hq, -1, d))
        window = self._plan[0]
        self._stash = self._recent_rows(q, keys, chosen, window, ctx.scaling)
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous()

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        window, contexts = self._plan
        n, idx = ctx.n, ctx.layer_idx
        all_pos = torch.arange(n, device=layer.keys.device)
        if self._stash is not None:  # masked prefill: rows over the entries layer l - 1 kept
            held, rows = self._chosen, self._stash
        else:
            rows = self._recent_rows(ctx.queries, layer.keys, all_pos, window, ctx.scaling)
            held = self._chosen if self._chosen is not None else all_pos
            rows = rows[:, held]
        if idx == 0 and held.numel() - window > contexts[0]:  # layer 0 under a budget: its own choice
            keep = self._choose(rows, held, window, contexts[0])
            rows, held = rows[:, torch.searchsorted(held, keep)], keep
        if held.numel() < n:
            index = held.view(1, 1, -1).expand(1, layer.keys.shape[1], -1)
            layer.gather(index)
        self._rows[idx] = rows
        self._frozen[idx] = held.numel()
        if idx + 1 < ctx.num_layers:
            self._chosen = self._choose(rows, held, window, contexts[idx + 1])

    def _choose(self, rows: torch.Tensor, held: torch.Tensor, window: int, count: int) -> torch.Tensor:
        """Positions of the top ``count`` context entries of ``held`` (all but the last ``window``) by score, sinks
        first, plus the window; sorted."""
        context = held.numel() - window
        if count >= context:
            return held
        scores = self._scores(rows[:, :context])
        scores[: self.sink_size] = float("inf")
        top = torch.topk(scores, count).indices.sort().values
        return torch.cat([held[top], held[context:]])

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        idx = ctx.layer_idx
        if idx not in self._rows or ctx.probs is None:
            return
        window, _ = self._plan
        entries = layer.num_entries
        new = ctx.probs.mean(dim=(1, 2))[0]  # (q, entries): head-mean rows of this step's queries
        old = self._rows[idx]
        old = torch.cat([old, old.new_zeros(old.shape[0], entries - old.shape[1])], dim=1)
        rows = torch.cat([old, new.float()], dim=0)[-window:]
        frozen = self._frozen[idx]
        if entries - window - frozen >= self.gen_chunk:
            k = self._gen_keep(idx, ctx.num_layers)
            scores = self._scores(rows[:, frozen : frozen + self.gen_chunk])
            top = frozen + torch.topk(scores, k).indices.sort().values
            device = top.device
            index = torch.cat([torch.arange(frozen, device=device), top,
                               torch.arange(frozen + self.gen_chunk, entries, device=device)])
            layer.gather(index.view(1, 1, -1).expand(1, layer.keys.shape[1], -1))
            rows = rows[:, index]
            self._frozen[idx] = frozen + k
        self._rows[idx] = rows
