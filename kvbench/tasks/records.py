"""Checks shared by the benchmarks' ``scoring.py`` modules, which re-score prediction records without a model.

A record is one prediction as a dict: ``dataset``, ``prediction``, ``answers`` and benchmark-specific fields.
``python -m kvbench.score`` adds ``_line`` (its line in the input file) so that messages name the line; records
built in Python are named by their position instead. Every problem is a ``DataError`` (one line, exit code 2).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
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


def utf8_lines(data: bytes, where: str) -> list[str]:
    """``data``'s lines (split where text mode splits them), each decoded as UTF-8 on its own, so that bytes that are
    not UTF-8 are one DataError naming ``where``, their line and their byte offset, not a traceback from deep inside
    a text reader."""
    lines, offset = [], 0
    for number, raw in enumerate(data.splitlines(keepends=True), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise DataError(f"{where} line {number} is not UTF-8 (byte offset {offset + exc.start} in the file: "
                            f"{exc.reason}, {raw[exc.start:exc.start + 4]!r}); re-encode the file as UTF-8") from None
        offset += len(raw)
    return lines


def json_lines(lines: Iterable[str], where: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a JSON-lines file; a line that is not JSON, or not a JSON
    object, is one DataError naming ``where`` and the line."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} line {number} is not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(value, dict):
            raise DataError(f"{where} line {number} is not a JSON object")
        yield number, value

