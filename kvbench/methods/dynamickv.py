"""DynamicKV: SnapKV-style selection with per-layer budgets re-allocated progressively during prefill.

Zhou et al., "DynamicKV: Task-Aware Adaptive KV Cache Compression for Long Context LLMs" (EMNLP 2025 Findings,
arXiv:2412.14838; paper 001), code DreamMr/DynamicKV (``dynamic_v11.py``). reference/methods.md A2, anchors.md C.2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import aggregate_group, pool1d, window_attention
from kvbench.errors import ConfigError
from kvbench.methods.base import Method, PrefillContext, check_choice, check_positive, keep_top

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

POOLING = ("avg", "max")
GRANULARITY = ("kv_head", "query_head")
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


@functools.cache
def expand_to_query_heads(layer: KVLayer, group: int) -> None:
    """``repeat_kv`` into the cache (official code): ``(B, Hkv, n, D)`` -> ``(B, Hq, n, D)``, head h on h // group."""
    for name in ("keys", "values", "positions", "valid"):
        if getattr(layer, name) is not None:
            setattr(layer, name, getattr(layer, name).repeat_interleave(group, dim=1))


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

    Paper vs official code (default = paper with methods.md's resolutions; the code's behaviour as options):

    * ``bug_compat=False`` (default): ``Z_i`` is clamped to what layer i still holds and the excess goes to the
      unclamped layers (``water_fill``). ``True``: the code's ``k_cache[:, :, :Z_i]`` reaches into the window when
      ``Z_i`` exceeds it, so window tokens are cached twice (only the ``Z_i <= n - ws`` clamp), A2.6 item 5.
    * ``granularity="kv_head"`` (default; DESIGN principle 3, GQA-native): window scores are averaged over each
      GQA group before pooling, the cache stays at KV heads. ``"query_head"``: the code's ``repeat_kv`` before
      selection; the cache holds ``H_q`` heads (resident bytes grow by the group size; a layer subclass repeats
      decode-time K/V on append).
    * ``pooling="avg"`` (the Llama-3 scripts); the official Mistral/Qwen2 scripts use ``"max"``. ws 8, kernel 7,
      r_max 10, m 4 are the code's values (missing from the paper, A2.6 item 7).
    * ``count_remainder=False`` (paper, Algorithm 1 line 6); ``True``: the code's final-layer step that adds
      ``base H - sum_i floor(c_i / L)`` to the last layer's count before normalising.
    * Eq. 7 normalises by ``max(C)``, the code by ``sum C``: the Eq. 8 rescale undoes either up to rounding; the
      code form is used (A2.6 item 3), in exact integers where the code uses float32.
    * Kept tokens are stored in position order, not score order (equivalent, A2.6 item 8); scores in float32
      (the code rounds the softmax to the model dtype before summing); when L is not a multiple of m the final
      update still runs (A2.3 step 6; the code would skip it).

    Rows whose prompt fits the budget keep everything; left-padded batches allocate per row (padding never
    scores or counts). The KVLayers of the current forward are held between ``prefill`` calls (reset at layer 0).
    """

    name: ClassVar[str] = "dynamickv"
    window: int = 8
    kernel: int = 7
    pooling: str = "avg"
    r_max: float = 10.0
    update_interval: int = 4
    granularity: str = "kv_head"
    bug_compat: bool = False
    count_remainder: bool = False

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window, kernel=self.kernel, update_interval=self.update_interval)
        check_choice(self.name, "pooling", self.pooling, POOLING)
        check_choice(self.name, "granularity", self.granularity, GRANULARITY)
        if not self.r_max >= 1:
            raise ConfigError(f"method 'dynamickv': r_max={self.r_max!r} must be >= 1 (bs = r_max x average budget)")
        self.last_allocation: list[int] = []
        self.last_allocations: list[list[int]] = []
        self._reset()

    def _reset(self) -> None:
        self._layers: list[KVLayer] = []
        self._scores: list[torch.Tensor] = []
        self._rows: list[tuple[int, int, int]] = []  # per row: (n, base, bs); base < 0 = the prompt fits

    def min_budget_tokens(self) -> int:
        return self.window + 1

    def min_budget_reason(self) -> str:
        return f"the observation window of {self.window} tokens is part of the budget"

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self._reset()
            for n, cap in zip(ctx.prompt_lens.tolist(), ctx.capacity.tolist()):
                base = cap - self.window if n > cap else -1
                self._rows.append((n, base, min(int(self.r_max * base), n - self.window)))
        if ctx.n <= self.window or all(base < 0 for _, base, _ in self._rows):
            return
        ws, n = self.window, ctx.n
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
        layer.state[KEY] = torch.cat([scores, scores.new_full((*scores.shape[:2], ws), float("inf"))], dim=-1)
        keep = [n_row if base < 0 else bs + ws for n_row, base, bs in self._rows]
        keep_top(layer, layer.state[KEY], keep)
        if ctx.layer_idx % self.update_interval == self.update_interval - 1 and ctx.layer_idx < ctx.num_layers - 1:
            self._update(ctx.num_layers, final=False)

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
            self._update(ctx.num_layers, final=True)
            for layer in layers:
                layer.state.pop(KEY, None)
        self.last_allocations = [list(row) for row in zip(*(layer.valid_counts()[:, 0].tolist() for layer in layers))]
        self.last_allocation = self.last_allocations[0] if self.last_allocations else []
        self._reset()

    def _update(self, num_layers: int, final: bool) -> None:
        """Re-allocate layers 0..l-1 (A2.3 step 4) and truncate them."""
        ws, done = self.window, len(self._layers)
        targets = [[n] * done for n, _, _ in self._rows]  # entries per row and layer, window included
        extra = [[0] * done for _ in self._rows]  # bug_compat: window copies to add
        for row, (n, base, bs) in enumerate(self._rows):
            if base < 0:
                continue
            counts = layer_counts(self._scores, row, base)
            if final and self.count_remainder:
                counts[-1] += base * self._scores[0].shape[1] - sum(counts)
            z = allocate(counts, bs, base, num_layers)
            held = [int(layer.valid_counts()[row, 0]) - ws for layer in self._layers]
            if self.bug_compat:
                z = [min(x, n - ws) for x in z]
                extra[row] = [min(max(x - h, 0), ws) for x, h in zip(z, held)]
                z = [min(x, h) for x, h in zip(z, held)]
            else:
                z = water_fill(z, held, base * num_layers)
            targets[row] = [x + ws for x in z]
        for i, layer in enumerate(self._layers):
            keep_top(layer, layer.state[KEY], [t[i] for t in targets])
            if max(e[i] for e in extra) > 0:
                self._copy_window(layer, [e[i] for e in extra])

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
