"""InfiniteBench scores from prediction records, as OpenBMB/InfiniteBench@88b3daa ``src/compute_scores.py``.

``score_records`` re-scores predictions from any harness; the task's ``aggregate`` uses the same ``summarize``, so
``python -m kvbench.score`` on a job's records reproduces its ``scores.json``. A record holds ``dataset`` (one of the
12 task names), ``prediction`` (the decoded generation, unmodified) and the label as ``label`` (the official
results files' name; kvbench jobs keep it in ``meta.label``) or ``answers``; the label is brought to its official
type by ``official_label`` (``answers: ["4"]`` of code_run becomes ``4``). longbook_choice_eng and code_debug need
``[answer, letter]`` or the answer plus ``options``.

Output: ``datasets`` {task: ``round(100 * mean, 2)``}, ``official_mean`` {task: the unrounded mean in [0, 1] that
``compute_scores.py`` prints}, ``counts``, ``n`` and ``score`` (plain mean over tasks of ``datasets``).
"""

from __future__ import annotations

import math
from typing import Any

from kvbench.errors import DataError
from kvbench.metrics.infinitebench import SCORERS, official_label, score_one
from kvbench.tasks.records import group_in_order, require, require_dataset, where

TASK_ORDER = list(SCORERS)


def summarize(scores: dict[str, list[float]]) -> dict[str, Any]:
    """Per-sample scores (0-1) grouped by task -> ``datasets`` (x100, 2 decimals), ``official_mean``, ``counts``,
    ``n`` and ``score``."""
    means = {d: sum(values) / len(values) for d, values in scores.items() if values}
    datasets = {d: round(100 * mean, 2) for d, mean in means.items()}
    return {
        "score": round(sum(datasets.values()) / len(datasets), 2) if datasets else math.nan,
        "n": sum(len(values) for values in scores.values()),
        "datasets": datasets,
        "official_mean": means,
        "counts": {d: len(values) for d, values in scores.items()},
    }


def record_label(record: dict[str, Any], index: int, dataset: str) -> Any:
    """The official label of a record: ``label`` if present, else ``answers`` (with ``options`` for the
    multiple-choice tasks)."""
    answer = record.get("label")
    if answer is None:
        answer = record.get("answers")
    if answer is None:
        raise DataError(f"{where(record, index)}: no 'answers' (or 'label') field")
    options = record.get("options")
    try:
        return official_label(dataset, answer, options)
    except DataError as exc:
        raise DataError(f"{where(record, index)}: {exc}") from None


def score_records(records: list[dict[str, Any]], math_calc_drop_first: bool = False) -> dict[str, Any]:
    """InfiniteBench scores of ``records``. ``math_calc_drop_first``: drop the first predicted number of math_calc,
    as ``compute_scores.py --model_name gpt4`` does (its default ``--model_name``; open models: false)."""
    if not records:
        raise DataError("no InfiniteBench records to score")
    scored: list[tuple[str, float]] = []
    for index, record in enumerate(records):
        dataset = require_dataset(record, index, TASK_ORDER, "InfiniteBench")
        prediction = require(record, index, "prediction", str)
        label = record_label(record, index, dataset)
        scored.append((dataset, score_one(dataset, prediction, label, math_calc_drop_first=math_calc_drop_first)))
    return summarize(group_in_order(scored, TASK_ORDER))


__all__ = ["TASK_ORDER", "record_label", "score_records", "summarize"]
