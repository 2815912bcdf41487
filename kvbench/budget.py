"""Typed KV budgets.

A budget says how many KV entries a method may keep *per layer and per head* after prefill:

* an integer ``128`` is **tokens per layer, observation window included**, the way PyramidKV, DynamicKV and
  D2O's Table 21 count "KV size";
* a float ``0.2`` strictly between 0 and 1 is a **ratio of the prompt length** (D2O's rho, KVMerger's 50 %):
  each sample keeps ``round(ratio * n)`` tokens per layer, where ``n`` is that sample's prompt length.

Methods with per-layer allocations (PyramidKV, DynamicKV, D2O) keep this number *on average over layers*.

A budget is parsed once, at the edge, by ``parse_budget`` (the command line's check, the job plan, the sweep plan, the
bench's grids and its probe's request all call it, so the accepted forms and the wording cannot drift), and passed as
this typed value from there on: nothing below the plan reads a raw budget. Its checks against a method (the
method's minimum: SnapKV's window, StreamingLLM's sinks) are ``check_budget``'s alone: the plan calls it before any
model loads, the session calls it again on each prompt (a ratio resolves per prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.errors import ConfigError

#: the forms a budget may take, named by every refusal of a malformed one
VALID_FORMS = ("valid: tokens per layer as an integer >= 1 (e.g. 128), a ratio of the prompt length in (0, 1) "
               "(e.g. 0.2), or full")


@dataclass(frozen=True)
class Budget:
    kind: str  # "tokens" | "ratio" | "full"
    value: float

    @classmethod
    def parse(cls, raw: object) -> Budget:
        """Parse the top-level ``budget`` config value; raises ConfigError naming the bad value and the valid forms.
        Callers outside this module use ``parse_budget`` (the edge)."""
        if raw is None or (isinstance(raw, str) and raw.lower() in {"full", "none", "null"}):
            return cls.full()
        if isinstance(raw, bool):
            raise ConfigError(f"budget={raw!r} is not a number; {VALID_FORMS}")
        if isinstance(raw, str):
            try:
                raw = float(raw) if any(c in raw for c in ".eE") else int(raw)
            except ValueError:
                raise ConfigError(f"budget={raw!r} is not a number; {VALID_FORMS}") from None
        if isinstance(raw, int):
            if raw <= 0:
                raise ConfigError(f"budget={raw} must be > 0; {VALID_FORMS}")
            return cls("tokens", int(raw))
        if isinstance(raw, float):
            if math.isnan(raw) or raw <= 0:
                raise ConfigError(f"budget={raw} must be > 0; {VALID_FORMS}")
            if raw < 1:
                return cls("ratio", float(raw))
            raise ConfigError(f"budget={raw} is a ratio >= 1 (tokens per layer are written as an integer); "
                              f"{VALID_FORMS}")
        raise ConfigError(f"budget={raw!r} has type {type(raw).__name__}; {VALID_FORMS}")

    @classmethod
    def full(cls) -> Budget:
        """Keep everything (FullKV's budget, and what ``budget=null`` / ``full`` parses to)."""
        return cls("full", math.inf)

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


def parse_budget(raw: object, method: str | None = None) -> Budget:
    """The one parse of a budget as written (a config's or the command line's ``budget``, a bench grid's entry, a
    stored label): ``Budget.parse``'s forms and messages (ConfigError naming the value and the valid forms). The
    ``method`` named ``fullkv`` keeps everything: its budget is full whatever was written (a malformed value is still
    refused, the same way for every method)."""
    budget = Budget.parse(raw)
    return Budget.full() if method == "fullkv" else budget


def check_budget(budget: Budget, method: object, prompt_len: int | None = None, where: str = "") -> None:
    """Every check of a parsed ``budget`` against a ``method`` (anything with ``name``, ``min_budget_tokens()`` and
    ``min_budget_reason()``), in one place; raises ConfigError in one line.

    * ``full`` passes, except for a method that does not use the budget (its own fields set what it keeps, and its
      results are filed under their label, ``budget_label``: POD's window, PyramidInfer's paper sizes, InfLLM's
      explicit sizes, CLA's sharing factor, the offload baseline): a full budget switches every method off (what
      ``full`` means: keep everything, FullKV), which would file FullKV's numbers under such a method's label;
    * a token budget below ``method.min_budget_tokens()`` (SnapKV's observation window + 1, StreamingLLM's sinks + 1)
      is refused whatever the prompt;
    * a ratio resolves per prompt: with ``prompt_len`` it is refused when it would compress that prompt below the
      minimum (``where`` names the prompt: ``for a prompt of 200 tokens``); a prompt the ratio holds whole is fine,
      however short. Without ``prompt_len`` a ratio passes (its range, (0, 1), is ``Budget.parse``'s).
    """
    if budget.is_full:
        label = getattr(method, "budget_label", None)
        own = label(budget) if label is not None and method.name != "fullkv" else None
        if own is not None:
            raise ConfigError(
                f"budget=full switches method {method.name!r} off (full keeps everything: FullKV), but this method "
                f"does not use the budget (its fields set what it keeps; results filed as {own!r}): give any budget, "
                f"e.g. budget=128 (unused), or method=fullkv"
            )
        return
    minimum = method.min_budget_tokens()
    if budget.kind == "tokens":
        if budget.value < minimum:
            raise ConfigError(f"budget={budget.label()} is below the minimum {minimum} tokens per layer of method "
                              f"{method.name!r} ({method.min_budget_reason()})")
        return
    if prompt_len is None:
        return
    tokens = budget.tokens_for(prompt_len)
    if tokens < minimum and tokens < prompt_len:
        raise ConfigError(
            f"budget={budget.label()} resolves to {tokens} token{'s' * (tokens != 1)} per layer {where}, below the "
            f"minimum {minimum} tokens per layer of method {method.name!r} ({method.min_budget_reason()})"
        )
