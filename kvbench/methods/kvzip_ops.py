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
#: reconstruction_scores' query blocks: about this many probabilities at a time (4 MiB in float32), a CPU's cache
BLOCK_ELEMENTS = 1 << 20
#: ... with ``few_kernels`` (a GPU, where each block's eight kernels are dispatched by the host): 512 MiB, a 2,048-token
#: chunk of Llama-3-8B (32 query heads, about 4,100 keys) in 3 blocks, where 4 MiB took about 260 blocks per layer and
#: chunk, some 2,000 small kernels (its 4k prefill was 18.7x FullKV's on an H200)
PASS_ELEMENTS = 1 << 27


def reconstruction_scores(queries: torch.Tensor, keys: torch.Tensor, start: int, end: int, n_sink: int,
                          scaling: float, block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor:
    """Max attention each entry of the chunk ``[start, end)`` receives from the repeat forward's queries: ``(B, H,
    end - start)``, the max over the queries and the query heads of each KV group.

    queries ``(B, Hq, q, D)``: the repeat tokens' post-RoPE queries; keys ``(B, H, T, D)``: the layer's cache with the
    repeat tokens' own ``q`` keys last. As kvpress, the softmax runs over the first ``min(n_sink, start)`` entries
    (sinks), the chunk and the repeat tokens (causal among themselves), not over the whole context.

    The queries go in blocks whose probabilities hold about ``block_elements`` values, each block's logits up to its
    last query's own key (the later repeat tokens are masked for all its rows): every row's softmax and the max are
    the same numbers as over all queries at once, without the ``(B, Hq, q, sink + chunk + q)`` tensor (SmolLM2, a 2k
    chunk: 300 MB per layer, about 1 s per layer on 1 CPU thread; in blocks 0.17 s).
    """
    b, hq, q, d = queries.shape
    h = keys.shape[1]
    sink = min(n_sink, start)
    chunk = end - start
    keys = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -q:]], dim=2)
    keys_t = keys.transpose(-2, -1)
    g = hq // h
    grouped = queries.view(b, h, g, q, d)
    scores = torch.full((b, h, chunk), float("-inf"), dtype=queries.dtype, device=queries.device)
    rows = max(1, block_elements // (b * hq * keys.shape[2]))
    for first in range(0, q, rows):
        last = min(q, first + rows)
        # one (g * rows, D) x (D, T') product per KV head (a broadcast over g would copy the keys g times per block)
        block = grouped[:, :, :, first:last].reshape(b, h, g * (last - first), d)
        # the repeat tokens after the block's last query are masked for every row of it: left out of the softmax
        logits = torch.matmul(block, keys_t[..., : sink + chunk + last]).view(b, h, g, last - first, -1) * scaling
        causal = torch.arange(last, device=queries.device) > torch.arange(first, last, device=queries.device)[:, None]
        logits[..., sink + chunk :].masked_fill_(causal, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        torch.maximum(scores, probs[..., sink : sink + chunk].amax(dim=(-3, -2)), out=scores)
    return scores


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
