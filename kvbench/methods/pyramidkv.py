"""PyramidKV: SnapKV scoring with a per-layer budget that decreases linearly with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069), code Zefan-Cai/KVCache-Factory. reference/methods.md B5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError
from kvbench.methods.base import PrefillContext, check_choice, check_positive
from kvbench.methods.snapkv import SnapKV

#: ``exact``: kvbench's own reading (layers average exactly the budget); the others are KVCache-Factory's
#: ``PyramidKVCluster`` arithmetic, named by the period of the code: the step divisor is L from fcaa093/57e1c26
#: (2024-06-25) and L - 1 from 5a1f543 (2024-09-30) on (the code at c97f9d7, 2026-07, still divides by L - 1)
SCHEDULES = ("exact", "kvfactory_2406", "kvfactory_2409")
STEP_DIVISOR = {"kvfactory_2406": 0, "kvfactory_2409": 1}  # L minus this


def pyramid_capacity(capacity: int, n: int, window: int, beta: float, num_layers: int, schedule: str) -> list[int]:
    """Past-token budgets per layer (window excluded), from layer 0 (largest) to the last (smallest).

    n < C: no compression (n - w each); n < 2 (C - w): uniform C - w (KVCache-Factory's cases). Otherwise, with
    b = C - w:

    * ``kvfactory_2406`` / ``kvfactory_2409``: KVCache-Factory's integer arithmetic, ``min = b // beta``,
      ``max = 2 b - min``; if ``max >= n - w``: ``max = n - w``, ``min = 2 b - max``; layer l keeps
      ``max - l * ((max - min) // D)`` with D = L (2024-06) or L - 1 (since 2024-09-30). The layers then sum to more
      than L b (the code's resident bytes exceed the budget's);
    * ``exact``: kvbench's own reading, not any version of the code: the same max and min in real numbers
      (``min = b / beta``), evenly spaced from max to min and rounded (largest remainders) so the layers sum to
      exactly L b (resident bytes equal the budget's).
    """
    base = capacity - window
    if n < capacity:
        return [n - window] * num_layers
    if n < 2 * base:  # KVCache-Factory: uniform when the pyramid would not fit
        return [base] * num_layers
    if schedule in STEP_DIVISOR:
        low = int(base // beta)
        high = 2 * base - low
        if high >= n - window:
            high = n - window
            low = 2 * base - high
        steps = (high - low) // max(1, num_layers - STEP_DIVISOR[schedule])  # (one layer: the code divides by 0)
        return [high - layer * steps for layer in range(num_layers)]
    low = base / beta
    high = 2 * base - low
    if high >= n - window:
        high = n - window
        low = 2 * base - high
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
    (default) is kvbench's reading: per-layer budgets that average exactly the requested KV size.
    ``schedule="kvfactory_2406"`` / ``"kvfactory_2409"`` are KVCache-Factory's integer schedule as its code computed it
    from 2024-06-25 (step divisor L) and from 2024-09-30 on (L - 1); see ``pyramid_capacity``.
    """

    name: ClassVar[str] = "pyramidkv"
    compression: ClassVar[str] = "prefill"
    window: int = 8
    kernel: int = 7
    beta: float = 20.0
    schedule: str = "exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self.name, beta=self.beta)
        if self.schedule == "kvfactory":
            raise ConfigError("method 'pyramidkv': schedule='kvfactory' was ambiguous and is gone: the code divides "
                              "the steps by L until 2024-09-30 (schedule=kvfactory_2406) and by L - 1 since "
                              "(schedule=kvfactory_2409); docs/baseline_readings.md says which table used which")
        check_choice(self.name, "schedule", self.schedule, SCHEDULES)

    def _entries(self, capacity: int, n: int, num_layers: int) -> list[int]:
        """Tokens each layer keeps of a prompt of ``n`` tokens under ``capacity`` per layer (window included)."""
        return [self.window + c for c in pyramid_capacity(capacity, n, self.window, self.beta, num_layers,
                                                          self.schedule)]

    def prompt_entries(self, budget: Budget, prompt_len: int, num_layers: int) -> list[int]:
        return self._entries(budget.tokens_for(prompt_len), prompt_len, num_layers)

    def layer_capacity(self, ctx: PrefillContext) -> list[int]:
        """Tokens this layer keeps per row (window included), host ints (the pyramid is host arithmetic: no read)."""
        return [self._entries(int(c), int(n), ctx.num_layers)[ctx.layer_idx] for n, c in zip(*ctx.host_ints())]
