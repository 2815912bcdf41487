"""KV-cache compression methods: one dataclass per file, registered here by config name."""

from __future__ import annotations

from typing import Any

from kvbench.budget import Budget, check_budget
from kvbench.methods.base import DecodeContext, Method, PrefillContext
from kvbench.methods.catalog import METHODS, parse_method_name


def build_method(cfg: Any, budget: Budget) -> Method:
    """Method instance from the composed ``method`` config node (``name`` + fields), validated against ``budget``."""
    fields = {k: v for k, v in dict(cfg).items() if k != "name"}
    wrapper, name = parse_method_name(str(cfg["name"]))  # a stored composed name (adakv-snapkv): the wrapper
    _check_decode_compression_field(wrapper or name, fields)
    method = METHODS.build(wrapper or name, fields)
    method.validate(budget)
    if budget.is_full:  # whether or not its validate checks the budget (one whose fields set what it keeps may not)
        check_budget(budget, method)
    return method


def _check_decode_compression_field(name: str, fields: dict) -> None:
    """``decode_compression`` on a method without it (no prefill score to compress with during decode): a null
    interval is no compression and is dropped; any other value is refused in one line naming the methods that have
    it."""
    import dataclasses

    from kvbench.errors import ConfigError

    if "decode_compression" not in fields:
        return
    cls = METHODS.get_class(name)
    if any(f.name == "decode_compression" for f in dataclasses.fields(cls)):
        return
    value = fields["decode_compression"]
    if value is None or (isinstance(value, dict) and value.get("interval") is None):
        del fields["decode_compression"]
        return
    have = [n for n in METHODS.names()
            if any(f.name == "decode_compression" for f in dataclasses.fields(METHODS.get_class(n)))]
    raise ConfigError(f"method {name!r} has no compression during decode (decode_compression needs a method with a "
                      f"prefill score); methods with it: {', '.join(have)}")


__all__ = ["METHODS", "DecodeContext", "Method", "PrefillContext", "build_method", "parse_method_name"]
