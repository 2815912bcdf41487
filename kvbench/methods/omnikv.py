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
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_choice, check_positive
from kvbench.methods.omnikv_select import select_by_last_query, select_by_window, static_choice, static_segment

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

SELECTORS = ("last", "softmax_before_last", "uniform", "exp")
WINDOW_READINGS = ("official_code", "paper")
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
    paper's Mem% (resident GPU fraction): with dense fraction ``f`` = the layers that attend densely / L,
    ``r = (Mem - f) / (1 - f)`` and ``k = floor(r n)`` (Llama-3-8B, Mem 30 % -> r = 0.0667). The dense layers are
    those below the first filter layer, the filter layers and their ``wait_layers`` layers, counted once: the paper's
    ``f = (2 |filters| + L0) / L`` for one wait layer and filters that do not overlap. ``mem_formula=False`` reads
    the ratio as ``k / n`` directly. Resident KV is the full cache (offloading is an efficiency option, not a
    quality one); attended entries per step are reported separately.

    Selectors: ``last`` (official code, default: raw logits ``q k * scaling`` of the last query, max over query
    heads), ``softmax_before_last`` (the paper's text: probabilities, then max over heads), ``uniform`` / ``exp``
    (the last ``window`` queries, weights 1 or ``2^(u - (w-1))``, each row's probabilities max over query heads).
    ``scaling`` is the attention module's own softmax scale (``1/sqrt(d)`` on Llama, as the official code writes it).
    The window's rows that are still prompt queries (``p`` of them, ``window - 1`` at the first decode step, none
    once ``window`` tokens were generated) are read two ways (``window_reading``):

    * ``official_code`` (default; antgroup/OmniKV 5c33cb5, ``OmniKVMulLayer.forward``): the window's prompt tokens
      are always selected and left out of the scoring: the softmax and the top-k run over the first ``n - p`` prompt
      tokens, with ``max(1, k - p)`` chosen (so ``max(1, k - p) + p`` tokens when ``k < p + 1``); every window
      query is rotated at the *current* decode position (the code re-projects the window's hidden states and
      applies RoPE with the step's ``position_ids``), which needs a re-rotatable RoPE (``ctx.rope_inv_freq``);
    * ``paper``: the formulas of methods.md A3.3 as printed (kvbench's reading before the official code was run):
      window queries at their own positions, softmax over all ``n`` prompt tokens; the ``p`` window positions are
      forced into the top-``k`` and count against it.

    ``tests/test_parity_omnikv.py`` pins ``official_code`` to the official code's selections for all four selectors.
    Filter layers default to Llama-3-8B's {2, 8, 18} scaled to the model's depth; set ``filter_layers`` per model as
    the paper does (Yi-9B {6, 11, 30}, Llama-3.1-70B {4, 19, 41}).
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
    supports_continued_forward: ClassVar[bool] = False  # its own single-query decode attention/selection
    compression: ClassVar[str] = "attention"
    supports_batching: ClassVar[bool] = False
    filter_layers: list[int] | None = None
    wait_layers: int = 1
    selector: str = "last"
    window: int = 16
    window_reading: str = "official_code"
    mem_formula: bool = True
    offload: str = "off"
    _budget: Budget | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window)
        check_choice(self.name, "selector", self.selector, SELECTORS)
        check_choice(self.name, "offload", self.offload, OFFLOAD)
        check_choice(self.name, "window_reading", self.window_reading, WINDOW_READINGS)
        if self.wait_layers < 0:
            raise ConfigError(f"method 'omnikv': wait_layers={self.wait_layers} must be >= 0")
        if self.filter_layers is not None and (not self.filter_layers or min(self.filter_layers) < 0):
            raise ConfigError(f"method 'omnikv': filter_layers={self.filter_layers!r} must be non-empty layer indices")
        self._filters: dict[int, list[int]] = {}
        self._selection: dict[int, torch.Tensor] = {}
        self._window_queries: dict[int, torch.Tensor] = {}  # filter layer -> last ``window`` queries (B, Hq, w, D)
        self._window_positions: dict[int, torch.Tensor] = {}  # filter layer -> their positions (B, w)
        self._prefill_len = 0
        self._num_layers = 0  # layers of the last prefill (static_policy's layer roles)
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

    def check_layers(self, num_layers: int) -> None:
        if not any(self._segment_filter(layer, num_layers) is not None for layer in range(num_layers)):
            raise ConfigError(
                f"method 'omnikv': filter layers {self.filters(num_layers)} (+ {self.wait_layers} wait layer(s) each) "
                f"leave no sparse layer among the {num_layers} layers it compresses: every layer would attend densely, "
                f"FullKV under OmniKV's name; set method.filter_layers (e.g. [0])"
            )

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """Sparse layers exist only past the first filter layer and outside each filter's ``wait_layers``."""
        kind = super().expected_compression(budget, prompt_len, num_layers)
        sparse = any(self._segment_filter(layer, num_layers) is not None for layer in range(num_layers))
        return kind if sparse and self.selected_tokens(prompt_len, num_layers) < prompt_len else "none"

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
        dense_layers = sum(self._segment_filter(layer, num_layers) is None for layer in range(num_layers))
        dense = dense_layers / num_layers
        ratio = (budget.value - dense) / (1 - dense) if dense < 1 else 0.0
        if ratio <= 0:
            raise ConfigError(
                f"method 'omnikv': Mem {budget.value:g} is below the dense fraction {dense:.3f} of the layers "
                f"({dense_layers} dense of {num_layers}: {filters[0]} leading, {len(filters)} filter layers and "
                f"their wait_layers={self.wait_layers})"
            )
        return max(1, math.floor(ratio * n))

    # ---- engine hooks --------------------------------------------------------------------------------------------
    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self._selection.clear()
            self._window_queries.clear()
            self._window_positions.clear()
            self._prefill_len = ctx.n
            self._num_layers = ctx.num_layers
        if ctx.layer_idx in self.filters(ctx.num_layers) and self.selector in ("uniform", "exp"):
            if self.window_reading == "official_code" and ctx.rope_inv_freq is None:
                raise NotAvailableError(
                    "method 'omnikv': window_reading=official_code rotates the window's queries at the current "
                    "decode position, which needs a RoPE that can be re-rotated (rope_type default, linear or llama3 "
                    "with attention_scaling 1); this model's cannot: use window_reading=paper"
                )
            self._window_queries[ctx.layer_idx] = ctx.queries[..., -self.window :, :]
            self._window_positions[ctx.layer_idx] = layer.positions[:, 0, -self.window :]
            # engine.compile's copy, always ``window`` rows (empty rows at position -1 before a short prompt)
            short = self.window - self._window_queries[ctx.layer_idx].shape[2]
            layer.row_state["omnikv_window_q"] = torch.nn.functional.pad(self._window_queries[ctx.layer_idx],
                                                                         (0, 0, short, 0))
            layer.row_state["omnikv_window_pos"] = torch.nn.functional.pad(self._window_positions[ctx.layer_idx],
                                                                           (short, 0), value=-1)

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

    @property
    def own_attention(self) -> bool:
        """The context bank's attention (``offload``) is computed here, without a soft-cap or sink logits."""
        return self.offload != "off"

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """``engine.compile`` (every selector, no offload): the filter layer's step writes its top-k prompt slots into a
        selection its segment's sparse layers attend through (with every generated token); nothing is evicted, so
        slots stay in position order. The window selectors slide a fixed window of ``window`` rows in ``row_state``
        (``omnikv_select.window_choice``: the window's prompt rows a tensor, the forced tokens first). The prompt's
        length and k are device values (``static_state``). Before the first prefill (the session's check) the layer
        roles are not known yet: a plain policy."""
        from kvbench.engine.static import StaticPolicy

        if self.offload != "off":
            return None
        n, num_layers = self._prefill_len, self._num_layers
        if not num_layers or self.selected_tokens(n, num_layers) >= n:
            return StaticPolicy()  # every layer attends densely (the default path's ``_choose`` gives None)
        if layer_idx in self.filters(num_layers):  # (the selection as wide as the layer's slots)
            return StaticPolicy(choose=static_choice, selection=layer_idx,
                                params=(self.selector, self.window_reading))
        source = self._segment_filter(layer_idx, num_layers)
        return StaticPolicy() if source is None else StaticPolicy(attend=static_segment, selection=source)

    def static_state(self, layer: KVLayer, layer_idx: int, slots: int):
        """The prompt's length and the tokens a sparse layer attends, ``(B, 2)`` (``omnikv_sizes``): device values of
        the captured step, which a ratio budget and each prompt's length set, so a job's samples replay one graph."""
        n, num_layers = self._prefill_len, self._num_layers
        sizes = torch.tensor([[n, self.selected_tokens(n, num_layers)]], device=layer.keys.device)
        return {}, {"omnikv_sizes": sizes.expand(layer.keys.shape[0], 2).contiguous()}

    def static_refusal(self) -> str:
        return f"offload={self.offload} gathers the selected tokens from a context bank on the host"

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
        """Top-k prompt entries ``(B, k')`` for this step, from this filter layer's query (or recent queries)."""
        n = self._prefill_len
        k = self.selected_tokens(n, ctx.num_layers)
        if k >= n:
            return None
        keys = layer.keys[:, :, :n]  # (B, Hkv, n, D)
        scaling = ctx.scaling or keys.shape[-1] ** -0.5
        if self.selector in ("last", "softmax_before_last"):
            return select_by_last_query(ctx.query, keys, scaling, k, softmax=self.selector == "softmax_before_last")
        recent, positions = self._slide_window(layer, ctx)
        return select_by_window(recent, positions, keys, scaling, k, self.selector, self.window_reading,
                                ctx.rope_inv_freq)

    def _slide_window(self, layer: KVLayer, ctx: DecodeContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's queries to the filter layer's window and keep the last ``window``: the queries
        ``(B, Hq, w, D)`` and their positions ``(B, w)``."""
        q = ctx.query.shape[2]
        recent = torch.cat([self._window_queries[ctx.layer_idx], ctx.query], dim=2)[..., -self.window :, :]
        positions = torch.cat([self._window_positions[ctx.layer_idx], layer.positions[:, 0, -q:]], dim=-1)
        positions = positions[:, -self.window :]
        self._window_queries[ctx.layer_idx], self._window_positions[ctx.layer_idx] = recent, positions
        return recent, positions
