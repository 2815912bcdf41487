"""Quest: query-aware page selection at every decode step over a full resident cache.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference" (ICML 2024), code
mit-han-lab/Quest. reference/methods.md B10.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.engine.scores import page_bounds
from kvbench.errors import ConfigError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_choice, check_positive, host_ints

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

GROUP_AGGREGATIONS = ("max", "mean")


@dataclass
class Quest(Method):
    """At every decode step, each layer from ``dense_layers`` on attends only to the KV pages with the highest
    criticality for the current query; nothing is evicted (resident KV = FullKV, attended entries = the budget).

    Pages: ``page_size`` consecutive entries in position order (prompt and generated tokens alike, aligned at
    position 0, as Quest's paged cache), each with the per-channel minimum ``m`` and maximum ``M`` of its keys
    (post-RoPE, as Quest's ``estimate`` kernel reads them). Criticality of a page for query head ``h``:
    ``Σ_c max(q_c m_c, q_c M_c)`` (the paper's criticality estimate, Fig. 5).

    Budget: ``budget=C`` tokens is Quest's token budget; the page budget ``C // page_size`` *includes* the page
    holding the newest token, which is always attended (the kernel path, ``InferenceController``: top-k over all
    pages but the last, ``page_budget - 1`` of them, plus the last page). A ratio budget is ``round(ρ n)`` tokens of
    the prompt. When every page fits, the step is dense. The first ``dense_layers`` layers are always dense and
    prefill is full attention (``layer_id < 2`` / ``q_len > 1`` run the dense path in ``quest_attention.py``).

    GQA: Quest is per query head (its kernels run MHA models; the evaluation script ``repeat_kv``s first). kvbench's
    cache is per KV head and the engine attends one index set per KV head, so the ``g`` query heads of a group
    share their pages: ``group_agg=max`` (default) scores a page by the largest bound over the group (still an upper
    bound on every ``q · k`` in the group, so a page critical for any head is ranked as such); ``group_agg=mean``
    averages the bounds. For MHA models (g = 1) both equal Quest exactly. Batch size 1 (pages are entry indices).
    """

    name: ClassVar[str] = "quest"
    supports_continued_forward: ClassVar[bool] = False  # its own single-query decode attention/selection
    compression: ClassVar[str] = "attention"
    supports_batching: ClassVar[bool] = False
    page_size: int = 16
    dense_layers: int = 2
    group_agg: str = "max"
    _budget: Budget | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive(self.name, page_size=self.page_size)
        check_choice(self.name, "group_agg", self.group_agg, GROUP_AGGREGATIONS)
        if self.dense_layers < 0:
            raise ConfigError(f"method 'quest': dense_layers={self.dense_layers} must be >= 0")
        self._pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (mins, maxs) of complete pages

    def min_budget_tokens(self) -> int:
        return 2 * self.page_size

    def min_budget_reason(self) -> str:
        return f"one selected page and the current page of {self.page_size} tokens"

    def validate(self, budget: Budget) -> None:
        super().validate(budget)
        self._budget = budget

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """Dense when every page fits the page budget, and in the first ``dense_layers`` layers."""
        kind = super().expected_compression(budget, prompt_len, num_layers)
        pages = -(-(prompt_len + 1) // self.page_size)  # the first decode step's entries
        fits = pages <= budget.tokens_for(prompt_len) // self.page_size
        return "none" if num_layers <= self.dense_layers or fits else kind

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        self._pages.pop(ctx.layer_idx, None)  # a new prompt: page metadata is rebuilt lazily at the first step

    # ---- page metadata -----------------------------------------------------------------------------------------
    def page_metadata(self, layer_idx: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel min / max keys ``(B, H, P, D)`` of every page, the last one possibly partial. Complete pages
        never change (nothing is evicted), so their metadata is computed once and cached per layer."""
        b, h, t, d = keys.shape
        p = self.page_size
        full = t // p
        cached = self._pages.get(layer_idx)
        done = 0 if cached is None or cached[0].shape[2] > full else cached[0].shape[2]
        if cached is None or done < full:
            fresh = keys[:, :, done * p : full * p].reshape(b, h, full - done, p, d)
            mins, maxs = fresh.amin(3), fresh.amax(3)
            if cached is not None and done:
                mins, maxs = torch.cat([cached[0], mins], dim=2), torch.cat([cached[1], maxs], dim=2)
            self._pages[layer_idx] = cached = (mins, maxs)
        mins, maxs = cached
        if t > full * p:  # the partial last page: recomputed each step (at most page_size - 1 keys)
            tail = keys[:, :, full * p :]
            mins = torch.cat([mins, tail.amin(2, keepdim=True)], dim=2)
            maxs = torch.cat([maxs, tail.amax(2, keepdim=True)], dim=2)
        return mins, maxs

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured decode step: the same page choice on the static layer (``static_pages``), with page
        metadata recomputed from the slots; the first ``dense_layers`` layers attend to everything."""
        from kvbench.engine.static import StaticPolicy

        if layer_idx < self.dense_layers:
            return StaticPolicy()
        # the page budget is read from each row's capacity in the step (a prompt shorter than the budget, whose
        # capacity is its length, replays the same graph as any other)
        return StaticPolicy(attend=static_pages, slot_multiple=self.page_size, params=(self.page_size, self.group_agg))

    # ---- engine hook ---------------------------------------------------------------------------------------------
    def select(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        if self._budget is None or self._budget.is_full or ctx.layer_idx < self.dense_layers:
            return None
        if ctx.query.shape[2] != 1:  # Quest's dense path for multi-token inputs
            return None
        t = layer.num_entries
        p = self.page_size
        num_pages = -(-t // p)
        page_budget = host_ints(layer, ctx.capacity)[0] // p
        if num_pages <= page_budget:
            return None
        mins, maxs = self.page_metadata(ctx.layer_idx, layer.keys)
        b, hq, _, d = ctx.query.shape
        hkv = layer.keys.shape[1]
        bounds = page_bounds(ctx.query.view(b, hkv, hq // hkv, d), mins, maxs)  # (B, Hkv, g, P)
        scores = bounds.amax(2) if self.group_agg == "max" else bounds.mean(2)
        top = torch.topk(scores[..., :-1], page_budget - 1, dim=-1).indices.sort(-1).values  # (B, Hkv, k-1)
        offsets = torch.arange(p, device=top.device)
        tokens = (top.unsqueeze(-1) * p + offsets).flatten(-2)
        last = torch.arange((num_pages - 1) * p, t, device=top.device).expand(b, hkv, -1)
        return torch.cat([tokens, last], dim=-1)


def static_pages(slots, policy) -> torch.Tensor:
    """Quest's step on a static layer (``engine.static.StaticPolicy.attend``) whose slots are in position order
    (nothing is evicted; slot ``i`` of a row holds its ``i``-th entry; the slot count a multiple of the page size):
    the slots ``(B, Hkv, C)`` of the ``pages - 1`` complete-or-partial pages with the highest criticality bound
    ``Σ_c max(q_c m_c, q_c M_c)`` (``engine.scores.page_bounds``) among all but the newest entry's page, plus that
    page. Per-page key minima / maxima are recomputed from the slots (no state; one pass over the cache). With fewer
    pages than ``pages`` every valid page is chosen (Quest's dense step). ``pages``, the page budget, is each row's
    ``capacity // page size`` (``Quest.select``'s), on the device: the ``pages - 1`` best of a full ranking of the
    pages, so its value is no constant of the graph. ``params``: (page size, group aggregation)."""
    page_size, group_agg = policy.params
    keys, valid, query = slots.keys, slots.valid, slots.query
    b, hkv, c, d = keys.shape
    p = c // page_size
    pages = torch.clamp(slots.capacity // page_size, max=p + 1)  # (B, 1, 1): a page budget the slots can hold
    paged = keys.view(b, hkv, p, page_size, d)
    slot_valid = valid.view(b, hkv, p, page_size)
    empty = ~slot_valid.unsqueeze(-1)
    mins = paged.masked_fill(empty, float("inf")).amin(3)
    maxs = paged.masked_fill(empty, float("-inf")).amax(3)
    bounds = page_bounds(query.view(b, hkv, -1, d), mins, maxs)  # (B, Hkv, g, P)
    scores = bounds.amax(2) if group_agg == "max" else bounds.mean(2)
    last = (valid.sum(-1, keepdim=True) - 1) // page_size  # (B, Hkv, 1): the newest entry's page
    candidate = slot_valid.any(-1).scatter(-1, last, False)
    scores = scores.masked_fill(~candidate, float("-inf"))  # also the NaNs of empty pages' infinite bounds
    ranked = torch.topk(scores, p, dim=-1).indices  # every page, best first
    best = torch.arange(p, device=scores.device) < pages - 1  # (B, 1, P): the row's first pages - 1 of the ranking
    chosen = torch.zeros_like(candidate).scatter(-1, ranked, best.expand_as(ranked))
    chosen = chosen.scatter(-1, last, True)
    return valid & chosen.repeat_interleave(page_size, dim=-1)
