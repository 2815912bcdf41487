"""RULER scoring as ``scripts/eval/evaluate.py`` does it, for kvbench runs and for predictions from elsewhere.

``score_records`` is what ``python -m kvbench.score --benchmark ruler`` calls: records ``{"dataset", "prediction",
"answers"}`` (raw predictions; RULER's post-processing is applied here), dataset = a RULER task name. Per dataset
the official metric (``kvbench.metrics.ruler``) over its records in file order; ``average`` = the mean of the
dataset scores. Records that also carry a context length (``context_length``, ``length_bucket`` or
``max_seq_length``) are additionally scored per length, as RULER evaluates one folder per length.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.errors import DataError
from kvbench.metrics.ruler import SAMPLE_METRICS, dataset_score, postprocess_pred

_PROTOCOL = json.loads((Path(__file__).with_name("protocol.json")).read_text(encoding="utf-8"))
TASK_METRIC: dict[str, str] = {name: _PROTOCOL["metrics"][spec["task"]] for name, spec in _PROTOCOL["tasks"].items()}
_LENGTH_KEYS = ("context_length", "max_seq_length", "length_bucket")


def sample_score(dataset: str, prediction: str, answers: Sequence[str]) -> float:
    """The dataset's per-sample term (0-1) for an already post-processed prediction."""
    return SAMPLE_METRICS[TASK_METRIC[dataset]](prediction, answers)


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 2) if values else float("nan")


def _per_dataset(records: list[dict[str, Any]], order: Sequence[str]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for record in sorted(records, key=lambda r: (r["meta"]["context_length"], r["meta"]["index"])):
        groups.setdefault(record["meta"]["dataset"], []).append(float(record["score"]))
    rank = {name: i for i, name in enumerate(order)}
    return {d: dataset_score(groups[d]) for d in sorted(groups, key=lambda d: (rank.get(d, len(rank)), d))}


def aggregate_scores(records: list[dict[str, Any]], order: Sequence[str] = tuple(TASK_METRIC)) -> dict[str, Any]:
    """kvbench records (``score`` = per-sample term, ``meta`` with dataset / context_length / index) -> ``score``
    (mean over lengths of the per-length task averages), ``datasets``, ``lengths``, ``counts``."""
    by_length: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_length.setdefault(int(record["meta"]["context_length"]), []).append(record)
    lengths = {}
    for length in sorted(by_length):
        tasks = _per_dataset(by_length[length], order)
        lengths[str(length)] = {**tasks, "average": _mean(list(tasks.values()))}
    datasets = _per_dataset(records, order)
    counts: dict[str, int] = {}
    for record in records:
        counts[record["meta"]["dataset"]] = counts.get(record["meta"]["dataset"], 0) + 1
    return {
        "score": _mean([v["average"] for v in lengths.values()]),
        "n": len(records),
        "datasets": datasets,
        "average": _mean(list(datasets.values())),
        "lengths": lengths,
        "counts": {d: counts[d] for d in datasets},
    }


def score_records(records: list[dict]) -> dict:
    """Official RULER scores of ``{"dataset", "prediction", "answers"}`` records: ``{"datasets": {task: score},
    "average": mean}`` (+ ``"lengths"`` when records carry a context length). Scores x100, 2 decimals."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for number, record in enumerate(records, start=1):
        dataset = record.get("dataset")
        if dataset not in TASK_METRIC:
            raise DataError(f"ruler record {number}: dataset {dataset!r} is not a RULER task; valid: "
                            f"{', '.join(TASK_METRIC)}")
        answers = record.get("answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(answers, list) or not answers:
            raise DataError(f"ruler record {number} ({dataset}): 'answers' must be a non-empty list of strings")
        groups.setdefault(dataset, []).append({**record, "answers": [str(a) for a in answers]})
    datasets = {d: _official(rs) for d, rs in sorted(groups.items(), key=lambda kv: list(TASK_METRIC).index(kv[0]))}
    out: dict[str, Any] = {"datasets": datasets, "average": _mean(list(datasets.values()))}
    key = next((k for k in _LENGTH_KEYS if all(k in r for r in records)), None) if records else None
    if key is not None:
        lengths: dict[str, dict[str, float]] = {}
        for length in sorted({r[key] for r in records}, key=lambda v: (str(type(v)), v)):
            per = {d: _official([r for r in rs if r[key] == length]) for d, rs in groups.items()
                   if any(r[key] == length for r in rs)}
            lengths[str(length)] = {**per, "average": _mean(list(per.values()))}
        out["lengths"] = lengths
    return out


def _official(records: list[dict[str, Any]]) -> float:
    """``run_evaluation_per_task``: post-process every prediction, then the dataset's metric in file order."""
    metric = SAMPLE_METRICS[TASK_METRIC[records[0]["dataset"]]]
    return dataset_score([metric(postprocess_pred(str(r.get("prediction") or "")), r["answers"]) for r in records])


__all__ = ["TASK_METRIC", "aggregate_scores", "sample_score", "score_records"]
