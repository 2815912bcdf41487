"""OmniKV: filter layers choose, at every decode step, the prompt tokens the following layers attend to.

Hao et al., "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs" (ICLR 2025), code antgroup/OmniKV.
reference/methods.md A3.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_choice, check_positive

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

SELECTORS = ("last", "softmax_before_last", "uniform", "exp")
OFFLOAD = ("off", "on", "always")
log = logging.getLogger("kvbench")
#: Llama-3-8B-262K's filter layers (the paper's main setting), as fractions of depth for models without their own.
_LLAMA3_8B_FILTERS = (2, 8, 18)


@dataclass
class OmniKV(Method):
    """No eviction: every token stays resident; sparse layers *attend* to a per-step selection.

    Layers ``0 .. L0-1`` (L0 = the first filter layer), every filter layer and the ``wait_layers`` layers after each
    filter layer attend densely. A filter layer scores the prompt tokens with its current query and picks the top
    ``k``; the sparse layers up to the next filter layer attend to those ``k`` prompt tokens plus every generated
    token. One index set serves all heads and layers of a segment.

    Budget: ``budget=128`` is ``k`` = 128 selected prompt tokens per step (Table 3). A ratio ``budget=0.3`` is the
    paper's Mem% (resident GPU fraction): with dense fraction ``f = (2 |filters| + L0) / L``, ``r = (Mem - f) /
    (1 - f)`` and ``k = floor(r n)`` (Llama-3-8B, Mem 30 % -> r = 0.0667). ``mem_formula=False`` reads the ratio as
    ``k / n`` directly. Resident KV is the full cache (offloading is an efficiency option, not a quality one);
    attended entries per step are reported separately.

    Selectors: ``last`` (official code, default: raw logits ``q k / sqrt(d)`` of the last query, max over query
    heads), ``softmax_before_last`` (the paper's text: probabilities, then max over heads), ``uniform`` / ``exp``
    (the last ``window`` queries, weights 1 or ``2^(u - (w-1))``; window positions still in the prompt are always
    selected and count against ``k``). Filter layers default to Llama-3-8B's {2, 8, 18} scaled to the model's depth;
    set ``filter_layers`` per model as the paper does (Yi-9B {6, 11, 30}, Llama-3.1-70B {4, 19, 41}).
    Batch size 1, as the official code (its index set is flattened over the batch).

    ``offload="on"``: the paper's context bank (§3.3, A3.5). After prefill the prompt KV of every sparse layer moves
    to pinned CPU memory; at each decode step the selected ``k`` tokens are gathered on the CPU into one contiguous
    pinned buffer per layer and copied to the GPU in one transfer ("packed load"), then attended with the layer's
    generated tokens (which stay on the GPU). Filter and dense layers keep their KV on the GPU. Outputs are those of
    ``offload="off"``; resident (GPU) KV drops by the sparse layers' prompt KV. When the model is on the CPU there
    is nothing to offload: ``on`` logs that it is a no-op and behaves as ``off``; ``always`` builds the bank anyway
    (exercises the packed-load path on any device; saves nothing on a CPU).
    """

    name: ClassVar[str] = "omnikv"
    supports_batching: ClassVar[bool] = False
    filter_layers: list[int] | None = None
    wait_layers: int = 1
    selector: str = "last"
    window: int = 16
    mem_formula: bool = True
    offload: str = "off"
    _budget: Budget | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window)
        check_choice(self.name, "selector", self.selector, SELECTORS)
        check_choice(self.name, "offload", self.offload, OFFLOAD)
        if self.wait_layers < 0:
            raise ConfigError(f"method 'omnikv': wait_layers={self.wait_layers} must be >= 0")
        if self.filter_layers is not None and (not self.filter_layers or min(self.filter_layers) < 0):
            raise ConfigError(f"method 'omnikv': filter_layers={self.filter_layers!r} must be non-empty layer indices")
        self._filters: dict[int, list[int]] = {}
        self._selection: dict[int, torch.Tensor] = {}
        self._window_queries: dict[int, torch.Tensor] = {}
        self._prefill_len = 0
        self._bank: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sparse layer -> prompt K, V on the CPU
        self._said_noop = False

    def validate(self, budget: Budget) -> None:
        super().validate(budget)
        self._budget = budget

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    # ---- layer roles -------------------------------------------------------------------------------------------
    def filters(self, num_layers: int) -> list[int]:
        """Filter layers for a model of ``num_layers`` layers (asked per layer and step: computed once)."""
        if num_layers not in self._filters:
            self._filters[num_layers] = self._resolve_filters(num_layers)
        return self._filters[num_layers]

    def _resolve_filters(self, num_layers: int) -> list[int]:
        if self.filter_layers is not None:
            if max(self.filter_layers) >= num_layers:
                raise ConfigError(f"method 'omnikv': filter_layers={self.filter_layers} exceed {num_layers} layers")
            return sorted(self.filter_layers)
        return sorted({min(num_layers - 1, round(x * num_layers / 32)) for x in _LLAMA3_8B_FILTERS})

    def _segment_filter(self, layer_idx: int, num_layers: int) -> int | None:
        """The filter layer whose selection ``layer_idx`` uses, or None when the layer attends densely."""
        filters = self.filters(num_layers)
        if layer_idx < filters[0] or layer_idx in filters:
            return None
        source = max(f for f in filters if f < layer_idx)
        return None if layer_idx - source <= self.wait_layers else source

    def selected_tokens(self, n: int, num_layers: int) -> int:
        """k: prompt tokens a sparse layer attends to per step."""
        budget = self._budget
        if budget is None or budget.kind == "full":
            return n
        if budget.kind == "tokens":
            return min(n, int(budget.value))
        if not self.mem_formula:
            return max(1, math.floor(budget.value * n))
        filters = self.filters(num_layers)
        dense = (2 * len(filters) + filters[0]) / num_layers
        ratio = (budget.value - dense) / (1 - dense)
        if ratio <= 0:
            raise ConfigError(
                f"method 'omnikv': Mem {budget.value:g} is below the dense fraction {dense:.3f} of the layers "
                f"({len(filters)} filter layers + {filters[0]} leading dense layers of {num_layers})"
            )
        return max(1, math.floor(ratio * n))

    # ---- engine hooks --------------------------------------------------------------------------------------------
    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self._selection.clear()
            self._window_queries.clear()
            self._prefill_len = ctx.n
        if ctx.layer_idx in self.filters(ctx.num_layers) and self.selector in ("uniform", "exp"):
            self._window_queries[ctx.layer_idx] = ctx.queries[..., -self.window :, :]

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        self._bank.clear()
        if self.offload == "off":
            return
        device = layers[0].keys.device
        if device.type == "cpu" and self.offload == "on":
            if not self._said_noop:
                log.warning("omnikv offload=on: the model is on the CPU, so the context bank is a no-op (the KV "
                            "already lives in CPU memory); offload=always builds it anyway")
                self._said_noop = True
            return
        pin = device.type == "cuda"
        for idx, layer in enumerate(layers):
            if self._segment_filter(idx, len(layers)) is None:  # filter or dense layer: stays on the device
                continue
            n = self._prefill_len
            bank_k, bank_v = layer.keys[:, :, :n].to("cpu"), layer.values[:, :, :n].to("cpu")
            self._bank[idx] = (bank_k.pin_memory(), bank_v.pin_memory()) if pin else (bank_k, bank_v)
            layer.keys, layer.values = layer.keys[:, :, n:].clone(), layer.values[:, :, n:].clone()

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        if ctx.layer_idx not in self._bank:
            return None
        bank_k, bank_v = self._bank[ctx.layer_idx]
        chosen = self._selection.get(self._segment_filter(ctx.layer_idx, ctx.num_layers))
        if chosen is not None:  # packed load: gather on the CPU into one buffer, one host-to-device copy each
            index = chosen[0].to("cpu")
            bank_k, bank_v = bank_k.index_select(2, index), bank_v.index_select(2, index)
            if layer.keys.is_cuda:
                bank_k, bank_v = bank_k.pin_memory(), bank_v.pin_memory()
        device = layer.keys.device
        keys = torch.cat([bank_k.to(device, non_blocking=True), layer.keys], dim=2)
        values = torch.cat([bank_v.to(device, non_blocking=True), layer.values], dim=2)
        from kvbench.engine.attention import grouped_attention

        if ctx.query.shape[2] != 1:
            raise ConfigError("method 'omnikv': offload supports one new token per decode step")
        out, _ = grouped_attention(ctx.query, keys, values, None, ctx.scaling or ctx.query.shape[-1] ** -0.5)
        ctx.attended = keys.shape[2]
        return out

    def select(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        if ctx.layer_idx in self.filters(ctx.num_layers):
            self._selection[ctx.layer_idx] = self._choose(layer, ctx)
            return None
        source = self._segment_filter(ctx.layer_idx, ctx.num_layers)
        if source is None or self._selection.get(source) is None:
            return None
        chosen = self._selection[source]  # (B, k) prompt entry indices
        generated = torch.arange(self._prefill_len, layer.num_entries, device=chosen.device)
        index = torch.cat([chosen, generated.expand(chosen.shape[0], -1)], dim=-1)
        return index.unsqueeze(1).expand(-1, layer.keys.shape[1], -1)

    def _choose(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        """Top-k prompt entries for this step, from this filter layer's query (or recent queries)."""
        n = self._prefill_len
        k = self.selected_tokens(n, ctx.num_layers)
        if k >= n:
            return None
        keys = layer.keys[:, :, :n]  # (B, Hkv, n, D)
        b, hkv, _, d = keys.shape
        if self.selector in ("uniform", "exp"):
            recent = torch.cat([self._window_queries[ctx.layer_idx], ctx.query], dim=2)[..., -self.window :, :]
            self._window_queries[ctx.layer_idx] = recent
        else:
            recent = ctx.query[..., -1:, :]
        w = recent.shape[2]
        q = recent.reshape(b, hkv, -1, w, d)  # (B, Hkv, g, w, D)
        logits = torch.einsum("bhgwd,bhnd->bhgwn", q, keys).float() / math.sqrt(d)
        if self.selector == "last":
            return torch.topk(logits[..., -1, :].amax(dim=(1, 2)), k, dim=-1).indices.sort(-1).values
        probs = torch.softmax(logits, dim=-1).amax(dim=(1, 2))  # (B, w, n): max over query heads
        if self.selector == "softmax_before_last":
            return torch.topk(probs[:, -1], k, dim=-1).indices.sort(-1).values
        weights = torch.ones(w, device=probs.device)
        if self.selector == "exp":
            weights = 2.0 ** (torch.arange(w, device=probs.device) - (w - 1)).float()
        scores = (probs * weights.view(1, -1, 1)).sum(1)  # (B, n)
        # the window's own positions that are still prompt tokens are always kept and count against k
        window_start = layer.num_entries - w
        if window_start < n:
            scores[:, max(0, window_start) :] = float("inf")
        return torch.topk(scores, k, dim=-1).indices.sort(-1).values
