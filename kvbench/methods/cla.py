"""CLA: Cross-Layer Attention, the inference mechanism (the upper layers of each group reuse the lowest one's KV).

Brandon et al., "Reducing Transformer Key-Value Cache Size with Cross-Layer Attention" (2024). reference/methods.md
B12. CLA is an architecture trained with the sharing (from scratch in the paper, uptrained in POD's comparison), so
kvbench runs it only on a checkpoint the user declares adapted, or deliberately as the untrained proxy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


def shared_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_valid: torch.Tensor | None,
                     scaling: float, chunk: int = 512) -> torch.Tensor:
    """Causal attention of ``query`` ``(B, Hq, q, D)`` (the newest q of the T entries) over another layer's
    ``keys``/``values`` ``(B, Hkv, T, D)``; ``key_valid`` ``(B, Hkv, T)`` or None. Returns ``(B, q, Hq, D)``."""
    b, hq, q, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    outs = []
    for start in range(0, q, chunk):
        stop = min(q, start + chunk)
        qg = query[:, :, start:stop].float().view(b, hkv, hq // hkv, stop - start, d)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys.float()) * scaling
        qpos = torch.arange(t - q + start, t - q + stop, device=query.device).view(-1, 1)
        allowed = (torch.arange(t, device=query.device).view(1, -1) <= qpos).view(1, 1, 1, stop - start, t)
        if key_valid is not None:
            allowed = allowed & key_valid.view(b, hkv, 1, 1, t)
        probs = torch.nan_to_num(torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1), nan=0.0)
        outs.append(torch.einsum("bhgqk,bhkd->bhgqd", probs.to(values.dtype), values).reshape(b, hq, -1, d))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


@dataclass
class CLA(Method):
    """Layers form consecutive groups of ``sharing_factor`` (CLA2: pairs); the lowest layer of a group computes and
    caches K/V, the others attend to *its* cache with their own queries and keep no KV of their own (their K/V
    projections, still computed by the model, are discarded). Resident KV drops to ``ceil(L / f) / L`` of FullKV.
    Prompt attention shares too (``prefill_attend``). The budget is unused.

    CLA needs a model trained with this sharing (``requires_training``). ``adapted_checkpoint=true`` declares that
    ``model=<config>`` points at such a checkpoint (e.g. uptrained the way ``scripts/pod_adapt.py`` uptrains POD);
    ``allow_untrained=true`` runs the training-free proxy on an ordinary model deliberately (expected to collapse,
    methods.md B12) and says so in the results' method description (``regime``). The captured decode step gives the
    upper layers no slot: they attend the lowest layer's (``StaticPolicy.source``).
    """

    name: ClassVar[str] = "cla"
    own_attention: ClassVar[bool] = True
    supports_continued_forward: ClassVar[bool] = False  # its own single-query decode attention/selection
    compression: ClassVar[str] = "prefill"
    requires_training: ClassVar[bool] = True
    sharing_factor: int = 2
    adapted_checkpoint: bool = False
    allow_untrained: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sharing_factor, bool) or not isinstance(self.sharing_factor, int) or self.sharing_factor < 2:
            raise ConfigError(f"method 'cla': sharing_factor={self.sharing_factor!r} must be an integer >= 2")
        for key in ("adapted_checkpoint", "allow_untrained"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"method 'cla': {key}={getattr(self, key)!r} must be true or false")
        self._sources: dict[int, KVLayer] = {}  # lowest layer of a group -> its cache layer

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured step: a group's lowest layer appends, the others attend its slots (``StaticPolicy.source``)
        with the engine's attention (plain causal attention over every entry it holds, as ``shared_attention``)."""
        from kvbench.engine.static import StaticPolicy

        source = self.source_layer(layer_idx)
        return StaticPolicy() if source == layer_idx else StaticPolicy(source=source)

    def validate(self, budget: Budget) -> None:
        if not (self.adapted_checkpoint or self.allow_untrained):
            raise NotAvailableError(
                "method 'cla' (Cross-Layer Attention, Brandon et al. 2024, arXiv:2405.12981) is an architecture "
                "trained with KV sharing and has no released checkpoints for these models; uptrain one "
                "(scripts/pod_adapt.py is the pattern: the same objective with the sharing attention) and run it with "
                "model=<its config> method.adapted_checkpoint=true, or run the untrained proxy deliberately with "
                "method.allow_untrained=true"
            )

    def budget_label(self, budget: Budget) -> str:
        return f"share{self.sharing_factor}"

    def describe(self) -> dict:
        regime = "adapted checkpoint (declared)" if self.adapted_checkpoint else "untrained proxy (no CLA training)"
        return {**{k: v for k, v in super().describe().items() if not k.startswith("_")}, "regime": regime}

    def source_layer(self, layer_idx: int) -> int:
        return layer_idx - layer_idx % self.sharing_factor

    @staticmethod
    def _drop(layer: KVLayer) -> None:
        """Keep no KV in a sharing layer: fresh empty tensors free what the model computed."""
        layer.keys = layer.keys.new_empty(*layer.keys.shape[:2], 0, layer.keys.shape[-1])
        layer.values = layer.values.new_empty(*layer.values.shape[:2], 0, layer.values.shape[-1])
        layer.positions = layer.positions[..., :0].clone()
        layer.valid = None

    # ---- engine hooks ----------------------------------------------------------------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        source = self.source_layer(ctx.layer_idx)
        if source == ctx.layer_idx:
            return None
        lower = self._sources[source]
        return shared_attention(ctx.queries, lower.keys, lower.values, lower.valid, ctx.scaling).to(lower.values.dtype)

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if self.source_layer(ctx.layer_idx) == ctx.layer_idx:
            self._sources[ctx.layer_idx] = layer
        else:
            self._drop(layer)

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        source = self.source_layer(ctx.layer_idx)
        if source == ctx.layer_idx or source not in self._sources:
            return None
        lower = self._sources[source]
        scaling = ctx.scaling or ctx.query.shape[-1] ** -0.5
        out = shared_attention(ctx.query, lower.keys, lower.values, lower.valid, scaling).to(lower.values.dtype)
        self._drop(layer)  # this step's own K/V were appended by the model's cache update; CLA has none
        valid = lower.valid  # the entries attended per (row, head), as the engine counts them: not a padded row's slots
        ctx.attended = lower.keys.shape[2] if valid is None else valid.sum() // valid[..., 0].numel()
        return out
