"""Local data for lm-eval tasks: the hub datasets' own files, or the upstream releases converted to their schema.

lm-eval loads ``load_dataset(dataset_path, dataset_name, **dataset_kwargs)``. With ``task.data_dir`` kvbench
overrides that to ``dataset_path: json|parquet``, ``dataset_name: null``, ``dataset_kwargs.data_files`` = the local
file of each split. Accepted files per split, first match wins (``FILES``):

* gsm8k (``openai/gsm8k`` main): ``test.jsonl`` / ``train.jsonl`` (openai/grade-school-math, the same rows and
  fields as the hub) or the hub's ``main/test-00000-of-00001.parquet``;
* coqa (``EleutherAI/coqa``): the Stanford release ``coqa-dev-v1.0.json`` / ``coqa-train-v1.0.json``, converted as
  the EleutherAI loading script did (``coqa.py``: ``questions``/``answers`` as columns of lists,
  ``additional_answers`` "0"/"1"/"2", empty placeholders on train), or the hub's ``coqa_validation.parquet``;
* truthfulqa_gen (``truthfulqa/truthful_qa`` generation): the upstream ``TruthfulQA.csv`` converted as the hub's
  loading script did (rows without correct or incorrect answers skipped, answers split on ";" and stripped), or
  ``generation/validation-*.parquet``;
* truthfulqa_mc1/mc2 (multiple_choice): upstream ``mc_task.json`` (``{choice: label}`` -> ``choices``/``labels``),
  or ``multiple_choice/validation-*.parquet``.

Every format is also accepted as JSON Lines in the hub schema (``<split>.jsonl``). Converted files are written once
to ``<kvbench cache>/data/lmeval/<task>/<sha of the source>/``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench import assets
from kvbench.errors import DataError

_ANSWER_KEYS = ("span_start", "span_end", "span_text", "input_text", "turn_id")


def _columns(items: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list]:
    return {key: [item[key] for item in items] for key in keys}


def coqa_rows(path: Path, split: str) -> list[dict[str, Any]]:
    """Stanford CoQA json -> EleutherAI/coqa rows (id, source, story, questions, answers, additional_answers)."""
    empty = {key: [-1] if key in ("span_start", "span_end", "turn_id") else [""] for key in _ANSWER_KEYS}
    rows = []
    for row in json.loads(path.read_text(encoding="utf-8"))["data"]:
        additional = ({k: dict(empty) for k in ("0", "1", "2")} if split == "train" else
                      {k: _columns(row["additional_answers"][k], _ANSWER_KEYS) for k in ("0", "1", "2")})
        rows.append({"id": row["id"], "source": row["source"], "story": row["story"],
                     "questions": _columns(row["questions"], ("input_text", "turn_id")),
                     "answers": _columns(row["answers"], _ANSWER_KEYS), "additional_answers": additional})
    return rows


def truthfulqa_generation_rows(path: Path, split: str) -> list[dict[str, Any]]:
    """TruthfulQA.csv -> truthfulqa/truthful_qa ``generation`` rows."""
    def answers(cell: str) -> list[str]:
        return [item.strip() for item in cell.strip().split(";")]

    with path.open(newline="", encoding="utf-8-sig") as handle:
        return [
            {"type": row["Type"], "category": row["Category"], "question": row["Question"],
             "best_answer": row["Best Answer"], "correct_answers": answers(row["Correct Answers"]),
             "incorrect_answers": answers(row["Incorrect Answers"]), "source": row["Source"]}
            for row in csv.DictReader(handle) if row["Correct Answers"] and row["Incorrect Answers"]
        ]


def truthfulqa_mc_rows(path: Path, split: str) -> list[dict[str, Any]]:
    """mc_task.json -> truthfulqa/truthful_qa ``multiple_choice`` rows."""
    def targets(mapping: dict[str, int]) -> dict[str, list]:
        return {"choices": list(mapping), "labels": list(mapping.values())}

    return [{"question": row["question"], "mc1_targets": targets(row["mc1_targets"]),
             "mc2_targets": targets(row["mc2_targets"])} for row in json.loads(path.read_text(encoding="utf-8"))]


Converter = Callable[[Path, str], list]
# lm-eval task -> split -> candidate files (glob patterns relative to data_dir) with a converter, or None when the
# file is already in the hub's schema.
FILES: dict[str, dict[str, list[tuple[str, Converter | None]]]] = {
    "gsm8k": {split: [(f"{split}.jsonl", None), (f"**/{split}-*.parquet", None)] for split in ("test", "train")},
    "coqa": {
        "validation": [("coqa-dev-v1.0.json", coqa_rows), ("coqa_validation.parquet", None),
                       ("**/validation-*.parquet", None), ("validation.jsonl", None)],
        "train": [("coqa-train-v1.0.json", coqa_rows), ("coqa_train.parquet", None),
                  ("**/train-*.parquet", None), ("train.jsonl", None)],
    },
    "truthfulqa_gen": {"validation": [("TruthfulQA.csv", truthfulqa_generation_rows),
                                      ("generation/validation-*.parquet", None),
                                      ("generation/validation.jsonl", None)]},
    "truthfulqa_mc": {"validation": [("mc_task.json", truthfulqa_mc_rows),
                                     ("multiple_choice/validation-*.parquet", None),
                                     ("multiple_choice/validation.jsonl", None)]},
}


def find_split(root: Path, candidates: list[tuple[str, Converter | None]]) -> tuple[list[Path], Converter | None]:
    for pattern, converter in candidates:
        matches = sorted(p for p in root.glob(pattern) if p.is_file())
        if matches:
            return matches, converter
    return [], None


def check_files(task: str, data_dir: str, files: str, splits: list[str]) -> Path:
    """``data_dir`` as a Path after checking it has a file for every split in ``splits`` (DataError otherwise)."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DataError(f"task {task!r}: data_dir={data_dir!r} is not a directory")
    missing = [split for split in splits if not find_split(root, FILES[files][split])[0]]
    if missing:
        wanted = "; ".join(f"{split}: " + " or ".join(p for p, _ in FILES[files][split]) for split in missing)
        raise DataError(f"task {task!r}: data_dir={str(root)!r} has no file for split(s) {', '.join(missing)} "
                        f"(expected {wanted})")
    return root


