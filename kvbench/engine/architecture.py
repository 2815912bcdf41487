"""How each attention layer of a model attends, read from the model itself: the engine must attend as transformers does.

A layer is *full* (every earlier token) or *sliding* (tokens at distance < ``window``: Mistral v0.1's 4096 on every
layer, Gemma 2/3's, GPT-OSS's and Qwen2's local layers); it may cap its logits (Gemma 2's ``attn_logit_softcapping``)
or add a learned sink logit per head (GPT-OSS's ``sinks``). The engine reads these once per session:

* a sliding layer's cache holds at most ``window - 1`` entries between forwards, as transformers'
  ``DynamicSlidingWindowLayer`` does, so FullKV's cache is the model's cache and a decode step attends exactly the
  entries the model would;
* the attention the engine computes itself (padded caches, methods that need the probabilities) applies the
  soft-cap and the sinks as the model's eager attention does.

Where a model states sliding layers: ``config.layer_types`` (``"sliding_attention"`` / ``"full_attention"``) with
``config.sliding_window``, or an attention module's own ``sliding_window`` attribute (None on its full layers); a
config with a ``sliding_window`` and no layer types slides on every layer (Mistral, Phi-3), unless
``use_sliding_window`` is False (Qwen2's switch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: how methods treat sliding layers (the top-level ``sliding_layers`` config value)
SLIDING_POLICIES = ("auto", "window", "compress")


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer: ``window`` (None: full attention), ``softcap`` (None: none), ``sinks`` (per query head
    ``(Hq,)`` learned sink logits, or None)."""

    window: int | None = None
    softcap: float | None = None
    sinks: Any = None

    def visible_keys(self, n: int) -> int:
        """Keys the last of ``n`` prompt queries attends (no padding): what its row of the model's mask must show."""
        return n if self.window is None else min(n, self.window)

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def describe(self) -> str:
        return "full" if self.window is None else f"sliding{self.window}"


#: model types whose ``config.sliding_window`` applies to every layer (their model builds a sliding mask whenever it is
#: set: ``create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask``); other
#: configs may carry the field unused (Llama ignores it). The session checks every reading against the mask the model
#: builds at the first prefill longer than a window, so a family missing here fails loudly, not silently.
CONFIG_WIDE_WINDOW = frozenset({"mistral", "mixtral", "ministral3", "phi3", "phimoe", "phi4_multimodal", "qwen3_moe",
                                "starcoder2", "doge", "blt"})


def _config_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and layer_idx < len(types):
        return int(window) if types[layer_idx] == "sliding_attention" else None
    return int(window) if getattr(config, "model_type", None) in CONFIG_WIDE_WINDOW else None


def config_layer_windows(config: dict[str, Any]) -> dict[int, LayerAttention] | None:
    """Every layer's window, read from a model's ``config.json`` dict alone (before any weight loads; a multimodal
    config's ``text_config``), or None where it does not say how many layers it has. Windows only: the session reads
    the modules themselves (soft-cap, sinks) and checks the windows against the mask the model builds."""
    from types import SimpleNamespace

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if "model_type" not in text:
        text = {**text, "model_type": config.get("model_type")}
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int):
        return None
    view = SimpleNamespace(**text)
    return {i: LayerAttention(window=_config_window(view, i)) for i in range(layers)}


def layer_attention(config: Any, module: Any) -> LayerAttention:
    """The attention of ``module`` (an attention module with a ``layer_idx``) of a model with ``config``."""
    if hasattr(module, "sliding_window"):  # the module's own statement wins (None on full layers)
        window = module.sliding_window
        window = int(window) if window else None
    else:
        window = _config_window(config, module.layer_idx)
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is None:
        softcap = getattr(config, "attn_logit_softcapping", None)
    sinks = getattr(module, "sinks", None)
    return LayerAttention(window=window, softcap=float(softcap) if softcap else None, sinks=sinks)


def attention_modules(model: Any) -> dict[int, Any]:
    """Every attention module of ``model`` by layer index (what the session hooks)."""
    return {module.layer_idx: module for module in model.modules()
            if hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention")}


def layer_specs(model: Any) -> dict[int, LayerAttention]:
    """How every attention layer of ``model`` attends, by layer index."""
    return {i: layer_attention(getattr(m, "config", model.config), m) for i, m in attention_modules(model).items()}


def describe(model: Any, policy: str) -> dict[str, Any]:
    """How ``model``'s layers attend and which ones a method compresses under ``policy``, as data for meta.json."""
    specs = layer_specs(model)
    resolved = resolve_policy(policy, specs)
    return {
        "sliding_layers": policy,
        "sliding_layers_resolved": resolved,
        "layer_attention": [specs[i].describe() for i in sorted(specs)],
        "compressed_layers": compressed_layers(specs, resolved),
    }


def compressed_layers(specs: dict[int, LayerAttention], resolved: str) -> list[int]:
    """The layers a method acts on under a resolved policy, in order."""
    return [i for i in sorted(specs) if resolved == "compress" or not specs[i].sliding]


def resolve_policy(policy: str, layers: dict[int, LayerAttention]) -> str:
    """``auto``: methods compress the full-attention layers and leave sliding layers to their window; on a model
    whose every layer slides (Mistral v0.1) there is nothing else to compress, so they compress inside the window."""
    if policy != "auto":
        return policy
    return "compress" if layers and all(spec.sliding for spec in layers.values()) else "window"
