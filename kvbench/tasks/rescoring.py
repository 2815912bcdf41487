"""Re-scoring predictions of kvbench's generated tasks (``python -m kvbench.score --benchmark needle|...``).

The needle protocols, passkey and 2StageRetr have no official scorer beyond the metric each task implements, so
re-scoring builds the task with its default protocol and runs the task's own ``score`` on every record and its own
``aggregate`` on the result: the numbers are the ones a kvbench job writes into ``scores.json`` (tested against real
jobs). Records need ``prediction`` and ``answers``; the needle and passkey grids need each record's
``context_length`` and ``depth`` (top-level or in ``meta``, as a kvbench ``samples.jsonl`` stores them), 2StageRetr
its ``dict_len`` (each task's ``Rescorer.cell_fields`` in its ``task_spec.py``).
"""

from __future__ import annotations

from typing import Any

from kvbench.errors import DataError
from kvbench.tasks.base import Sample


def cell_fields() -> dict[str, tuple[str, ...]]:
    """``{task: the fields each record needs}``, from the tasks' declarations (``Rescorer.cell_fields`` in their
    ``task_spec.py``); also ``CELL_FIELDS``."""
    from kvbench.tasks import spec

    return {name: r.cell_fields for name, r in spec.rescorers().items() if r.cell_fields}


def __getattr__(name: str) -> Any:
    if name == "CELL_FIELDS":
        return cell_fields()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def score_with_task(task_name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"datasets": {task: score}, **task.aggregate(...)}`` for records scored with the task's own ``score``."""
    from kvbench.tasks import build_task

    task = build_task({"name": task_name})
    fields = cell_fields()[task_name]
    scored = []
    for record in records:
        meta = dict(record.get("meta") or {})
        for name in fields:
            if meta.get(name) is None and record.get(name) is not None:
                meta[name] = record[name]
            if meta.get(name) is None:
                raise DataError(f"line {record.get('_line', '?')} has no '{name}' (top-level or in meta); "
                                f"{task_name} scores are per {' x '.join(fields)}")
        answers = record["answers"] if isinstance(record["answers"], list) else [record["answers"]]
        sample = Sample(id=str(record.get("id", record.get("_line"))), prompt="", answers=[str(a) for a in answers],
                        meta=meta)
        scored.append({"id": sample.id, "score": task.score(record["prediction"], sample), "meta": meta})
    aggregate = task.aggregate(scored)
    return {"datasets": {task_name: aggregate["score"]}, "counts": {task_name: len(scored)}, **aggregate}


def needle(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_with_task("needle", records)


def needle_retrieval_head(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_with_task("needle_retrieval_head", records)


def needle_kvpress(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_with_task("needle_kvpress", records)


def passkey(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_with_task("passkey", records)


def twostage_retr(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_with_task("2stageretr", records)


__all__ = ["cell_fields", "needle", "needle_kvpress", "needle_retrieval_head", "passkey", "score_with_task",
           "twostage_retr"]  # and CELL_FIELDS (module __getattr__)
