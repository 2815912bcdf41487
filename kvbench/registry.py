"""Name -> class registries for methods and tasks, with lazy imports and clear errors."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from kvbench.errors import ConfigError, NotAvailableError, invalid_choice


class Registry:
    """Maps a config ``name`` to ``"module:Class"``; names that are configured but not implemented map to a reason.

    ``pending`` entries exist so that ``method=dynamickv`` composes before its implementation lands and then fails
    with a one-line message saying what is missing, instead of a traceback.
    """

    def __init__(self, kind: str, entries: dict[str, str], pending: dict[str, str] | None = None):
        self.kind = kind
        self.entries = dict(entries)
        self.pending = dict(pending or {})

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get_class(self, name: str) -> type:
        if name in self.entries:
            module_name, _, attr = self.entries[name].partition(":")
            return getattr(importlib.import_module(module_name), attr)
        if name in self.pending:
            raise NotAvailableError(
                f"{self.kind} {name!r} is configured but not implemented yet ({self.pending[name]}); "
                f"implemented {self.kind}s: {', '.join(self.names())}"
            )
        raise invalid_choice(self.kind, name, list(self.entries) + list(self.pending))

    def build(self, name: str, fields: dict[str, Any]) -> Any:
        """Instantiate the dataclass registered as ``name`` from config fields, rejecting unknown fields."""
        cls = self.get_class(name)
        return build_dataclass(cls, fields, f"{self.kind} {name!r}")


def build_dataclass(cls: type, fields: dict[str, Any], what: str) -> Any:
    valid = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(fields) - valid)
    if unknown:
        raise ConfigError(f"{what} has no field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(valid))}")
    try:
        return cls(**fields)
    except TypeError as exc:  # a missing required field
        raise ConfigError(f"{what}: {exc}") from None
