"""ZeroSCROLLS data: the validation split of the official per-task zips (``<dataset>.zip``, member
``<dataset>/validation.jsonl``).

Only the validation split (about 20 examples per task) has labels; test outputs are hidden and scored by the
leaderboard server. A row is ``{"id", "pid", "input", "output", "document_start_index", "document_end_index",
"query_start_index", "query_end_index", "truncation_seperator"}`` (sic); an example with several references
(Qasper, NarrativeQA, SQuALITY) appears once per reference with the same ``id`` (SCROLLS' ``drop_duplicates_in_input``
merges them). The hub's ``tau/zero_scrolls`` loading script does not run with ``datasets>=4`` (reference/benchmarks.md
section 0, pitfall 5), so kvbench reads the zips: from ``task.data_dir`` (``<dataset>/validation.jsonl`` unpacked, or
``<dataset>.zip``), else ``hf_hub_download(repo_type="dataset")`` of ``<dataset>.zip`` into the hub cache.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from kvbench.errors import DataError
from kvbench.hub import dataset_file
from kvbench.tasks.records import json_lines, utf8_lines

HUB_REPO = "tau/zero_scrolls"
SPLIT_FILE = "validation.jsonl"
FIELDS = ("id", "input", "output", "document_start_index", "document_end_index", "query_start_index",
          "query_end_index", "truncation_seperator")


def local_source(task: str, data_dir: str, dataset: str) -> Path:
    """``<data_dir>/<dataset>/validation.jsonl`` or ``<data_dir>/<dataset>.zip`` (DataError naming both)."""
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"task {task!r}: data_dir={data_dir!r} is not a directory (it must hold the official "
                        f"ZeroSCROLLS files, e.g. {dataset}/{SPLIT_FILE} or {dataset}.zip)")
    for path in (directory / dataset / SPLIT_FILE, directory / f"{dataset}.zip"):
        if path.is_file():
            return path
    raise DataError(f"task {task!r}: data_dir={str(directory)!r} has neither {dataset}/{SPLIT_FILE} nor {dataset}.zip")


def hub_source(task: str, dataset: str) -> Path:
    """``<dataset>.zip`` of the hub dataset ``tau/zero_scrolls`` (the hub cache first; ``kvbench.hub.dataset_file``);
    any failure is one DataError line naming ``task.data_dir``, at once where the hub cannot be reached."""
    return dataset_file(task, HUB_REPO, f"{dataset}.zip", "put the official zips (or their unpacked folders) in a "
                        "directory and set task.data_dir=<that directory>")


def _lines(path: Path, task: str) -> list[str]:
    where = f"task {task!r}: {path}"
    if path.suffix != ".zip":
        return utf8_lines(path.read_bytes(), where)
    try:
        with zipfile.ZipFile(path) as zf:
            members = [n for n in zf.namelist() if n.rsplit("/", 1)[-1] == SPLIT_FILE]
            if not members:
                raise DataError(f"{where} has no {SPLIT_FILE}")
            return utf8_lines(zf.read(sorted(members, key=len)[0]), where)
    except (OSError, zipfile.BadZipFile) as exc:
        raise DataError(f"task {task!r}: cannot read {path} ({exc}); set task.data_dir to the unpacked files") from None


def read_examples(path: Path, task: str) -> list[tuple[dict[str, Any], list[str]]]:
    """(first row, references) per ``id`` in file order; the references are the ``output`` of every row with
    that id. DataError for malformed rows or unlabeled (test) data."""
    examples: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for number, row in json_lines(_lines(path, task), f"task {task!r}: {path}"):
        missing = [k for k in FIELDS if k not in row]
        if missing:
            raise DataError(f"task {task!r}: {path} line {number} has no field(s) {', '.join(missing)}")
        if not isinstance(row["output"], str):
            raise DataError(f"task {task!r}: {path} line {number} has no reference output (the test split is "
                            f"unlabeled; kvbench scores the validation split)")
        if row["id"] in examples:
            examples[row["id"]][1].append(row["output"])
        else:
            examples[row["id"]] = (row, [row["output"]])
    if not examples:
        raise DataError(f"task {task!r}: {path} has no examples")
    return list(examples.values())


__all__ = ["HUB_REPO", "SPLIT_FILE", "hub_source", "local_source", "read_examples"]
