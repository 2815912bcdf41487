"""POD's attention over a whole sequence (prompt prefill and post-training), differentiable and chunked.

Paper 004 eqs. 3-4 (reference/methods.md A5.3): in a block of consecutive layers, layer l attends to its proximal
tokens P_i (``n_s`` sinks + ``n_r`` recent, relative to query i) with its own Q/K, and to its distant tokens D_i with
the logits ``Q_src K_src^T`` of the block's lowest layer ``src``, applied to its own values; the gate of eq. 4 equals
one softmax over the concatenation ``[a^P, a^D]``:

    g o^P + (1 - g) o^D = softmax([a^P ; a^D]) [V_P ; V_D]      with  g = Σexp a^P / (Σexp a^P + Σexp a^D)

so this module builds the mixed logit row (own logits on P, shared logits on D, -inf elsewhere) and applies one
softmax. For the lowest layer of a block (``src == l``) the mixed row is the plain causal row: standard attention.
An optional per-(KV head) ``offset`` is added to the shared logits: the calibrated gate of A5.7 (b),
``g = sigmoid(lse a^P - lse a^D_src - b)``.

The decode step uses the same eq. 3 masks and eq. 4's gate in log-sum-exp form (``gate_combine``).

Queries are processed in chunks of ``chunk`` rows, so memory is ``chunk x n`` logits per head, never ``n x n`` for
long prompts (training at short lengths uses one chunk and autograd keeps what it needs).
"""

from __future__ import annotations

import torch


def proximal_distant_masks(query_pos: torch.Tensor, key_pos: torch.Tensor, n_s: int, n_r: int):
    """Eq. 3 with the recent window relative to each query (A5.6 item 2): ``(P, D)`` bool ``(q, T)``.

    P_i = {j < n_s} ∪ {i - n_r < j <= i}; D_i = {n_s <= j <= i - n_r} (empty while i < n_s + n_r).
    """
    i = query_pos.view(-1, 1)
    j = key_pos.view(1, -1)
    causal = j <= i
    distant = (j >= n_s) & (j <= i - n_r)
    return causal & ~distant, distant


def gate_combine(logits_p, values_p, logits_d, values_d, tau: float = 1.0):
    """Eq. 4: ``o = g o^P + (1 - g) o^D`` with ``g = Σexp a^P / (Σexp a^P + Σexp a^D)``, via log-sum-exps.

    logits_*: ``(..., q, T_*)`` float, ``-inf`` where a token is not in the set; values_*: ``(..., T_*, D)``.
    An empty distant set gives ``g = 1``. Where ``g >= tau`` the distant part is skipped (``o = o^P``; A5.3).
    Returns the output ``(..., q, D)`` and the gate ``(..., q)`` (before skipping).
    """
    lse_p = torch.logsumexp(logits_p, dim=-1)
    lse_d = torch.logsumexp(logits_d, dim=-1)
    probs_p = torch.exp(logits_p - lse_p.unsqueeze(-1))
    safe_d = torch.where(torch.isfinite(lse_d), lse_d, torch.zeros_like(lse_d))
    probs_d = torch.exp(logits_d - safe_d.unsqueeze(-1))  # all zeros for an empty distant set
    out_p = probs_p.to(values_p.dtype) @ values_p
    out_d = probs_d.to(values_d.dtype) @ values_d
    gate = torch.exp(lse_p - torch.logaddexp(lse_p, lse_d))  # sigmoid(lse_p - lse_d); 1 when lse_d = -inf
    g = torch.where(gate >= tau, torch.ones_like(gate), gate).unsqueeze(-1).to(out_p.dtype)
    return g * out_p + (1 - g) * out_d, gate


