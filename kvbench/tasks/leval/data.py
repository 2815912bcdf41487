"""LEval data: the official ``<dataset>.jsonl`` files, one long document per line with its questions.

Each line is ``{"input": document, "instructions": [...], "outputs": [...], "evaluation": "exam" | "f1" | "rouge" |
"LLM" | "human", "source": ...}``. The same files are in the GitHub repository (``LEval-data/Closed-ended-tasks/``,
``LEval-data/Open-ended-tasks/``; codeU and narrative_qa are Git-LFS pointers there) and in the hub dataset
``L4NLP/LEval`` (``LEval/Exam/``, ``LEval/Generation/``), whose loading script no longer works with ``datasets>=4``
(reference/benchmarks.md section 0, pitfall 5). ``task.data_dir`` may hold the files flat or in either layout; with
``data_dir`` null each file is fetched with ``huggingface_hub.hf_hub_download(repo_type="dataset")`` into the hub cache
(once: a cached file is read without the network, ``kvbench.hub.dataset_file``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench.errors import DataError
from kvbench.hub import dataset_file

HUB_REPO = "L4NLP/LEval"


def candidates(data_dir: Path, dataset: str, group: str, layout: dict[str, dict[str, str]]) -> list[Path]:
    """Where ``<dataset>.jsonl`` may sit under ``data_dir``: flat, GitHub layout, hub layout (with or without the
    ``LEval/`` or ``LEval-data/`` top folder). ``group`` is "closed_ended" or "open_ended"."""
    name = f"{dataset}.jsonl"
    github, hub = layout["github_dirs"][group], layout["hub"][group]
    return [data_dir / name, data_dir / github / name, data_dir / "LEval-data" / github / name, data_dir / hub / name,
            data_dir / Path(hub).name / name]


def local_files(task: str, data_dir: str, datasets: dict[str, str], layout: dict[str, Any]) -> dict[str, Path]:
    """{dataset: file under ``data_dir``} for ``datasets`` ({dataset: group}); one DataError naming the directory and
    every missing file otherwise."""
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"task {task!r}: data_dir={data_dir!r} is not a directory (it must hold the official LEval "
                        f"files, e.g. {next(iter(datasets))}.jsonl)")
    found = {d: next((path for path in candidates(directory, d, group, layout) if path.is_file()), None)
             for d, group in datasets.items()}
    missing = [f"{d}.jsonl" for d, path in found.items() if path is None]
    if missing:
        raise DataError(f"task {task!r}: data_dir={str(directory)!r} has no {', '.join(missing)} (looked flat, in "
                        f"Closed-ended-tasks/ / Open-ended-tasks/ and LEval/Exam/ / LEval/Generation/)")
    return found  # type: ignore[return-value]


def hub_file(task: str, dataset: str, group: str, layout: dict[str, Any]) -> Path:
    """``<dataset>.jsonl`` from the hub dataset ``L4NLP/LEval`` (the hub cache first; ``kvbench.hub.dataset_file``);
    any failure is one DataError line naming ``task.data_dir`` as the way out, at once where the hub cannot be
    reached."""
    return dataset_file(task, HUB_REPO, f"{layout['hub'][group]}/{dataset}.jsonl",
                        "put the official LEval .jsonl files in a directory and set task.data_dir=<that directory>")


def read_documents(path: Path, task: str) -> list[dict[str, Any]]:
    """The lines of one official file, checked for the fields kvbench uses (``instructions`` and ``outputs`` are
    lists of strings of the same length)."""
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if line.startswith("version https://git-lfs"):
                raise DataError(f"task {task!r}: {path} is a Git-LFS pointer, not the data (git lfs pull, or use "
                                f"the hub copy)")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"task {task!r}: {path} line {number} is not JSON ({exc.msg})") from None
            problem = _problem(row)
            if problem:
                raise DataError(f"task {task!r}: {path} line {number} {problem}")
            rows.append(row)
    if not rows:
        raise DataError(f"task {task!r}: {path} has no documents")
    return rows


def _problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "is not a JSON object"
    missing = [k for k in ("input", "instructions", "outputs", "evaluation") if k not in row]
    if missing:
        return f"has no field(s) {', '.join(missing)}"
    lists = row["instructions"], row["outputs"]
    if not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in lists):
        return "has 'instructions'/'outputs' that are not lists of strings"
    if len(lists[0]) != len(lists[1]):
        return f"has {len(lists[0])} instructions but {len(lists[1])} outputs"
    if not isinstance(row["input"], str):
        return "has an 'input' that is not a string"
    return None


__all__ = ["HUB_REPO", "candidates", "hub_file", "local_files", "read_documents"]
