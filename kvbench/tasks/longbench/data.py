"""LongBench data: the official raw files ``<dataset>.jsonl`` / ``<dataset>_e.jsonl`` of ``data.zip``.

The hub repository ``THUDM/LongBench`` is a loading script plus ``data.zip``; script datasets no longer load with
``datasets>=4`` (reference/benchmarks.md section 0, pitfall 5), so kvbench reads the jsonl files directly: from
``task.data_dir`` if set, else from ``<kvbench cache>/data/longbench``, where ``data.zip`` is downloaded once with
``huggingface_hub.hf_hub_download(repo_type="dataset")`` (hub cache, ``kvbench.hub.dataset_file``) and unpacked.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from kvbench import assets
from kvbench.errors import DataError
from kvbench.tasks.records import json_lines, utf8_lines

HUB_REPO = "THUDM/LongBench"
HUB_FILE = "data.zip"
REQUIRED_FIELDS = ("input", "context", "answers", "length", "_id")


def file_name(dataset: str, variant: str) -> str:
    """``narrativeqa.jsonl`` (LongBench) or ``qasper_e.jsonl`` (LongBench-E), as in the official data.zip."""
    return f"{dataset}_e.jsonl" if variant == "longbench_e" else f"{dataset}.jsonl"


def default_data_dir() -> Path:
    """Where the unpacked official files live when ``task.data_dir`` is null."""
    return assets.cache_dir() / "data" / "longbench"


def missing_files(directory: Path, names: list[str]) -> list[str]:
    return [name for name in names if not (directory / name).is_file()]


def check_data_dir(task: str, data_dir: str, names: list[str]) -> Path:
    """``data_dir`` as a Path after checking it is a directory holding every file in ``names`` (DataError naming
    the path and all missing files otherwise)."""
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"task {task!r}: data_dir={data_dir!r} is not a directory (it must hold the official "
                        f"LongBench files, e.g. {names[0]})")
    missing = missing_files(directory, names)
    if missing:
        raise DataError(f"task {task!r}: data_dir={str(directory)!r} has no {', '.join(missing)} "
                        f"(the official LongBench data.zip files)")
    return directory


def download_official(task: str, target: Path | None = None) -> Path:
    """Download ``data.zip`` from the hub dataset ``THUDM/LongBench`` (or take it from the hub cache) and unpack its
    jsonl files into ``target`` (default ``default_data_dir()``) once; returns ``target``. Any failure is one DataError
    line naming ``task.data_dir`` as the way out, at once where the hub cannot be reached (``kvbench.hub``)."""
    from kvbench.hub import dataset_file

    target = target or default_data_dir()
    archive = dataset_file(task, HUB_REPO, HUB_FILE, "unzip the official data.zip somewhere and set "
                           "task.data_dir=<directory with the .jsonl files>")
    _unpack(task, archive, target)
    return target


def _unpack(task: str, archive: Path, target: Path) -> None:
    """Extract ``archive`` next to ``target`` and move the folder holding its ``.jsonl`` files into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".longbench-") as tmp:
        try:
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        except (OSError, zipfile.BadZipFile) as exc:
            raise DataError(f"task {task!r}: cannot unpack {archive} ({exc}); set task.data_dir instead") from None
        folders = sorted({path.parent for path in Path(tmp).rglob("*.jsonl")})
        if not folders:
            raise DataError(f"task {task!r}: {archive} holds no .jsonl files; set task.data_dir instead")
        if target.exists():  # a concurrent job finished first
            return
        os.replace(folders[0], target)


def read_rows(path: Path, task: str) -> list[dict[str, Any]]:
    """The rows of one official jsonl file, checked for the fields kvbench uses."""
    rows = []
    where = f"task {task!r}: {path}"
    for number, row in json_lines(utf8_lines(path.read_bytes(), where), where):
        missing = [name for name in REQUIRED_FIELDS if name not in row]
        if missing or not isinstance(row.get("answers"), list):
            what = f"no field(s) {', '.join(missing)}" if missing else "'answers' is not a list"
            raise DataError(f"{where} line {number} has {what}")
        rows.append(row)
    if not rows:
        raise DataError(f"task {task!r}: {path} has no rows")
    return rows


__all__ = ["HUB_FILE", "HUB_REPO", "check_data_dir", "default_data_dir", "download_official", "file_name",
           "read_rows"]
