"""OmniKV's "filter" ability of a layer, from a stored inter-layer similarity (``<results>/analysis/*similarity*.json``
written by ``python -m kvbench.analysis.layer_similarity``). Reads data only: the measurement runs the model there."""

from __future__ import annotations

import torch


def filter_ability(sim: list[list[float]] | torch.Tensor, n: int) -> list[float | None]:
    """Mean similarity of each layer to its next ``n`` layers (None for the last layer)."""
    matrix = torch.as_tensor(sim, dtype=torch.float64)
    out: list[float | None] = []
    for i in range(matrix.shape[0]):
        following = matrix[i, i + 1 : i + 1 + n]
        out.append(float(following.mean()) if following.numel() else None)
    return out
