"""POD: proximal tokens with each layer's own keys, distant tokens with the block's lowest layer's attention logits.

Ma et al., "Compressing KV Cache for Long-Context LLM Inference with Inter-Layer Attention Similarity" (POD,
paper 004; no public code or weights). reference/methods.md A5. This is the training-free inference mechanism
("POD-TF", A5.7 (a)); the paper's numbers need its two 5B-token post-training stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_choice
from kvbench.methods.pod_attention import gate_combine, pod_sequence_attention, proximal_distant_masks
from kvbench.methods.pod_map import load_block_map, lowest_per_layer, trimmed_layers

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

GATES = ("paper", "calibrated")
PREFILLS = ("shared", "full")


@dataclass
class POD(Method):
    """Decode attention of eqs. 3-4: within a block of consecutive layers (per KV head), every layer attends to its
    proximal tokens (``n_s`` sinks + ``n_r`` recent, relative to each query) with its own keys and to the distant
    tokens with the attention *logits* of the block's lowest layer (computed there at the same step and shared),
    applied to its own values; the two parts are combined with the parameter-free gate of eq. 4 (log-sum-exps).
    For the lowest layer this equals standard attention (App. A.1), so ``block_map: null`` (every layer its own
    block) is FullKV token for token.

    Memory: a layer that is non-lowest for *every* KV head keeps keys only for the tokens a future query can attend
    with them, sinks + the last ``n_r - 1`` tokens (values for all tokens); it drops them at prefill and after every
    decode step. The engine's cache is ``(B, H, T, D)`` per layer, so in a layer where some KV heads are lowest and
    others not, all keys stay resident (the non-lowest heads still use the shared logits): with a per-KV-head map
    the realised saving is below the paper's per-head figure; a ``granularity: layer`` map realises all of it. The
    captured decode (``engine.decode=graph``) keeps such a layer's keys in a ring of ``n_s + n_r`` slots: the same.

    Prefill (``prefill="shared"``, default): the prompt is attended with the same eqs. 3-4 (the attention definition
    changes in both phases, A5.4; a post-trained model, ``scripts/pod_adapt.py``, is trained with exactly this),
    chunked over queries (``chunk``) and computed from the source layers' queries and keys, so no ``n x n`` matrix
    is kept; ``prefill="full"``: standard attention for the prompt, sharing only at decode.

    ``gate="calibrated"`` (A5.7 (b), training-free): the shared distant logits get a per-(layer, KV head) offset
    ``b = E[lse_l(a^D_true) - lse_src(a^D)]`` estimated offline (``pod_grouping --calibrate``, stored in the block
    map as ``gate_offsets`` for the map's ``n_s``/``n_r``), so ``g = sigmoid(lse a^P - lse a^D_src - b)``.

    ``tau``: gate threshold; in non-lowest layers, where ``g >= tau`` the distant part is skipped (1.0: never).
    ``block_map``: a JSON file from ``python -m kvbench.analysis.pod_grouping``, or null for no sharing.
    Batch size 1 (token positions are entry indices; POD never evicts). The budget is not used: the proximal window
    is ``n_s + n_r``. Without post-training the shared logits come from another layer's Q/K (A5.6 item 3), so expect
    degradation at low ``delta``.
    """

    name: ClassVar[str] = "pod"
    own_attention: ClassVar[bool] = True
    supports_continued_forward: ClassVar[bool] = False  # its own single-query decode attention/selection
    supports_batching: ClassVar[bool] = False
    n_s: int = 16
    n_r: int = 4080
    delta: float | None = None
    block_map: str | None = None
    tau: float = 1.0
    gate: str = "paper"
    prefill_mode: str = "shared"
    chunk: int = 1024
    _map: dict | None = field(default=None, init=False, repr=False)

    def describe(self) -> dict:
        """The block map is named by its file name and content hash, not its path: a job's key does not depend on
        where the checkout lives, and a rewritten map is a different job."""
        described = {k: v for k, v in super().describe().items() if not k.startswith("_")}
        if self._map is not None:
            described["block_map"] = f"{Path(self.block_map).name}#sha256:{self._map['sha256'][:16]}"
        return described

    def budget_label(self, budget: Budget) -> str:
        return f"window{self.n_s}+{self.n_r}"  # the budget is unused: the window sets what stays resident

    def __post_init__(self) -> None:
        if self.n_s < 0 or self.n_r < 1:
            raise ConfigError(f"method 'pod': n_s={self.n_s} must be >= 0 and n_r={self.n_r} >= 1")
        if not 0 < self.tau <= 1:
            raise ConfigError(f"method 'pod': tau={self.tau} must be in (0, 1]")
        check_choice(self.name, "gate", self.gate, GATES)
        check_choice(self.name, "prefill_mode", self.prefill_mode, PREFILLS)
        if self.chunk < 1:
            raise ConfigError(f"method 'pod': chunk={self.chunk} must be >= 1")
        if self.block_map is not None:
            self._map = load_block_map(self.block_map)
            if self.delta is not None and self._map.get("delta") is not None and self._map["delta"] != self.delta:
                raise ConfigError(
                    f"method 'pod': delta={self.delta} but block_map {self.block_map!r} was built with "
                    f"delta={self._map['delta']}"
                )
        self._prompt_sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # prefill: src -> (queries, keys)
        self._offsets: torch.Tensor | None = None  # (L, Hkv) calibrated-gate offsets
        if self.gate == "calibrated":
            self._offsets = self._calibration()
        self._lowest: list[list[int]] | None = None  # [layer][kv head] -> lowest layer of its block
        self._sources: set[int] = set()  # layers whose distant logits other layers use
        self._shared: dict[int, torch.Tensor] = {}  # source layer -> distant logits of this step (B, Hkv, g, q, T)
        self.skipped = 0  # (layer, head, query) distant parts skipped by the tau gate
        self.gated = 0

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured decode step (``static_attention``: ``attend``'s eqs. 3-4 over the slots, which POD fills in
        entry order and never frees), the block's distant logits passed up through the step's shared logits buffer
        (per KV head: blocks are consecutive layers, so a head's buffer holds its current block's lowest layer's). A
        layer that is non-lowest for every KV head keeps its keys in a window of ``n_s + n_r`` slots
        (``key_window``), as ``_trim`` keeps them. Before the first prefill the layer roles are not known yet: a plain
        policy. The gate counters (``gated``, ``skipped``) count host-driven steps only."""
        from kvbench.engine.static import StaticPolicy

        if self._lowest is None or layer_idx >= len(self._lowest):
            return StaticPolicy()
        row = self._lowest[layer_idx]
        own = tuple(src == layer_idx for src in row)
        if all(own) and layer_idx not in self._sources:
            return StaticPolicy()  # standard attention, and no layer above reads this one's logits
        offsets = None if self._offsets is None else tuple(float(x) for x in self._offsets[layer_idx].tolist())
        return StaticPolicy(attention=static_attention, shared="pod_distant",
                            params=(self.n_s, self.n_r, own, offsets, self.tau),
                            key_window=None if any(own) else (self.n_s, self.n_r))

    def _calibration(self) -> torch.Tensor:
        cal = (self._map or {}).get("gate_offsets")
        if not cal:
            raise ConfigError("method 'pod': gate=calibrated needs a block_map with gate_offsets (write one with "
                              "`python -m kvbench.analysis.pod_grouping --calibrate ...`); valid gates without: paper")
        if (cal["n_s"], cal["n_r"]) != (self.n_s, self.n_r):
            raise ConfigError(f"method 'pod': gate_offsets of {self.block_map!r} were calibrated for n_s={cal['n_s']}, "
                              f"n_r={cal['n_r']}, not n_s={self.n_s}, n_r={self.n_r}")
        return torch.tensor(cal["offsets"], dtype=torch.float32)

    # ---- block structure -----------------------------------------------------------------------------------------
    def _structure(self, num_layers: int, num_kv_heads: int) -> list[list[int]]:
        if self._lowest is None or len(self._lowest) != num_layers:
            self._lowest = lowest_per_layer(self._map, num_layers, num_kv_heads)
            self._sources = {src for layer, row in enumerate(self._lowest) for src in row if src != layer}
        return self._lowest

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """POD's memory is set by its window, not the budget: without a block map (or with a per-head map in which no
        layer is non-lowest for every KV head) it keeps every key and value by definition ("none"); with a map that
        has such a layer, a prompt longer than ``n_s + n_r - 1`` tokens must leave that layer with fewer keys."""
        if self._map is None or prompt_len <= self.n_s + self.n_r - 1:
            return "none"
        return "prefill" if trimmed_layers(self._map) else "none"

    def trims_keys(self, layer_idx: int, num_layers: int, num_kv_heads: int) -> bool:
        """Whether ``layer_idx`` is non-lowest for every KV head (it then drops its distant keys)."""
        return all(src != layer_idx for src in self._structure(num_layers, num_kv_heads)[layer_idx])

    def _trim(self, layer: KVLayer) -> None:
        """Keep keys only for sinks and the last ``n_r - 1`` tokens: what the next query's proximal set needs."""
        total, kept = layer.values.shape[2], layer.keys.shape[2]
        want = min(total, self.n_s) + min(max(total - self.n_s, 0), self.n_r - 1)
        if kept <= want:
            return
        sinks = min(self.n_s, total)
        tail = want - sinks
        parts = [layer.keys[:, :, :sinks]] + ([layer.keys[:, :, kept - tail :]] if tail else [])
        layer.keys = torch.cat(parts, dim=2).contiguous()

    # ---- engine hooks --------------------------------------------------------------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        if ctx.layer_idx == 0:
            self._shared.clear()
            self._prompt_sources.clear()
        if self.prefill_mode != "shared":
            return None
        lowest = self._structure(ctx.num_layers, ctx.num_kv_heads)
        if ctx.layer_idx in self._sources:
            self._prompt_sources[ctx.layer_idx] = (ctx.queries, layer.keys)
        row = lowest[ctx.layer_idx]
        if all(src == ctx.layer_idx for src in row):
            return None  # standard attention: the backend's exact path
        offsets = self._offsets[ctx.layer_idx].to(ctx.queries.device) if self._offsets is not None else None
        out = pod_sequence_attention(ctx.queries, layer.keys, layer.values, ctx.scaling, row, ctx.layer_idx,
                                     self._prompt_sources, self.n_s, self.n_r, ctx.key_valid, offsets, self.chunk)
        for src in set(row) - {ctx.layer_idx}:  # free a source's prompt queries after the last layer that uses it
            if all(lowest[later][h] != src for later in range(ctx.layer_idx + 1, ctx.num_layers)
                   for h in range(ctx.num_kv_heads)):
                self._prompt_sources.pop(src, None)
        return out.to(layer.values.dtype)

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        self._prompt_sources.clear()

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self._shared.clear()
        if self.trims_keys(ctx.layer_idx, ctx.num_layers, ctx.num_kv_heads):
            self._trim(layer)

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        lowest = self._structure(ctx.num_layers, ctx.num_kv_heads)[ctx.layer_idx]
        own = [src == ctx.layer_idx for src in lowest]
        if all(own) and ctx.layer_idx not in self._sources:
            return None  # standard attention, no one needs this layer's logits: the engine's exact path
        query = ctx.query
        b, hq, q, d = query.shape
        hkv = layer.values.shape[1]
        total, kept = layer.values.shape[2], layer.keys.shape[2]
        scaling = ctx.scaling or d**-0.5
        device = query.device
        entries = torch.arange(total, device=device)
        if kept == total:
            key_entries = entries
        else:  # trimmed: sinks then the tail
            sinks = min(self.n_s, total)
            key_entries = torch.cat([entries[:sinks], entries[total - (kept - sinks) :]])
        prox, dist = proximal_distant_masks(entries[total - q :], entries, self.n_s, self.n_r)
        if layer.valid is not None:
            valid = layer.valid.unsqueeze(2).unsqueeze(3)  # (B, H, 1, 1, T)
            prox, dist = prox & valid, dist & valid
        else:
            prox, dist = prox.view(1, 1, 1, q, total), dist.view(1, 1, 1, q, total)
        qg = query.view(b, hkv, hq // hkv, q, d)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, layer.keys).float() * scaling
        prox_k = prox[..., key_entries]
        values = layer.values
        out = torch.empty(b, hkv, hq // hkv, q, d, dtype=values.dtype, device=device)
        if any(own):
            if kept != total:
                raise RuntimeError(f"pod: layer {ctx.layer_idx} lost keys it needs as a lowest layer")
            full = logits.masked_fill(~(prox | dist), float("-inf"))
            probs = torch.softmax(full, dim=-1)
            out_full = probs.to(values.dtype) @ values.unsqueeze(2)
            if ctx.layer_idx in self._sources:
                self._shared[ctx.layer_idx] = logits.masked_fill(~dist, float("-inf"))
            heads = torch.tensor(own, device=device)
            out[:, heads] = out_full[:, heads]
        if not all(own):
            heads = [h for h in range(hkv) if not own[h]]
            shared = torch.stack([self._shared[lowest[h]][:, h] for h in heads], dim=1)
            if self._offsets is not None:
                shared = shared + self._offsets[ctx.layer_idx, heads].to(shared.device).view(1, -1, 1, 1, 1)
            logits_p = logits[:, heads].masked_fill(~prox_k.expand(b, hkv, 1, q, kept)[:, heads], float("-inf"))
            values_p = values[:, heads][:, :, key_entries].unsqueeze(2)
            combined, gate = gate_combine(logits_p, values_p, shared, values[:, heads].unsqueeze(2), self.tau)
            out[:, heads] = combined
            self.skipped += int(((gate >= self.tau) & (gate < 1)).sum())
            self.gated += gate.numel()
        if kept != total or self.trims_keys(ctx.layer_idx, ctx.num_layers, ctx.num_kv_heads):
            self._trim(layer)
        return out.reshape(b, hq, q, d).transpose(1, 2).contiguous()


def static_attention(slots, policy) -> torch.Tensor:
    """``POD.attend`` over a captured step's slots (batch 1; value slot ``j`` holds entry ``j``: POD never frees one),
    output ``(B, Hq, 1, D)``. The KV heads of which this layer is the block's lowest attend every entry with their own
    logits and write their distant logits (eq. 3's D set of this step's query, -inf elsewhere) into ``slots.shared``;
    the others combine their own logits on the proximal set with the shared distant logits (plus a calibrated offset)
    through eq. 4's gate (``gate_combine``), applied to their own values. A layer that is non-lowest for every head
    holds its keys in a ring of ``n_s + n_r`` slots (``StaticPolicy.key_window``): exactly the proximal set's keys
    once this step's key is in; each ring slot's entry is found from the newest entry's index."""
    n_s, n_r, own, offsets, tau = policy.params
    keys, values, valid, query = slots.keys, slots.values, slots.valid, slots.query
    b, hq, q, d = query.shape
    hkv, c = values.shape[1], values.shape[2]
    qg = query.view(b, hkv, hq // hkv, q, d)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys).float() * slots.scaling
    newest = valid.sum(-1, keepdim=True) - 1  # (B, Hkv, 1): this step's entry
    shared = slots.shared
    from_below = shared
    if offsets is not None:
        from_below = shared + torch.tensor(offsets, device=keys.device).view(1, hkv, 1, 1, 1)
    if policy.key_window is not None:  # keys of the proximal set only, in the ring; every head shares
        ring = torch.arange(n_s + n_r, device=keys.device)
        entry = torch.where(ring < n_s, ring, newest - torch.remainder(newest - ring, n_r))  # (B, Hkv, R)
        held = torch.where(ring < n_s, ring <= newest, entry >= n_s)
        values_p = torch.gather(values, 2, entry.clamp(min=0).unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
        logits_p = logits.masked_fill(~held.view(b, hkv, 1, 1, -1), float("-inf"))
        combined, _ = gate_combine(logits_p, values_p.unsqueeze(2), from_below, values.unsqueeze(2), tau)
        return combined.to(values.dtype).reshape(b, hq, q, d)
    slot = torch.arange(c, device=keys.device)
    distant = (valid & (slot >= n_s) & (slot <= newest - n_r)).view(b, hkv, 1, 1, c)
    attended = valid.view(b, hkv, 1, 1, c)
    lowest = torch.tensor(own, device=keys.device).view(1, hkv, 1, 1, 1)
    probs = torch.softmax(logits.masked_fill(~attended, float("-inf")), dim=-1)
    out_own = probs.to(values.dtype) @ values.unsqueeze(2)
    logits_p = logits.masked_fill(~(attended & ~distant), float("-inf"))
    combined, _ = gate_combine(logits_p, values.unsqueeze(2), from_below, values.unsqueeze(2), tau)
    shared.copy_(torch.where(lowest, logits.masked_fill(~distant, float("-inf")), shared))
    out = torch.where(lowest, out_own, combined.to(values.dtype))
    return out.reshape(b, hq, q, d)