def dataset_override(task: str, data_dir: str, files: str, splits: list[str]) -> dict[str, Any]:
    """lm-eval config keys that load ``splits`` from the local files (converting upstream formats once)."""
    root = check_files(task, data_dir, files, splits)
    data_files, builders = {}, set()
    for split in splits:
        paths, converter = find_split(root, FILES[files][split])
        if converter is not None:
            paths = [_converted(task, files, split, paths[0], converter)]
        builders.add("parquet" if paths[0].suffix == ".parquet" else "json")
        data_files[split] = [str(p) for p in paths]
    if len(builders) > 1:
        raise DataError(f"task {task!r}: data_dir={str(root)!r} mixes parquet and JSON files across splits "
                        f"({data_files}); use one format")
    return {"dataset_path": builders.pop(), "dataset_name": None, "dataset_kwargs": {"data_files": data_files}}


def _converted(task: str, files: str, split: str, source: Path, converter: Converter) -> Path:
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = assets.cache_dir() / "data" / "lmeval" / files / digest / f"{split}.jsonl"
    if target.is_file():
        return target
    try:
        rows = converter(source, split)
    except (KeyError, TypeError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise DataError(f"task {task!r}: {source} is not in the expected format ({reason})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False, suffix=".tmp", encoding="utf-8") as tmp:
        tmp.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp.name, target)  # atomic: a concurrent job sees nothing or the whole file
    return target


__all__ = ["FILES", "check_files", "coqa_rows", "dataset_override", "truthfulqa_generation_rows",
           "truthfulqa_mc_rows"]