def mixed_logits(
    own: torch.Tensor, shared: torch.Tensor | None, query_pos: torch.Tensor, key_pos: torch.Tensor, n_s: int, n_r: int,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The eq. 3-4 logit rows of one chunk: own logits on P, shared logits (+ offset) on D, -inf outside causality.

    own, shared: ``(B, Hkv, g, q, T)``; ``shared`` None means the lowest layer (plain causal row). ``offset``:
    ``(Hkv,)`` or None. query_pos ``(q,)``, key_pos ``(T,)``.
    """
    if shared is None:
        return own.masked_fill(~(key_pos.view(1, -1) <= query_pos.view(-1, 1)), float("-inf"))
    proximal, distant = proximal_distant_masks(query_pos, key_pos, n_s, n_r)
    if offset is not None:
        shared = shared + offset.view(1, -1, 1, 1, 1).to(shared.dtype)
    out = torch.where(distant, shared, own)
    return out.masked_fill(~(proximal | distant), float("-inf"))


def pod_sequence_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, lowest: list[int], layer_idx: int,
    sources: dict[int, tuple[torch.Tensor, torch.Tensor]], n_s: int, n_r: int, key_valid: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None, chunk: int = 1024,
) -> torch.Tensor:
    """Causal POD attention of a whole sequence for one layer.

    query ``(B, Hq, n, D)``, key/value ``(B, Hkv, n, D)`` (post-RoPE, this layer's); ``lowest[h]``: the lowest layer
    of KV head h's block; ``sources[src] = (query_src, key_src)`` of every lower source layer this layer shares
    with (same shapes as query/key). key_valid ``(B, n)`` masks left padding. offsets ``(Hkv,)``: calibrated-gate
    offsets of this layer, or None. Returns ``(B, n, Hq, D)`` (the transformers attention-output layout).
    """
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    own_heads = [h for h in range(hkv) if lowest[h] == layer_idx]
    pos = torch.arange(n, device=query.device)
    qg = query.view(b, hkv, g, n, d)
    outs = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        own = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, start:stop], key[:, :, :stop]).float() * scaling
        shared = None
        if len(own_heads) < hkv:
            parts = []
            for h in range(hkv):
                if lowest[h] == layer_idx:
                    parts.append(own[:, h])
                    continue
                q_src, k_src = sources[lowest[h]]
                qs = q_src.view(b, hkv, g, n, d)[:, h, :, start:stop]
                parts.append(torch.einsum("bgqd,bkd->bgqk", qs, k_src[:, h, :stop]).float() * scaling)
            shared = torch.stack(parts, 1)
            if own_heads:  # lowest heads of this layer: their "shared" logits are their own (standard attention)
                off = torch.zeros(hkv, device=query.device) if offsets is None else offsets.clone()
                off[own_heads] = 0.0
                offsets_chunk = off
            else:
                offsets_chunk = offsets
        else:
            offsets_chunk = None
        logits = mixed_logits(own, shared, pos[start:stop], pos[:stop], n_s, n_r, offsets_chunk)
        if key_valid is not None:
            logits = logits.masked_fill(~key_valid[:, :stop].view(b, 1, 1, 1, stop), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        probs = torch.nan_to_num(probs)  # fully masked rows (left padding queries) give zeros, not NaN
        outs.append(torch.einsum("bhgqk,bhkd->bhgqd", probs.to(value.dtype), value[:, :, :stop]))
    out = torch.cat(outs, dim=3).reshape(b, hq, n, d)
    return out.transpose(1, 2).contiguous()


class PODTrainingAttention:
    """While active, every attention layer of ``model`` computes POD's whole-sequence attention (no cache), with
    gradients: the post-training of paper 004 §2.2 ("the same masks as inference"). Used by
    ``scripts/pod_adapt.py``; a plain forward under it gives the logits a POD-adapted model is trained on.

        with PODTrainingAttention(model, lowest, n_s, n_r):
            loss = model(input_ids, labels=input_ids).loss

    lowest: ``lowest[layer][kv_head]`` = the lowest layer of that head's block (``POD._structure``).
    """

    NAME = "kvbench_pod_train"

    def __init__(self, model, lowest: list[list[int]], n_s: int, n_r: int, chunk: int = 4096):
        self.model, self.lowest, self.n_s, self.n_r, self.chunk = model, lowest, n_s, n_r, chunk
        self.sources: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.source_layers = {src for layer, row in enumerate(lowest) for src in row if src != layer}

    def _attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        if layer == 0:
            self.sources = {}
        if layer in self.source_layers:
            self.sources[layer] = (query, key)
        key_valid = None
        if attention_mask is not None and attention_mask.dim() == 4:  # left padding: the last row sees every key
            row = attention_mask[:, 0, -1, : key.shape[2]]
            key_valid = row if row.dtype == torch.bool else row == 0
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = pod_sequence_attention(query, key, value, scaling, self.lowest[layer], layer, self.sources, self.n_s,
                                     self.n_r, key_valid, None, self.chunk)
        return out.to(value.dtype), None

    def __enter__(self) -> PODTrainingAttention:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(self.NAME, self._attention)
        AttentionMaskInterface.register(self.NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.NAME)
        return self

    def __exit__(self, *exc) -> None:
        self.model.set_attn_implementation(self._previous)
        self.sources = {}
