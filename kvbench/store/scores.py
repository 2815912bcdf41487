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
        **sampled_scores(records, getattr(task, "score_scale", 1.0)),
    }


def sampled_scores(records: list[dict], scale: float = 1.0) -> dict[str, Any]:
    """A sampled job's scores (its records carry ``sample_of``; greedy jobs': none): ``pass@1`` the mean over prompts
    of the mean score of the prompt's samples (the mean over all records when every prompt has its n), ``maj@n`` the
    mean over prompts of the score of the prompt's most frequent ``answer_key`` (ties: the answer met first, in sample
    order; its first record's score), ``n_samples_per_prompt`` (the most any prompt has), ``new_tokens_mean`` (the
    mean output length, beside them: compression may lengthen outputs). ``scale``: the task's ``score_scale`` (100
    where per-sample scores are 0/1 and the task reports percent), so pass@1 and maj@n read on the score's scale."""
    if not records or not any("sample_of" in r for r in records):
        return {}
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(str(record.get("sample_of", record["id"])), []).append(record)
    pass1, majority = [], []
    for rows in groups.values():
        rows = sorted(rows, key=lambda r: r.get("sample_index", 0))
        pass1.append(sum(float(r["score"]) for r in rows) / len(rows))
        counts: dict[str, int] = {}
        first: dict[str, dict] = {}
        for r in rows:
            key = str(r.get("answer_key", r.get("prediction", "")))
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, r)
        top = max(counts.values())
        winner = next(key for key in first if counts[key] == top)  # dicts keep insertion order: the first met
        majority.append(float(first[winner]["score"]))
    return {
        "pass@1": round(scale * sum(pass1) / len(pass1), 4),
        "maj@n": round(scale * sum(majority) / len(majority), 4),
        "n_samples_per_prompt": max(len(rows) for rows in groups.values()),
        "n_prompts": len(groups),
        "new_tokens_mean": sum(float(r["new_tokens"]) for r in records) / len(records),
    }
