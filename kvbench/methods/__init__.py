"""KV-cache compression methods: one dataclass per file, registered here by config name."""

from __future__ import annotations

from typing import Any

from kvbench.budget import Budget
from kvbench.methods.base import DecodeContext, Method, PrefillContext
from kvbench.methods.catalog import METHODS, parse_method_name


def build_method(cfg: Any, budget: Budget) -> Method:
    """Method instance from the composed ``method`` config node (``name`` + fields), validated against ``budget``."""
    fields = {k: v for k, v in dict(cfg).items() if k != "name"}
    wrapper, name = parse_method_name(str(cfg["name"]))  # a stored composed name (adakv-snapkv): the wrapper
    method = METHODS.build(wrapper or name, fields)
    method.validate(budget)
    return method


__all__ = ["METHODS", "DecodeContext", "Method", "PrefillContext", "build_method", "parse_method_name"]
