"""KV-cache compression methods: one dataclass per file, registered here by config name."""

from __future__ import annotations

from typing import Any

from kvbench.budget import Budget
from kvbench.methods.base import DecodeContext, Method, PrefillContext
from kvbench.methods.catalog import METHODS, WRAPPERS


def build_method(cfg: Any, budget: Budget) -> Method:
    """Method instance from the composed ``method`` config node (``name`` + fields), validated against ``budget``."""
    fields = {k: v for k, v in dict(cfg).items() if k != "name"}
    name = str(cfg["name"])
    if name not in METHODS.entries and name.partition("-")[0] in WRAPPERS:  # a stored composed name: adakv-snapkv
        name = name.partition("-")[0]
    method = METHODS.build(name, fields)
    method.validate(budget)
    return method


__all__ = ["METHODS", "DecodeContext", "Method", "PrefillContext", "build_method"]
