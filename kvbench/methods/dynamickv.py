"""DynamicKV: SnapKV-style selection with per-layer budgets re-allocated progressively during prefill.

Zhou et al., "DynamicKV: Task-Aware Adaptive KV Cache Compression for Long Context LLMs" (EMNLP 2025 Findings,
arXiv:2412.14838; paper 001), code DreamMr/DynamicKV (``dynamic_v11.py``). reference/methods.md A2, anchors.md C.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import aggregate_group, pool1d, window_attention
from kvbench.errors import ConfigError
from kvbench.methods.base import (
    GRANULARITY,
    Method,
    PrefillContext,
    check_choice,
    check_positive,
    expand_to_query_heads,
    keep_top,
)
from kvbench.methods.dynamickv_ops import (
    KEY,
    allocate,
    allocate_official,
    layer_counts,
    mark_new_copies,
    model_dtype_votes,
    rank_key,
    water_fill,
    window_order,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

POOLING = ("avg", "max")
VARIANTS = ("paper", "official_code")
SCHEDULES = ("paper", "official_code")
SCORE_DTYPES = ("float32", "model")
ARITHMETIC = ("exact", "official_code")
# what a field left at None resolves to, per variant (official_code: DreamMr/DynamicKV 8ab3c08, dynamic_v11.py)
VARIANT_DEFAULTS = {
    "paper": {"granularity": "kv_head", "count_remainder": False, "schedule": "paper", "score_dtype": "float32",
              "allocation_arithmetic": "exact"},
    "official_code": {"granularity": "query_head", "count_remainder": True, "schedule": "official_code",
                      "score_dtype": "model", "allocation_arithmetic": "official_code"},
}


@dataclass
class DynamicKV(Method):
    """Prefill-only. Per layer l, window scores ``W[h, j] = sum_{last ws queries i} A[i, j]`` over past tokens
    ``j < n - ws``, pooled (``A_l``, Eq. 1). Each layer first keeps a temporary ``bs = min(r_max base, n - ws)``
    tokens (Eqs. 2-4, ``base = budget - ws``) plus the window. After layers ``m-1, 2m-1, ...`` and once after the
    last layer, layers ``0..l-1`` are re-allocated (Eqs. 5-8, methods.md A2.3 step 4): flat top-``base H l`` over
    their stacked scores, count per layer (``// l``), ``Z_i = floor(bs c_i / sum c)``, rescaled so that
    ``sum Z = base L`` (L = all layers, even at intermediate updates: A2.6 item 4), remainder to the last layer;
    each layer is truncated to its ``Z_i`` highest-scored cached tokens plus the window. Final lengths
    ``Z_l + ws`` with ``sum_l Z_l = base L`` exactly, per row. Shapes: scores ``(B, H, n - ws)``, cache
    ``(B, H, Z_l + ws, D)``; ``self.last_allocation`` holds row 0's per-layer entries (the paper's Figure 2 data),
    ``self.last_allocations`` every row's.

    Paper vs official code: ``variant="paper"`` (default) is the paper with methods.md's resolutions;
    ``variant="official_code"`` resolves every field left at None to DreamMr/DynamicKV's behaviour (8ab3c08,
    ``dynamic_v11.py`` + ``llama_model_impl/dynamickv_v11.py``): granularity query_head, count_remainder, the
    code's update schedule, model-dtype scores and the code's float arithmetic. Resolved values are what
    ``describe()`` records. The window duplication stays a separate ``bug_compat`` (off by default in both):

    * ``schedule="paper"``: re-allocate after layers ``m-1, 2m-1, ...`` and once more after the last layer, so every
      layer ends at its final budget. ``"official_code"``: only when ``layer_idx % m == m - 1``; on a model whose
      layer count is not a multiple of m the layers after the last such update keep their temporary
      ``bs + ws`` entries (on 30 layers, layers 28 and 29: 1.5-1.6x the budget stays resident, really held).
    * ``score_dtype="float32"``: window attention summed and pooled in float32. ``"model"``: the code's model-dtype
      logits, softmax rounded back to the model dtype, sum and pooling in the model dtype (``model_dtype_votes``).
    * ``allocation_arithmetic="exact"``: Eqs. 6-8 in exact integers. ``"official_code"``: the code's float32 shares
      and Python-float rescale (``allocate_official``), one token apart where a product lands on an integer.

    * ``bug_compat=False`` (default): ``Z_i`` is clamped to what layer i still holds and the excess goes to the
      unclamped layers (``water_fill``). ``True``: the code's ``k_cache[:, :, :Z_i]`` reaches into the window when
      ``Z_i`` exceeds it, so window tokens are cached twice (only the ``Z_i <= n - ws`` clamp), A2.6 item 5.
    * ``granularity="kv_head"`` (default; DESIGN principle 3, GQA-native): window scores are averaged over each
      GQA group before pooling, the cache stays at KV heads. ``"query_head"``: the code's ``repeat_kv`` before
      selection; the cache holds ``H_q`` heads (resident bytes grow by the group size; a layer subclass repeats
      decode-time K/V on append).
    * ``pooling="avg"`` (the Llama-3 scripts); the official Mistral/Qwen2 scripts use ``"max"``. ws 8, kernel 7,
      r_max 10, m 4 are the code's values (missing from the paper, A2.6 item 7); the Qwen2 script passes no
      ``--radio_max``, so ``pred.py``'s default 5.0 applies there (``r_max=5``).
    * ``count_remainder=False`` (paper, Algorithm 1 line 6); ``True`` (official_code): the code's step at an update
      after the last layer that adds ``base H - sum_i floor(c_i / L)`` to the last layer's count before normalising.
    * Eq. 7 normalises by ``max(C)``, the code by ``sum C``: the Eq. 8 rescale undoes either up to rounding; the
      code form is used (A2.6 item 3), in exact integers unless ``allocation_arithmetic="official_code"``.
    * During prefill each layer holds the code's score-ordered temporary cache (window, then its bs entries by
      descending score), so a re-allocation keeps a prefix of it (``KVLayer.keep_first``: sized on the host, no
      selection, no device read); ``finish_prefill`` stores the kept tokens in position order (equivalent to the
      code's score order, A2.6 item 8). bug_compat's window copies select by the rank key (``keep_top``).

    Rows whose prompt fits the budget keep everything; left-padded batches allocate per row (padding never
    scores or counts). The KVLayers of the current forward are held between ``prefill`` calls (reset at layer 0).
    """

    name: ClassVar[str] = "dynamickv"
    capacities_from_content: ClassVar[bool] = True
    compression: ClassVar[str] = "prefill"
    window: int = 8
    kernel: int = 7
    pooling: str = "avg"
    r_max: float = 10.0
    update_interval: int = 4
    variant: str = "paper"
    granularity: str | None = None
    bug_compat: bool = False
    count_remainder: bool | None = None
    schedule: str | None = None
    score_dtype: str | None = None
    allocation_arithmetic: str | None = None

    def __post_init__(self) -> None:
        check_choice(self.name, "variant", self.variant, VARIANTS)
        for key, value in VARIANT_DEFAULTS[self.variant].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        check_positive(self.name, window=self.window, kernel=self.kernel, update_interval=self.update_interval)
        for key, choices in (("pooling", POOLING), ("granularity", GRANULARITY), ("schedule", SCHEDULES),
                             ("score_dtype", SCORE_DTYPES), ("allocation_arithmetic", ARITHMETIC)):
            check_choice(self.name, key, getattr(self, key), choices)
        if not self.r_max >= 1:
            raise ConfigError(f"method 'dynamickv': r_max={self.r_max!r} must be >= 1 (bs = r_max x average budget)")
        self.last_allocation: list[int] = []
        self.last_allocations: list[list[int]] = []
        self._reset()

    def _reset(self) -> None:
        self._layers: list[KVLayer] = []
        self._scores: list[torch.Tensor] = []
        self._rows: list[tuple[int, int, int]] = []  # per row: (n, base, bs); base < 0 = the prompt fits
        self._held: list[list[int]] = []  # per held layer, the entries each row holds (window included; host ints)

    def min_budget_tokens(self) -> int:
        return self.window + 1

    def min_budget_reason(self) -> str:
        return f"the observation window of {self.window} tokens is part of the budget"

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self._reset()
            for n, cap in zip(*ctx.host_ints()):
                base = cap - self.window if n > cap else -1
                self._rows.append((n, base, min(int(self.r_max * base), n - self.window)))
        if ctx.n <= self.window or all(base < 0 for _, base, _ in self._rows):
            return
        ws, n = self.window, ctx.n
        if self.score_dtype == "model":
            votes = model_dtype_votes(ctx.queries, layer.keys, ws, ctx.scaling, ctx.key_valid)  # (B, Hq, n - ws)
        else:
            probs = window_attention(ctx.queries, layer.keys, ws, ctx.scaling, ctx.key_valid)  # (B, Hq, ws, n)
            votes = probs[..., : n - ws].sum(-2)
        if self.granularity == "kv_head":
            votes = aggregate_group(votes, ctx.num_kv_heads, "mean")
        elif ctx.num_heads > layer.keys.shape[1]:
            expand_to_query_heads(layer, ctx.num_heads // layer.keys.shape[1])
        scores = pool1d(votes, self.kernel, self.pooling)  # (B, H, n - ws)
        if ctx.key_valid is not None:
            scores = scores.masked_fill(~ctx.key_valid[:, None, : n - ws], float("-inf"))
        self._layers.append(layer)
        self._scores.append(scores)
        key = torch.cat([rank_key(scores, self._rows), scores.new_full((*scores.shape[:2], ws), float("inf"))], dim=-1)
        if self.bug_compat:  # the stored order is the rank: only bug_compat's window copies select by the key again
            layer.state[KEY] = key
        keep = [n_row if base < 0 else bs + ws for n_row, base, bs in self._rows]
        # the code's score-ordered temporary cache: the window, then the bs entries by descending score (rank key),
        # then what goes (-inf: not among them, padding); a re-allocation keeps a prefix (keep_first), and
        # finish_prefill stores the kept entries in position order again
        layer.gather(torch.sort(key, dim=-1, descending=True, stable=True).indices[..., : max(keep)],
                     position_order=False)
        layer.keep_first(max(keep), keep)  # a row keeping fewer: its slots past its own count empty
        self._held.append(keep)
        last = ctx.layer_idx == ctx.num_layers - 1
        if ctx.layer_idx % self.update_interval == self.update_interval - 1 and (
                not last or self.schedule == "official_code"):  # paper: the last layer's update is finish_prefill's
            self._update(ctx.num_layers, final=last)

    def sample_stats(self, row: int) -> dict:
        """``layer_allocation``: entries per layer of ``row`` after the final re-allocation (window included; KV
        head 0), the data of the paper's Figure 2."""
        if row >= len(self.last_allocations):
            return {}
        return {"layer_allocation": [int(x) for x in self.last_allocations[row]]}

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        if self._scores:
            if len(self._layers) != len(layers) or any(a is not b for a, b in zip(self._layers, layers)):
                raise RuntimeError("dynamickv: prefill was not called for every layer of this forward, in order")
            if self.schedule == "paper":
                self._update(ctx.num_layers, final=True)
            for layer in layers:
                layer.state.pop(KEY, None)
                layer.sort_by_position()
        if self._scores and not self.bug_compat:  # every layer's entries per row, as the host set them
            counts = [list(row) for row in zip(*self._held)]
        else:  # in one read (a read per layer waits for the device once per layer)
            counts = torch.stack([layer.valid_counts()[:, 0] for layer in layers], 1).tolist() if layers else []
        self.last_allocations = [list(row) for row in counts]
        self.last_allocation = self.last_allocations[0] if self.last_allocations else []
        self._reset()

    def _update(self, num_layers: int, final: bool) -> None:
        """Re-allocate layers 0..l-1 (A2.3 step 4) and truncate them: each layer keeps a prefix of its score-ordered
        cache (the window and its highest-scored entries), sized on the host (no selection, no read); bug_compat's
        window copies select with ``keep_top`` and read what each layer holds."""
        ws, done = self.window, len(self._layers)
        targets = [[n] * done for n, _, _ in self._rows]  # entries per row and layer, window included
        extra = [[0] * done for _ in self._rows]  # bug_compat: window copies to add
        held_all = None  # bug_compat: every layer's entries per row, read once (when a row needs them)
        for row, (n, base, bs) in enumerate(self._rows):
            if base < 0:
                continue
            counts = layer_counts(self._scores, row, base)
            if final and self.count_remainder:
                counts[-1] += base * self._scores[0].shape[1] - sum(counts)
            z = (allocate if self.allocation_arithmetic == "exact" else allocate_official)(counts, bs, base, num_layers)
            if self.bug_compat:
                if held_all is None:
                    held_all = torch.stack([layer.valid_counts()[:, 0] for layer in self._layers], 1).tolist()
                held = [int(c) - ws for c in held_all[row]]
                z = [min(x, n - ws) for x in z]
                extra[row] = [min(max(x - h, 0), ws) for x, h in zip(z, held)]
                z = [min(x, h) for x, h in zip(z, held)]
            else:
                z = water_fill(z, [h[row] - ws for h in self._held], base * num_layers)
            targets[row] = [x + ws for x in z]
        for i, layer in enumerate(self._layers):
            keep = [t[i] for t in targets]
            if self.bug_compat:
                keep_top(layer, layer.state[KEY], keep)
                if max(e[i] for e in extra) > 0:
                    self._copy_window(layer, [e[i] for e in extra])
            elif keep != self._held[i]:  # never more than held (water_fill): a prefix of the score order
                layer.keep_first(max(keep), keep)
                self._held[i] = keep

    def _copy_window(self, layer: KVLayer, copies: list[int]) -> None:
        """bug_compat: cache the first ``copies[row]`` window tokens a second time (official code's slice)."""
        key = layer.state[KEY]
        win, order, _, _ = window_order(layer)
        first, (b, h, t) = order[..., : max(copies)], key.shape
        index = torch.cat([torch.arange(t, device=key.device).expand(b, h, t), first], dim=-1)
        wanted = torch.arange(first.shape[-1], device=key.device) < torch.tensor(copies, device=key.device)[:, None]
        valid = layer.valid if layer.valid is not None else torch.ones_like(win)
        layer.gather(index, torch.cat([valid, wanted[:, None, :].expand(b, h, -1)], dim=-1))
        mark_new_copies(layer)
