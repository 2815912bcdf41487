"""Checks shared by the benchmarks' ``scoring.py`` modules, which re-score prediction records without a model.

A record is one prediction as a dict: ``dataset``, ``prediction``, ``answers`` and benchmark-specific fields.
``python -m kvbench.score`` adds ``_line`` (its line in the input file) so that messages name the line; records
built in Python are named by their position instead. Every problem is a ``DataError`` (one line, exit code 2).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvbench.errors import DataError


def where(record: dict[str, Any], index: int) -> str:
    """"line 7" (from the CLI) or "record 3" (1-based position in the list)."""
    line = record.get("_line")
    return f"line {line}" if line is not None else f"record {index + 1}"


def require(record: dict[str, Any], index: int, name: str, types: type | tuple[type, ...]) -> Any:
    """``record[name]``, checked to exist and to be of ``types`` (DataError naming the record otherwise)."""
    if name not in record or record[name] is None:
        raise DataError(f"{where(record, index)}: no {name!r} field")
    value = record[name]
    if not isinstance(value, types) or isinstance(value, bool):
        expected = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise DataError(f"{where(record, index)}: {name!r} must be {expected}; got {type(value).__name__}")
    return value


def require_dataset(record: dict[str, Any], index: int, valid: Iterable[str], benchmark: str,
                    aliases: dict[str, str] | None = None) -> str:
    """The record's ``dataset``, mapped through ``aliases``, checked to be one of ``valid``."""
    dataset = require(record, index, "dataset", str)
    dataset = (aliases or {}).get(dataset, dataset)
    valid = list(valid)
    if dataset not in valid:
        raise DataError(f"{where(record, index)}: unknown {benchmark} dataset {dataset!r}; valid: {', '.join(valid)}")
    return dataset


def group_in_order(items: Iterable[tuple[str, Any]], order: Iterable[str]) -> dict[str, list[Any]]:
    """``[(dataset, value), ...]`` -> ``{dataset: [values in input order]}``, datasets in ``order``."""
    groups: dict[str, list[Any]] = {}
    for dataset, value in items:
        groups.setdefault(dataset, []).append(value)
    rank = {d: i for i, d in enumerate(order)}
    return dict(sorted(groups.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


__all__ = ["group_in_order", "require", "require_dataset", "where"]
