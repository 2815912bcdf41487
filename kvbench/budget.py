"""Typed KV budgets.

A budget says how many KV entries a method may keep *per layer and per head* after prefill:

* an integer ``128`` is **tokens per layer, observation window included**, the way PyramidKV, DynamicKV and
  D2O's Table 21 count "KV size";
* a float ``0.2`` strictly between 0 and 1 is a **ratio of the prompt length** (D2O's rho, KVMerger's 50 %):
  each sample keeps ``round(ratio * n)`` tokens per layer, where ``n`` is that sample's prompt length.

Methods with per-layer allocations (PyramidKV, DynamicKV, D2O) keep this number *on average over layers*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.errors import ConfigError


@dataclass(frozen=True)
class Budget:
    kind: str  # "tokens" | "ratio" | "full"
    value: float

    @classmethod
    def parse(cls, raw: object) -> Budget:
        """Parse the top-level ``budget`` config value; raises ConfigError naming the bad value."""
        if raw is None or (isinstance(raw, str) and raw.lower() in {"full", "none", "null"}):
            return cls("full", math.inf)
        if isinstance(raw, bool):
            raise ConfigError(f"budget={raw!r} is not a number; use tokens per layer (e.g. 128) or a ratio (e.g. 0.2)")
        if isinstance(raw, str):
            try:
                raw = float(raw) if any(c in raw for c in ".eE") else int(raw)
            except ValueError:
                raise ConfigError(
                    f"budget={raw!r} is not a number; use tokens per layer (e.g. 128) or a ratio in (0, 1) (e.g. 0.2)"
                ) from None
        if isinstance(raw, int):
            if raw <= 0:
                raise ConfigError(f"budget={raw} must be > 0 (tokens per layer, e.g. 128) or a ratio in (0, 1)")
            return cls("tokens", int(raw))
        if isinstance(raw, float):
            if math.isnan(raw) or raw <= 0:
                raise ConfigError(f"budget={raw} must be > 0: tokens per layer (e.g. 128) or a ratio in (0, 1)")
            if raw < 1:
                return cls("ratio", float(raw))
            raise ConfigError(
                f"budget={raw} is a ratio >= 1; a ratio of the prompt length must be in (0, 1) (e.g. 0.2), "
                "tokens per layer are written as an integer (e.g. 128)"
            )
        raise ConfigError(f"budget={raw!r} has type {type(raw).__name__}; use an int (tokens) or a float in (0, 1)")

    @property
    def is_full(self) -> bool:
        return self.kind == "full"

    def tokens_for(self, prompt_len: int) -> int:
        """Tokens per layer (average over layers) for a prompt of ``prompt_len`` tokens, never above the prompt."""
        if self.kind == "full":
            return prompt_len
        if self.kind == "ratio":
            return max(1, min(prompt_len, int(round(self.value * prompt_len))))
        return min(prompt_len, int(self.value))

    def label(self) -> str:
        """Short label used in result paths and tables: ``128``, ``0.2`` or ``full``."""
        if self.kind == "full":
            return "full"
        if self.kind == "ratio":
            return f"{self.value:g}"
        return str(int(self.value))
