"""The part of a job's ``scores.json`` that follows from its records alone, in one place: the job runner writes it and
``python -m kvbench.store verify`` recomputes it from samples.jsonl to catch numbers edited by hand."""

from __future__ import annotations

from typing import Any


def record_scores(task: Any, records: list[dict]) -> dict[str, Any]:
    """The part of scores.json that follows from the records alone: the task's aggregate, the count and the efficiency
    means. ``python -m kvbench.store verify`` recomputes it from samples.jsonl, so it lives in one place."""

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in records) / len(records) if records else float("nan")

    new_tokens = sum(r["new_tokens"] for r in records)
    decode_steps = sum(r["decode_steps"] / r["batch_size"] for r in records)
    return {
        **task.aggregate(records),
        "n_samples": len(records),
        "resident_kv_bytes_mean": mean("resident_kv_bytes"),
        "prompt_tokens_mean": mean("prompt_tokens"),
        "prefill_seconds_mean": mean("prefill_seconds"),
        "decode_ms_per_token": (
            1000 * sum(r["decode_seconds"] for r in records) / decode_steps if decode_steps else None
        ),
        "new_tokens_total": new_tokens,
    }
