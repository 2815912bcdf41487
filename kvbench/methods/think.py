"""ThinK: prune the key channels the last queries use least, on top of any token-eviction method.

Xu et al., "ThinK: Thinner Key Cache by Query-Driven Pruning" (ICLR 2025, arXiv:2407.21018), code
SalesforceAIResearch/ThinK; kvpress ``ThinKPress`` (reviewed by the paper's first author) for the exact criterion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_choice, check_positive

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer
    from kvbench.engine.logits import TokenLogits

#: ``pruned``: keys stored with the kept channels only (real memory; kvbench's default); ``kvpress_zero``: kvpress's
#: reading, the pruned channels set to 0 in place (same bytes; later keys keep every channel)
STORAGE = ("pruned", "kvpress_zero")


def channel_scores(window_queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None,
                   query_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-channel importance ``(B, H, D)``: mean over the window of q_c^2 (averaged over the query heads of each KV
    group) times the mean over the held entries of k_c^2, kvpress ``ThinKPress``'s formula, whose ranking is the
    paper's ||Q[:, c]|| * ||K[:, c]|| (eq. 5: the Frobenius norm of the channel's rank-one q.k contribution).

    window_queries ``(B, Hq, w, D)`` post-RoPE; keys ``(B, H, n, D)`` post-RoPE; ``valid`` ``(B, H, n)`` marks held
    entries (padding and empty slots excluded); ``query_valid`` ``(B, w)`` marks real window queries (left padding).
    """
    b, hq, w, d = window_queries.shape
    h = keys.shape[1]
    if query_valid is None:
        q_norm = torch.pow(window_queries, 2).mean(dim=2)  # (B, Hq, D)
    else:
        qv = query_valid.view(b, 1, w, 1).to(window_queries.dtype)
        q_norm = (torch.pow(window_queries, 2) * qv).sum(2) / qv.sum(2).clamp(min=1)
    q_norm = q_norm.view(b, h, hq // h, d).mean(2)  # (B, H, D)
    if valid is None:
        k_norm = torch.pow(keys, 2).mean(dim=2)
    else:
        kv = valid.unsqueeze(-1).to(keys.dtype)
        k_norm = (torch.pow(keys, 2) * kv).sum(2) / kv.sum(2).clamp(min=1)
    return q_norm * k_norm


def kept_channels(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Channels kept per (row, head), ascending ``(B, H, D - int(D * ratio))``: the complement of the ``int(D *
    ratio)`` lowest scores chosen by ``torch.topk(largest=False)`` as kvpress chooses them (so ties break alike)."""
    d = scores.shape[-1]
    n_pruned = int(d * ratio)
    pruned = torch.zeros_like(scores, dtype=torch.bool)
    if n_pruned:
        pruned.scatter_(-1, scores.topk(n_pruned, dim=-1, largest=False).indices, True)
    return torch.sort(pruned.to(torch.uint8), dim=-1, stable=True).indices[..., : d - n_pruned]


@dataclass
class ThinK(Method):
    """Token eviction by ``inner`` (SnapKV by default), then per layer and KV head the ``int(head_dim *
    key_channel_compression_ratio)`` key channels with the lowest score (``channel_scores``: the last ``window``
    queries against the keys the inner method kept) leave the cache.

    ``storage="pruned"`` (default): keys are stored ``(B, H, n, D_kept)`` with the kept channel indices per head
    (``KVLayer.prune_key_channels``); attention gathers each query head to its KV head's kept channels (q.k over them
    only, the model's scale unchanged); values stay whole. Resident key bytes fall by the ratio. Generated tokens'
    keys are stored with the same channels (one consistent cache; kvpress keeps them whole, since it only zeroes
    prefill keys). ``storage="kvpress_zero"``: kvpress's reading, pruned channels set to 0 (no memory saved).
    GQA: query scores are averaged over each KV group before the product (kvpress). Left padding: padded window
    queries and empty slots are left out of the means, so a row is pruned as alone.

    ``inner``: the token method as a config node ``{name: snapkv, <fields>}``; it sees the cache first, at every hook,
    and its decisions, budget and verification are its own. Methods that attend or select themselves (Quest, POD,
    InfLLM, OmniKV) compute q.k with full keys and are refused; ``fullkv`` as inner is not offered (the engine does
    not act at a full budget).
    """

    name: ClassVar[str] = "think"
    acts_as: ClassVar[str] = "where its inner token method acts; then once after prefill: prunes key channels"
    key_channel_compression_ratio: float = 0.5
    window: int = 32
    storage: str = "pruned"
    inner: dict[str, Any] = field(default_factory=lambda: {"name": "snapkv"})

    def __post_init__(self) -> None:
        from kvbench.methods.catalog import METHODS

        check_positive(self.name, window=self.window)
        check_choice(self.name, "storage", self.storage, STORAGE)
        if not 0 <= self.key_channel_compression_ratio < 1:
            raise ConfigError(f"method 'think': key_channel_compression_ratio={self.key_channel_compression_ratio!r} "
                              "must be in [0, 1)")
        spec = {"name": self.inner} if isinstance(self.inner, str) else dict(self.inner or {})
        name = spec.pop("name", None)
        if name in (None, "think", "fullkv"):
            raise ConfigError(f"method 'think': inner={name!r}: ThinK composes with a token-eviction method "
                              "(inner.name=snapkv, pyramidkv, h2o, ...)")
        self.inner = {"name": name, **spec}
        self._inner: Method = METHODS.build(name, spec)
        if self._inner.decode_compression_spec() is not None:  # ThinK's pruned key channels: not composed with it
            raise ConfigError(f"method 'think': inner.decode_compression is not composed with ThinK's key-channel "
                              f"pruning; use inner.decode_compression.interval=null or method={name}")
        cls = type(self._inner)
        if cls.attend is not Method.attend or cls.select is not Method.select:
            raise ConfigError(f"method 'think': inner={name!r} computes its own decode attention over full keys; "
                              "ThinK composes with methods that evict tokens")
        # what the composition does not forward, refused here (before any model loads) rather than failing mid-prefill
        # or leaving the inner method's work undone
        if self._inner.ragged_cache():
            raise ConfigError(f"method 'think': inner={name!r} with layout=ragged holds each head's entries flat, "
                              f"whose key channels cannot be pruned; use method.inner.layout=padded")
        if cls.needs_reconstruction:
            raise ConfigError(f"method 'think': inner={name!r} scores the prompt with forwards after prefill, which "
                              "ThinK does not compose with; ThinK composes with methods that evict tokens")
        if cls.acts_after_decode_forward():
            raise ConfigError(f"method 'think': inner={name!r} compresses across layers after each decode forward, "
                              "which ThinK does not compose with; ThinK composes with methods that evict tokens")
        self._window_queries: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    # ---- what the inner method decides -------------------------------------------------------------------------
    @property
    def needs_decode_probs(self) -> bool:
        return self._inner.needs_decode_probs

    @property
    def supports_batching(self) -> bool:
        return self._inner.supports_batching

    @property
    def needs_logits(self) -> bool:
        return self._inner.needs_logits

    @property
    def compression(self) -> str:
        return self._inner.compression

    def validate(self, budget: Budget) -> None:
        if budget.is_full and self.key_channel_compression_ratio > 0:
            raise ConfigError(
                f"budget=full switches method 'think' off, its key-channel pruning included (key_channel_compression_"
                f"ratio={self.key_channel_compression_ratio:g}): the engine runs no method at a full budget, so this "
                "would file FullKV's numbers as ThinK's; give its inner method a budget (e.g. budget=128)"
            )
        self._inner.validate(budget)

    def min_budget_tokens(self) -> int:
        return self._inner.min_budget_tokens()

    def min_budget_reason(self) -> str:
        return self._inner.min_budget_reason()

    def check_layers(self, num_layers: int) -> None:
        self._inner.check_layers(num_layers)

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        return self._inner.expected_compression(budget, prompt_len, num_layers)

    def prompt_entries(self, budget: Budget, prompt_len: int, num_layers: int) -> list[int]:
        return self._inner.prompt_entries(budget, prompt_len, num_layers)

    def expected_key_channels(self, head_dim: int) -> int | None:
        return head_dim - int(head_dim * self.key_channel_compression_ratio)

    @property
    def own_attention(self) -> bool:
        return self._inner.own_attention

    @property
    def capacities_from_content(self) -> bool:
        return self._inner.capacities_from_content

    def static_after_first_step(self) -> bool:
        return self._inner.static_after_first_step()

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The inner method's step: the captured step's layers hold the kept key channels (``StaticKVLayer``'s
        ``key_channels``), store every step's key with them and gather each query to them, as the default path does."""
        return self._inner.static_policy(capacity, layer_idx)

    def static_refusal(self) -> str:
        return f"its inner method {self.inner['name']!r} has no static step: {self._inner.static_refusal()}"

    def budget_label(self, budget: Budget) -> str | None:
        return self._inner.budget_label(budget)

    def describe(self) -> dict:
        return {"name": self.name, "composed": f"think+{self.inner['name']}",
                "key_channel_compression_ratio": self.key_channel_compression_ratio, "window": self.window,
                "storage": self.storage, "inner": self._inner.describe()}

    def sample_stats(self, row: int) -> dict:
        return self._inner.sample_stats(row)

    # ---- the hooks: the inner method first, channels at the end of prefill ----------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        return self._inner.prefill_attend(layer, ctx)

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        self._inner.prefill(layer, ctx)
        w = min(self.window, ctx.n)
        query_valid = ctx.key_valid[:, -w:] if ctx.key_valid is not None else None
        self._window_queries[ctx.layer_idx] = (ctx.queries[..., -w:, :], query_valid)

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        self._inner.finish_prefill(layers, ctx)
        for i, layer in enumerate(layers):  # after the inner method's cross-layer decisions (DynamicKV, D2O)
            queries, query_valid = self._window_queries.pop(i)
            if self.key_channel_compression_ratio == 0:
                continue
            scores = channel_scores(queries, layer.keys, layer.valid, query_valid)
            kept = kept_channels(scores, self.key_channel_compression_ratio)
            if self.storage == "pruned":
                layer.prune_key_channels(kept)
            else:  # kvpress: zero the pruned channels in place
                zero = torch.ones_like(scores, dtype=torch.bool).scatter_(-1, kept, False)
                layer.keys = layer.keys.masked_fill(zero.unsqueeze(2), 0)
        self._window_queries.clear()

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        self._inner.decode(layer, ctx)

    def observe_logits(self, layers: list[KVLayer], input_ids: torch.Tensor, logits: TokenLogits) -> None:
        self._inner.observe_logits(layers, input_ids, logits)
