"""``CompressionSession``: plugs a method into a transformers model through public extension points only.

    with CompressionSession(model, method, budget) as session:
        out = model.generate(**inputs)            # or kvbench.engine.generate.greedy_generate(...)
    session.stats                                 # resident KV bytes, per-layer entries, attended tokens

While active, the model's attention implementation is ``kvbench_<impl>`` (registered via ``AttentionInterface``),
and a forward pre-hook on every attention module converts the layer's cache into a ``KVLayer`` (works with the
``DynamicCache`` that ``generate`` creates, or with a ``KVCache`` passed in). On exit the model is restored.

A method that scores tokens by the model's own predictions (``Method.needs_logits``, SirLLM's token entropy) also gets
three hooks: a pre-hook on the model records the forward's ``input_ids``, a hook on the decoder stack
(``get_decoder()``) records its final hidden states at every position (``generate`` and ``greedy_generate`` ask the
head for the last position only, ``logits_to_keep=1``), and a hook on the model calls ``Method.observe_logits`` after
the forward, i.e. before the next one, with a :class:`TokenLogits` that applies the output head in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.budget import Budget
from kvbench.engine.attention import ACTIVE_SESSION, backend_function, grouped_attention, register_backends
from kvbench.engine.cache import KVLayer, ensure_kv_layer
from kvbench.engine.options import POSITION_MODES
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, real_rank

_ROTATABLE_ROPE = ("default", "linear", "llama3")


@dataclass
class SessionStats:
    """Per generation call (reset at every new prefill)."""

    prompt_lens: list[int] = field(default_factory=list)
    layer_entries_after_prefill: list[float] = field(default_factory=list)  # valid entries per layer (row 0)
    resident_kv_bytes_after_prefill: int = 0
    #: sum over decode steps and layers of mean attended entries per (row, head); a device scalar when padded caches
    #: were counted (read once, here, not at every layer of every step)
    attended_entries_sum: int | torch.Tensor = 0
    decode_layer_calls: int = 0

    @property
    def attended_tokens_mean(self) -> float:
        """Mean number of entries a (layer, head) attended at a decode step."""
        return float(self.attended_entries_sum) / self.decode_layer_calls if self.decode_layer_calls else 0.0


class CompressionSession:
    def __init__(self, model, method: Method, budget: Budget, position_mode: str = "original"):
        if position_mode not in POSITION_MODES:
            raise ConfigError(f"position_mode={position_mode!r} is not valid; valid: {', '.join(POSITION_MODES)}")
        self.model = model
        self.method = method
        self.budget = budget
        self.position_mode = position_mode
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.stats = SessionStats()
        self._layers: dict[int, KVLayer | None] = {}
        self._prompt: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None  # set at layer 0's prefill
        self._hooks: list = []
        self._token = None
        self._input_ids: torch.Tensor | None = None  # needs_logits: the current forward's tokens
        self._hidden: torch.Tensor | None = None  # needs_logits: its final hidden states (B, q, H)
        self._previous: torch.Tensor | None = None  # needs_logits: log-softmax of the previous forward's last position
        self._prefill_forward = False
        self._inv_freq = self._rope_inv_freq() if position_mode == "compact" else None
        #: RoPE frequencies for methods that re-rotate keys (LM-Infinite's distance ceiling); None if not rotatable
        self.rope_inv_freq = self._inv_freq if self._inv_freq is not None else self._rope_inv_freq(strict=False)
        #: prompts up to this many tokens get plain causal attention (sliding windows, soft-capping: 0 = never)
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) is not False else None
        capped = getattr(cfg, "attn_logit_softcapping", None) is not None
        self._plain_causal_upto = 0 if capped else (int(window) if window else 1 << 62)

    # ---- context management ----------------------------------------------------------------------------------
    def __enter__(self) -> CompressionSession:
        register_backends()
        self._orig_impl = self.model.config._attn_implementation
        base = self._orig_impl.removeprefix("kvbench_")
        if base not in ("sdpa", "eager", "flash_attention_2"):
            raise ConfigError(
                f"attention implementation {base!r} is not supported; valid: sdpa, eager, flash_attention_2"
            )
        self.model.set_attn_implementation(f"kvbench_{base}")
        for module in self.model.modules():
            if hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention"):
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        if self.method.needs_logits:
            _check_plain_logit_head(self.model)
            self._hooks += [
                self.model.register_forward_pre_hook(self._capture_input_ids, with_kwargs=True),
                self.model.get_decoder().register_forward_hook(self._capture_hidden),
                self.model.register_forward_hook(self._observe_logits, with_kwargs=True),
            ]
        self._token = ACTIVE_SESSION.set(self)
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        ACTIVE_SESSION.reset(self._token)
        self.model.set_attn_implementation(self._orig_impl)

    def _pre_hook(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        self._layers[module.layer_idx] = None if cache is None else ensure_kv_layer(cache, module.layer_idx)

    # ---- the model's predictions, for methods that need them (needs_logits) ----------------------------------------
    def _capture_input_ids(self, module, args, kwargs):
        self._input_ids = kwargs.get("input_ids", args[0] if args else None)
        self._hidden = None

    def _capture_hidden(self, module, args, output):
        self._hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def _observe_logits(self, module, args, kwargs, output):
        prefill, self._prefill_forward = self._prefill_forward, False
        layers = [self._layers.get(i) for i in range(self.num_layers)]
        if any(layer is None for layer in layers) or self._hidden is None:
            return  # use_cache=False: no cache to act on
        if self._input_ids is None:
            raise NotAvailableError(f"method {self.method.name!r} scores the input tokens: call the model with "
                                    "input_ids (inputs_embeds were given)")
        logits = TokenLogits(self._hidden, self.model.get_output_embeddings(), None if prefill else self._previous)
        if not self.budget.is_full:
            self.method.observe_logits(layers, self._input_ids, logits)
        self._previous = logits.last()
        if prefill:  # the method may have compressed the prompt only now: measure what stays
            self._record_prefill_stats(layers)

    # ---- the attention call ------------------------------------------------------------------------------------
    def attend(self, impl, module, query, key, value, attention_mask, **kwargs):
        layer = self._layers.get(module.layer_idx)
        backend = backend_function(impl)
        if layer is None:  # use_cache=False: nothing to compress
            return backend(module, query, key, value, attention_mask, **kwargs)
        q_len = query.shape[2]
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            pos = position_ids.view(position_ids.shape[0], 1, -1)[..., -q_len:]
            layer.positions[..., -q_len:] = pos.expand(layer.positions.shape[0], layer.positions.shape[1], q_len)
            if layer.rope_pos is not None:
                layer.rope_pos[..., -q_len:] = layer.positions[..., -q_len:].float()
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        if layer.seen == q_len:
            return self._prefill(backend, module, layer, query, key, value, attention_mask, scaling, kwargs)
        return self._decode(backend, module, layer, query, attention_mask, scaling, kwargs)

    def _prefill(self, backend, module, layer, query, key, value, attention_mask, scaling, kwargs):
        b, n = query.shape[0], query.shape[2]
        if module.layer_idx == 0:  # padding, prompt lengths and budgets are the same for every layer of a forward
            self._prefill_forward = True
            key_valid = _key_valid(attention_mask, n)
            prompt_lens = key_valid.sum(-1) if key_valid is not None else torch.full((b,), n, device=query.device)
            capacity = torch.tensor([self.budget.tokens_for(int(x)) for x in prompt_lens], device=query.device)
            self._prompt = (key_valid, prompt_lens, capacity)
            self.stats = SessionStats(prompt_lens=[int(x) for x in prompt_lens])
        key_valid, prompt_lens, capacity = self._prompt
        if key_valid is not None:
            layer.set_valid(key_valid.view(b, 1, n).expand(b, layer.keys.shape[1], n).clone())
        ctx = PrefillContext(
            layer_idx=module.layer_idx, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=layer.keys.shape[1], scaling=scaling, queries=query, key_valid=key_valid,
            prompt_lens=prompt_lens, capacity=capacity, rope_inv_freq=self.rope_inv_freq,
            plain_causal=n <= self._plain_causal_upto,
        )
        out = None if self.budget.is_full else self.method.prefill_attend(layer, ctx)  # Λ-masks (LM-Infinite, CaM)
        if out is None:
            out, _ = backend(module, query, key, value, attention_mask, **kwargs)
        layer.capacity = capacity
        if not self.budget.is_full:
            self.method.prefill(layer, ctx)
        if module.layer_idx == self.num_layers - 1:
            self._finish_prefill(ctx)
        return out, None

    def _finish_prefill(self, ctx: PrefillContext) -> None:
        """After the last layer: cross-layer decisions (D2O's allocation, DynamicKV's last update), then stats."""
        layers = [self._layers[i] for i in range(self.num_layers)]
        if not self.budget.is_full:
            self.method.finish_prefill(layers, ctx)
        for layer in layers:
            self._rerotate(layer)
        self._record_prefill_stats(layers)

    def _record_prefill_stats(self, layers: list[KVLayer]) -> None:
        self.stats.resident_kv_bytes_after_prefill = sum(layer.resident_bytes() for layer in layers)
        # mean over KV heads of row 0 (heads can keep different numbers: KVMerger's ragged sets); one device read
        means = torch.stack([layer.valid_counts()[0].float().mean() for layer in layers]).tolist() if layers else []
        self.stats.layer_entries_after_prefill = [int(m) if m.is_integer() else round(m, 2) for m in means]

    def _decode(self, backend, module, layer, query, attention_mask, scaling, kwargs):
        capacity = layer.capacity
        ctx = DecodeContext(
            layer_idx=module.layer_idx, num_layers=self.num_layers, num_kv_heads=layer.values.shape[1],
            query=query, probs=None, capacity=capacity, scaling=scaling, rope_inv_freq=self.rope_inv_freq,
        )
        if self.position_mode == "compact":
            self._rerotate(layer)
        out = self.method.attend(layer, ctx)  # a method with its own decode attention (POD); None: the engine's
        if out is not None:
            valid, entries = layer.valid, layer.values.shape[2]
        else:
            out, valid, entries = self._engine_attention(backend, module, layer, query, scaling, ctx, kwargs)
        if ctx.attended is not None:
            attended = ctx.attended
        else:  # padded caches (KVMerger, D2O's padded heads): a device scalar, summed without a host read
            attended = valid.sum() // valid[..., 0].numel() if valid is not None else entries
        self.stats.attended_entries_sum += attended
        self.stats.decode_layer_calls += 1
        self.method.decode(layer, ctx)
        return out, None

    def _engine_attention(self, backend, module, layer, query, scaling, ctx, kwargs):
        q_len = query.shape[2]
        selected = self.method.select(layer, ctx)
        keys, values, valid = layer.keys, layer.values, layer.valid
        if selected is not None:
            idx4 = selected.unsqueeze(-1).expand(*selected.shape, keys.shape[-1])
            keys, values = torch.gather(keys, 2, idx4), torch.gather(values, 2, idx4)
            valid = torch.gather(valid, -1, selected) if valid is not None else None
        # the backend repeats KV heads by the model's group size: only valid for KV-head-granular caches
        fast = not self.method.needs_decode_probs and valid is None and q_len == 1
        fast = fast and keys.shape[1] == self.num_kv_heads
        if fast:  # numerically the backend's own decode path (FullKV == plain generate)
            out, _ = backend(module, query, keys, values, None, **kwargs)
        else:
            allowed = _decode_allowed(valid, keys.shape[:2], keys.shape[2], q_len, query.device)
            out, probs = grouped_attention(query, keys, values, allowed, scaling)
            ctx.probs = probs
        return out, valid, keys.shape[2]

    # ---- compact positions (StreamingLLM's in-cache positions) -------------------------------------------------
    def _rope_inv_freq(self, strict: bool = True) -> torch.Tensor | None:
        params = getattr(self.model.config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if not strict:
            try:
                return self._rope_inv_freq()
            except ConfigError:
                return None
        if rope_type not in _ROTATABLE_ROPE:
            raise ConfigError(
                f"position_mode=compact needs a position-independent RoPE; rope_type={rope_type!r} is not one of "
                f"{', '.join(_ROTATABLE_ROPE)}"
            )
        for module in self.model.modules():
            if hasattr(module, "inv_freq") and float(getattr(module, "attention_scaling", 1.0)) == 1.0:
                return module.inv_freq.detach().float()
        raise ConfigError("position_mode=compact: the model has no rotary embedding with attention_scaling 1")

    def _rerotate(self, layer: KVLayer) -> None:
        """Re-rotate keys so that relative distances equal those of a cache whose entries sit at 0..count-1."""
        if self.position_mode != "compact":
            return
        rope_pos = layer.rope_pos if layer.rope_pos is not None else layer.positions.float()

        rank = real_rank(layer).float()
        counts = layer.valid_counts().unsqueeze(-1).float()
        latest = layer.positions.amax(-1, keepdim=True).float()
        target = torch.where(rank >= 0, latest - counts + 1 + rank, rope_pos)
        delta = target - rope_pos
        if bool((delta != 0).any()):
            layer.keys = rotate_keys(layer.keys, delta, self._inv_freq.to(layer.keys.device))
        layer.rope_pos = target


class TokenLogits:
    """The model's log-probabilities of chosen tokens at each position of one forward, for ``observe_logits``.

    hidden: ``(B, q, H)`` final hidden states of the forward; head: the model's output embedding (logits =
    ``head(hidden)``); previous: ``(B, V)`` log-softmax of the previous forward's last position, None after a prompt.
    The head is applied ``chunk`` positions at a time, so nothing ``(B, q, V)`` is held at once for long prompts
    (a forward of at most ``chunk`` tokens, a decode step, is computed once and reused).
    """

    def __init__(self, hidden: torch.Tensor, head, previous: torch.Tensor | None, chunk: int = 256):
        self.hidden, self.head, self.previous, self.chunk = hidden, head, previous, chunk
        self._short: torch.Tensor | None = None

    def _log_softmax(self, start: int) -> torch.Tensor:
        if self.hidden.shape[1] <= self.chunk and self._short is not None:
            return self._short
        out = torch.log_softmax(self.head(self.hidden[:, start : start + self.chunk]).float(), dim=-1)
        if self.hidden.shape[1] <= self.chunk:
            self._short = out
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """``log softmax(logits[:, i])[ids[:, i]]`` for the first q' <= q positions: ``ids`` ``(B, q')`` -> ``(B, q')``
        float32 (a shifted ``ids`` scores each position's next token)."""
        out = []
        for start in range(0, self.hidden.shape[1], self.chunk):
            logp = self._log_softmax(start)
            out.append(torch.gather(logp, -1, ids[:, start : start + self.chunk].unsqueeze(-1)).squeeze(-1))
        return torch.cat(out, dim=1)

    def last(self) -> torch.Tensor:
        """Log-softmax at the forward's last position ``(B, V)`` (the prediction of the next input token)."""
        if self.hidden.shape[1] <= self.chunk:
            return self._log_softmax(0)[:, -1]
        return torch.log_softmax(self.head(self.hidden[:, -1]).float(), dim=-1)


def _check_plain_logit_head(model) -> None:
    """``TokenLogits`` computes logits as ``head(hidden)``: refuse models that post-process them."""
    cfg = model.config
    for attr, neutral in (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0)):
        value = getattr(cfg, attr, None)
        if value is not None and value != neutral:
            raise NotAvailableError(
                f"this model post-processes its logits ({attr}={value}); methods that score tokens by the model's "
                "predictions (needs_logits) support plain output heads only"
            )


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys ``(B, H, T, D)`` by ``delta`` positions ``(B, H, T)`` (RoPE rotations compose
    additively; rotate-half layout, as every transformers RoPE model)."""
    angles = delta.unsqueeze(-1) * inv_freq  # (B, H, T, D/2)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(keys.dtype), emb.sin().to(keys.dtype)
    half = keys.shape[-1] // 2
    rotated_half = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos + rotated_half * sin


def _key_valid(attention_mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Per-key validity ``(B, n)`` from the model's 4-D prefill mask (the last query row sees every real key)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    row = attention_mask[:, 0, -1, :n]
    valid = row if row.dtype == torch.bool else row == 0
    return None if bool(valid.all()) else valid


def _decode_allowed(valid, bh, entries, q_len, device) -> torch.Tensor | None:
    """Mask ``(B, H, q, T)`` for decode/continuation: valid entries, causal among the ``q_len`` newest."""
    allowed = None
    if q_len > 1:
        i = torch.arange(q_len, device=device).view(-1, 1)
        j = torch.arange(entries, device=device).view(1, -1)
        allowed = (j <= entries - q_len + i).view(1, 1, q_len, entries).expand(*bh, q_len, entries)
    if valid is not None:
        v = valid.unsqueeze(2)
        allowed = v.expand(*bh, q_len, entries) if allowed is None else allowed & v
    return allowed
