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
    check_field_types(cls, fields, what)
    try:
        return cls(**fields)
    except TypeError as exc:  # a missing required field
        raise ConfigError(f"{what}: {exc}") from None


# ---- field types -----------------------------------------------------------------------------------------------------
_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_field_types(cls: type, fields: dict[str, Any], what: str) -> None:
    """Refuse a config value whose type the dataclass field does not take, naming the field and its type:
    ``method 'snapkv': window='abc' must be an integer (window: int)``. An int field refuses a float (``window=1.5``
    would run and fail on every sample), a float field takes an int. Annotations this cannot read (a class, a
    forward reference, ``Any``) are left to the dataclass's own ``validate``."""
    hints = _field_hints(cls)
    for name, value in fields.items():
        hint = hints.get(name)
        if hint is None or _accepts(hint, value):
            continue
        wanted = _describe(hint)
        shown = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        raise ConfigError(f"{what}: {name}={value!r} must be {wanted} ({name}: {shown})")


def _field_hints(cls: type) -> dict[str, Any]:
    import sys
    import typing

    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that names a type only imported for checking: one at a time
        pass
    hints, namespace = {}, vars(sys.modules.get(cls.__module__, typing))
    for f in dataclasses.fields(cls):
        try:
            hints[f.name] = eval(f.type, namespace) if isinstance(f.type, str) else f.type  # noqa: S307
        except Exception:  # noqa: BLE001 - unreadable here: not checked
            continue
    return hints


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` (a plain config value) fits ``hint``; True for anything this does not understand."""
    import types
    import typing

    origin = typing.get_origin(hint)
    if hint is typing.Any or isinstance(hint, typing.TypeVar):
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True  # a class of its own (Budget, a tensor): the dataclass checks it


def _describe(hint: Any) -> str:
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(arg) for arg in typing.get_args(hint)]
        return " or ".join(dict.fromkeys(parts))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin in (list, tuple) or hint in (list, tuple):
        return "a list"
    if origin is dict or hint is dict:
        return "a mapping"
    return _SCALARS.get(hint, getattr(hint, "__name__", str(hint)))
