"""Re-scoring predictions of the math tasks (``python -m kvbench.score --benchmark math500|aime24|aime25``).

Each record is scored with the task's default protocol (``think=after_close``, math-verify; ``grader.py``): its
``prediction`` (also read from ``output``, the field R-KV's and TriAttention's ``run_math.py`` / ``worker.py`` write,
or ``predicted_answer``, kvpress's column) against its ``answers`` (or ``answer``, the datasets' field); the aliases
are declared in ``task_spec.py``. A record's ``meta.think_opened`` (a kvbench ``samples.jsonl`` has it) says the
prompt opened ``<think>``. The score is the accuracy x 100 over all records: with several samples per problem as
separate records, the mean over samples, i.e. pass@1 (TriAttention's ``eval_math_multi.py`` column mean).
"""

from __future__ import annotations

from typing import Any

from kvbench.tasks.base import Sample


def score_task(task_name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"datasets": {task: accuracy x 100}, "counts": {task: n}, "score", "n"}`` for ``records``."""
    from kvbench.tasks import build_task

    task = build_task({"name": task_name})
    scored = []
    for record in records:
        answers = record["answers"] if isinstance(record["answers"], list) else [record["answers"]]
        meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
        sample = Sample(id=str(record.get("id", record.get("_line"))), prompt="", answers=[str(a) for a in answers],
                        meta={"think_opened": bool(meta.get("think_opened"))})
        scored.append({"id": sample.id, "score": task.score(record["prediction"], sample)})
    aggregate = task.aggregate(scored)
    return {"datasets": {task_name: aggregate["score"]}, "counts": {task_name: len(scored)}, **aggregate}


def math500(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_task("math500", records)


def aime24(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_task("aime24", records)


def aime25(records: list[dict[str, Any]]) -> dict[str, Any]:
    return score_task("aime25", records)


__all__ = ["aime24", "aime25", "math500", "score_task"]
