"""PyramidKV: SnapKV scoring with a per-layer budget that decreases linearly with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069), code Zefan-Cai/KVCache-Factory. reference/methods.md B5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.methods.base import PrefillContext, check_choice, check_positive
from kvbench.methods.snapkv import SnapKV

SCHEDULES = ("exact", "kvfactory")


def pyramid_capacity(capacity: int, n: int, window: int, beta: float, num_layers: int, schedule: str) -> list[int]:
    """Past-token budgets per layer (window excluded), from layer 0 (largest) to the last (smallest).

    min = (C - w) / beta, max = 2 (C - w) - min; if max >= n - w then max = n - w, min = 2 (C - w) - max.
    ``exact``: evenly spaced from max to min, rounded so the layers sum to exactly L (C - w) (resident bytes equal
    the budget's bytes). ``kvfactory``: the Jun-2024 code, ``max - l * ((max - min) // L)`` (integer steps; the
    layers then sum to more than L (C - w)).
    """
    base = capacity - window
    if n < capacity:
        return [n - window] * num_layers
    if n < 2 * base:  # KVCache-Factory: uniform when the pyramid would not fit
        return [base] * num_layers
    low = base / beta
    high = 2 * base - low
    if high >= n - window:
        high = n - window
        low = 2 * base - high
    if schedule == "kvfactory":
        low, high = int(low), int(high)
        steps = (high - low) // num_layers
        return [high - layer * steps for layer in range(num_layers)]
    if num_layers == 1:
        return [base]
    ideal = torch.linspace(high, low, num_layers, dtype=torch.float64)
    rounded = torch.floor(ideal).long()
    missing = base * num_layers - int(rounded.sum())
    order = torch.argsort(ideal - rounded, descending=True)  # largest remainders first
    rounded[order[:missing]] += 1
    return rounded.tolist()


@dataclass
class PyramidKV(SnapKV):
    """Prefill-only; layer l keeps ``pyramid_capacity(...)[l]`` tokens selected as SnapKV does, plus the window.

    Defaults are KVCache-Factory's LongBench settings: window 8, kernel 7, max-pool, beta 20. ``schedule="exact"``
    (default) makes the per-layer budgets average exactly the requested KV size; ``schedule="kvfactory"`` is the
    Jun-2024 integer-step code the PyramidKV/DynamicKV tables were produced with.
    """

    name: ClassVar[str] = "pyramidkv"
    window: int = 8
    kernel: int = 7
    beta: float = 20.0
    schedule: str = "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self.name, beta=self.beta)
        check_choice(self.name, "schedule", self.schedule, SCHEDULES)

    def layer_capacity(self, ctx: PrefillContext) -> torch.Tensor:
        """Tokens this layer keeps per row (window included)."""
        return torch.tensor(
            [
                self.window
                + pyramid_capacity(int(c), int(n), self.window, self.beta, ctx.num_layers, self.schedule)[
                    ctx.layer_idx
                ]
                for c, n in zip(ctx.capacity, ctx.prompt_lens)
            ],
            device=ctx.capacity.device,
        )
