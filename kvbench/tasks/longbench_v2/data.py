"""LongBench v2 data: the hub dataset ``THUDM/LongBench-v2`` (split ``train``, as ``pred.py`` loads it), or a local
copy of its ``data.json`` (a JSON list, the file the official README links) or a JSON-lines file with the same fields:
``_id, domain, sub_domain, difficulty, length, question, choice_A, choice_B, choice_C, choice_D, answer, context``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.errors import DataError
from kvbench.tasks.longbench_v2.protocol import CHOICES, FIELDS, HUB_REPO, HUB_SPLIT
from kvbench.tasks.records import json_lines, utf8_lines


def check_row(row: Any, where: str) -> dict[str, Any]:
    """``row`` with every official field (strings; ``answer`` one of A-D), or one DataError naming what is wrong."""
    if not isinstance(row, dict):
        raise DataError(f"{where} is not a JSON object")
    missing = [name for name in FIELDS if name not in row]
    if missing:
        raise DataError(f"{where} has no field(s) {', '.join(missing)} (LongBench v2 rows have {', '.join(FIELDS)})")
    bad = [name for name in FIELDS if not isinstance(row[name], str)]
    if bad:
        raise DataError(f"{where}: field(s) {', '.join(bad)} must be strings")
    if row["answer"] not in CHOICES:
        raise DataError(f"{where}: answer must be one of A, B, C, D; got {row['answer']!r}")
    return {name: row[name] for name in FIELDS}


def read_file(path: str, task: str = "longbench_v2") -> list[dict[str, Any]]:
    """Rows of a local ``data.json`` (a JSON list) or ``.jsonl`` file, checked."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"task {task!r}: data_file={path!r} is not a file (the official data.json of the hub dataset "
                        f"{HUB_REPO}, or a .jsonl with its fields)")
    where = f"task {task!r}: {file}"
    data = file.read_bytes()
    if file.suffix == ".jsonl":
        rows = [check_row(row, f"{where} line {number}") for number, row in json_lines(utf8_lines(data, where), where)]
    else:
        try:
            loaded = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise DataError(f"{where} is not a JSON file ({type(exc).__name__}: {exc}); .jsonl files are read as "
                            "JSON lines") from None
        if not isinstance(loaded, list):
            raise DataError(f"{where} must hold a JSON list of rows (as data.json does); got {type(loaded).__name__}")
        rows = [check_row(row, f"{where} row {index}") for index, row in enumerate(loaded)]
    if not rows:
        raise DataError(f"{where} has no rows")
    return rows


def load_hub(task: str = "longbench_v2") -> list[dict[str, Any]]:
    """``load_dataset('THUDM/LongBench-v2', split='train')`` as ``pred.py`` does, as checked dicts; any failure is one
    DataError naming ``task.data_file`` as the way out."""
    from kvbench.hub import failure

    try:
        import datasets

        dataset = datasets.load_dataset(HUB_REPO, split=HUB_SPLIT)
    except Exception as exc:  # offline, missing extra, hub errors: all mean "use a local copy"
        raise DataError(
            f"task {task!r}: could not load the hub dataset {HUB_REPO} (split {HUB_SPLIT}) ({failure(exc)}); "
            f"download its data.json and set task.data_file=<path to data.json or a .jsonl>"
        ) from None
    return [check_row(dict(row), f"task {task!r}: {HUB_REPO} row {index}") for index, row in enumerate(dataset)]


__all__ = ["check_row", "load_hub", "read_file"]
