"""InfiniteBench data: the official raw files ``<task>.jsonl`` of the hub dataset ``xinrongzhang2022/InfiniteBench``.

Each line is one row with ``id``, ``context``, ``input``, ``answer`` and ``options`` (reference/benchmarks.md
section 2). The ``answer`` type varies by task (``["71432"]``, ``[4]``, ``[[1, 4, 8]]``, a bare string for
kv_retrieval), which is why ``datasets.load_dataset`` needs explicit features that turn every answer into strings;
kvbench reads the raw lines instead and keeps the types. Files come from ``task.data_dir`` if set (as upstream's
``scripts/download_dataset.sh`` saves them), else each is downloaded once with
``huggingface_hub.hf_hub_download(repo_type="dataset")`` into the hub cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbench.errors import DataError
from kvbench.hub import dataset_file
from kvbench.tasks.records import json_lines, utf8_lines

HUB_REPO = "xinrongzhang2022/InfiniteBench"
REQUIRED_FIELDS = ("context", "input", "answer")


def file_name(task: str) -> str:
    """``passkey.jsonl``, ..., as on the hub and in upstream ``eval_utils.DATA_NAME_TO_PATH``."""
    return f"{task}.jsonl"


def check_data_dir(task_name: str, data_dir: str, tasks: list[str]) -> Path:
    """``data_dir`` as a Path after checking it holds ``<task>.jsonl`` for every task (one DataError naming the
    directory and every missing file otherwise)."""
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"task {task_name!r}: data_dir={data_dir!r} is not a directory (it must hold the official "
                        f"InfiniteBench files, e.g. {file_name(tasks[0])})")
    missing = [file_name(t) for t in tasks if not (directory / file_name(t)).is_file()]
    if missing:
        raise DataError(f"task {task_name!r}: data_dir={str(directory)!r} has no {', '.join(missing)} "
                        f"(the official files of the hub dataset {HUB_REPO})")
    return directory


def download_official(task_name: str, task: str) -> Path:
    """Path of ``<task>.jsonl`` in the hub cache (looked up there first), else downloaded once
    (``kvbench.hub.dataset_file``). Any failure (offline, hub errors) is one DataError line naming ``task.data_dir`` as
    the way out, at once where the hub cannot be reached."""
    return dataset_file(task_name, HUB_REPO, file_name(task), "download the official files (InfiniteBench "
                        "scripts/download_dataset.sh) and set task.data_dir=<directory with the .jsonl files>")


def read_rows(path: Path, task_name: str, needs_options: bool = False) -> list[dict[str, Any]]:
    """The rows of one official jsonl file, checked for the fields the prompt and the label need."""
    rows = []
    where = f"task {task_name!r}: {path}"
    for number, row in json_lines(utf8_lines(path.read_bytes(), where), where):
        missing = [name for name in REQUIRED_FIELDS if name not in row]
        if missing:
            raise DataError(f"{where} line {number} has no field(s) {', '.join(missing)}")
        options = row.get("options")
        if needs_options and not (isinstance(options, list) and len(options) >= 4):
            raise DataError(f"{where} line {number} needs 4 'options'; got {options!r:.120}")
        row["_line"] = number
        rows.append(row)
    if not rows:
        raise DataError(f"task {task_name!r}: {path} has no rows")
    return rows


__all__ = ["HUB_REPO", "check_data_dir", "download_official", "file_name", "read_rows"]
