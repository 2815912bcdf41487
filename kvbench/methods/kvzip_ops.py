"""KVzip's two computations, as tensors in and out (arXiv:2505.23416; kvpress ``KVzipPress``, which follows the
authors' snu-mllab/KVzip): the score each cached context entry gets while the model reconstructs its chunk of the
context, and which entries stay given every layer's scores.

``KVzip`` (``kvzip.py``) uses them on the queries of the repeat forwards the engine runs for it
(``Method.needs_reconstruction``). Pinned against kvpress on seeded inputs and end to end on a tiny Llama
(``tests/test_parity_kvpress_kvzip.py``).
"""

from __future__ import annotations

import torch

#: kvpress's repeat prompts (the first chunk, then later chunks followed by the previous chunk's last 8 tokens)
FIRST_CHUNK_PROMPT = "\n\nRepeat the previous context exactly."
LATER_CHUNK_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL_TOKENS = 8


def reconstruction_scores(queries: torch.Tensor, keys: torch.Tensor, start: int, end: int, n_sink: int,
                          scaling: float) -> torch.Tensor:
    """Max attention each entry of the chunk ``[start, end)`` receives from the repeat forward's queries: ``(B, H,
    end - start)``, the max over the queries and the query heads of each KV group.

    queries ``(B, Hq, q, D)``: the repeat tokens' post-RoPE queries; keys ``(B, H, T, D)``: the layer's cache with the
    repeat tokens' own ``q`` keys last. As kvpress, the softmax runs over the first ``min(n_sink, start)`` entries
    (sinks), the chunk and the repeat tokens (causal among themselves), not over the whole context.
    """
    b, hq, q, d = queries.shape
    h = keys.shape[1]
    sink = min(n_sink, start)
    chunk = end - start
    keys = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -q:]], dim=2)
    logits = torch.matmul(queries.view(b, h, hq // h, q, d), keys.unsqueeze(2).transpose(-2, -1)) * scaling
    causal = torch.ones(q, q, dtype=torch.bool, device=queries.device).triu(1)
    logits[..., -q:] = logits[..., -q:].masked_fill(causal, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs[..., sink : sink + chunk].amax(dim=(-3, -2))


def kvzip_keep(scores: torch.Tensor, n_pruned: int, layerwise: bool, n_sink: int) -> torch.Tensor:
    """Entries kept ``(L, B, H, n)`` bool from every layer's scores ``(L, B, H, n)`` (0 where nothing scored them:
    a chat prefix after the sinks), as kvpress's ``compress_post``: the first ``n_sink`` entries get the overall max
    + 1; ``layerwise=False``: the ``n_pruned`` lowest scores of each row over all layers and heads leave (layers and
    heads keep different numbers); ``layerwise=True``: ``n_pruned`` per layer, the lowest over its heads. Ties break
    as kvpress's ``torch.topk`` of the negated flattened scores."""
    scores = scores.clone()
    scores[..., :n_sink] = scores.amax() + 1.0
    n_layers, b, h, n = scores.shape
    keep = torch.ones_like(scores, dtype=torch.bool)
    for row in range(b):
        per_layer = [n_pruned] * n_layers
        if not layerwise:
            pruned = torch.topk(-scores[:, row].reshape(-1), n_pruned).indices
            per_layer = torch.bincount(pruned // (h * n), minlength=n_layers).tolist()
        for layer, count in enumerate(per_layer):
            index = torch.topk(-scores[layer, row].reshape(-1), int(count)).indices
            keep[layer, row].view(-1)[index] = False
    return keep
