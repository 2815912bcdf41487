"""The attention functions kvbench registers with transformers (``AttentionInterface``, a public registry).

For each backend ``impl`` in (sdpa, eager, flash_attention_2) kvbench registers ``kvbench_<impl>`` together with
the backend's own mask function (without it a custom key receives ``attention_mask=None`` and loses the causal
mask: reference/environment.md, pitfall 1). Outside a ``CompressionSession`` it behaves exactly like the backend.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class Attending(Protocol):
    """What the registered attention functions call while a session is active (``CompressionSession``); declared here
    so that this module never imports the session (the session imports this one and sets the handle)."""

    def attend(self, impl: str, module, query, key, value, attention_mask, **kwargs): ...


#: the session active in this context (set by ``CompressionSession.__enter__``), or None: plain backend attention
ACTIVE_SESSION: ContextVar[Attending | None] = ContextVar("kvbench_session", default=None)
BACKENDS = ("sdpa", "eager", "flash_attention_2")
#: the session whose whole decode step is captured (``engine.graph``), while its generation replays it: a plain list,
#: because torch.compile cannot trace ``ContextVar.get``
CAPTURED_SESSION: list = []
#: the attention implementation a model runs while its decode step is captured: no mask function is registered for it,
#: so transformers builds no mask (the step attends by the cache's own validity bits) and reads no cache length
GRAPH_IMPL = "kvbench_graph"


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, s_aux=None,
                    **kwargs):
    """Plain softmax attention (the transformers eager path), GQA by viewing queries per KV group; Gemma 2's logit
    soft-cap (``softcap``) and GPT-OSS's per-head sink logits (``s_aux``) as their eager attention applies them."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    scaling = scaling if scaling is not None else d**-0.5
    qg = query.view(b, hkv, hq // hkv, q, d)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, key) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask.view(mask.shape[0], 1, -1, q, mask.shape[-1]), float("-inf"))
        else:
            logits = logits + mask.view(mask.shape[0], 1, -1, q, mask.shape[-1])
    probs = softmax_with_sinks(logits, s_aux, torch.float32).to(query.dtype)
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, value).reshape(b, hq, q, d)
    return out.transpose(1, 2).contiguous(), probs.reshape(b, hq, q, -1)


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim of ``(B, Hkv, g, q, T)`` logits; with ``sinks`` ``(Hq,)`` a learned logit per query
    head joins the normalisation and is dropped afterwards (GPT-OSS's attention sinks)."""
    if sinks is None:
        return torch.softmax(logits, dim=-1, dtype=dtype)
    b, hkv, g, q, _ = logits.shape
    sink = sinks.to(logits.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, q, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(-1, keepdim=True)
    return torch.softmax(combined, dim=-1, dtype=dtype)[..., :-1]


def backend_function(impl: str):
    if impl == "eager":
        return eager_attention
    return ALL_ATTENTION_FUNCTIONS[impl]


def _make(impl: str):
    def kvbench_attention(module, query, key, value, attention_mask, **kwargs):
        session = ACTIVE_SESSION.get()
        if session is None:
            return backend_function(impl)(module, query, key, value, attention_mask, **kwargs)
        return session.attend(impl, module, query, key, value, attention_mask, **kwargs)

    kvbench_attention.__name__ = f"kvbench_{impl}"
    return kvbench_attention


def _captured_attention(module, query, key, value, attention_mask, **kwargs):
    """``kvbench_graph``: the captured decode step's attention, the session's (``captured_attend``)."""
    return CAPTURED_SESSION[-1].captured_attend(module, query, key, value, **kwargs)


def register_backends() -> None:
    """Register ``kvbench_<impl>`` attention + mask functions and the captured step's ``kvbench_graph`` (idempotent)."""
    if GRAPH_IMPL not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GRAPH_IMPL, _captured_attention)
    for impl in BACKENDS:
        name = f"kvbench_{impl}"
        if name in ALL_ATTENTION_FUNCTIONS:
            continue
        AttentionInterface.register(name, _make(impl))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])


def grouped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None, scaling: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``(B, Hq, q, D)`` over a layer's entries ``(B, Hkv, T, D)`` without repeating KV.

    allowed: ``(B, Hkv, q, T)`` bool or None; ``softcap``/``sinks``: the layer's logit soft-cap and sink logits
    (``engine.architecture.LayerAttention``). Returns the output ``(B, q, Hq, D)`` and the probabilities
    ``(B, Hkv, g, q, T)`` (float32).
    """
    b, hq, q, d = query.shape
    hkv = keys.shape[1]
    qg = query.view(b, hkv, hq // hkv, q, d)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys).float() * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if allowed is not None:
        logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    probs = softmax_with_sinks(logits, sinks, torch.float32)
    # values keep head_dim where a channel-pruned cache gave keys (and the gathered query) fewer channels (ThinK)
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(values.dtype), values).reshape(b, hq, q, values.shape[-1])
    return out.transpose(1, 2).contiguous(), probs
