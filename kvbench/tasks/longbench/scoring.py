"""LongBench / LongBench-E scores from prediction records, as THUDM/LongBench@2e00731 ``eval.py`` computes them.

``score_records`` (LongBench) and ``score_records_e`` (LongBench-E) re-score predictions from any harness; the task's
``aggregate`` uses the same ``summarize``, so ``python -m kvbench.score`` on a job's records reproduces its
``scores.json``. A record holds ``dataset``, ``prediction`` (as generated; the first-line rule of
trec/triviaqa/samsum/lsht is applied here, as ``eval.py`` does), ``answers`` (list of str), ``all_classes`` (trec,
lsht) and, for LongBench-E, ``length`` (the data's word/character count, not tokens). LongBench-E dataset names may
carry the ``_e`` suffix of their files.

Per sample: the dataset's metric, max over the answers (0-1). Per dataset: ``round(100 * mean, 2)``. Summaries:
``score`` (plain mean over datasets), ``categories`` and ``leaderboard_avg`` (the README's EN/ZH "Avg"),
LongBench-E ``buckets`` per dataset (``scorer_e``: 0-4k / 4-8k / 8k+) and ``bucket_avg``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvbench.errors import DataError
from kvbench.metrics.longbench import BUCKETS, best_score, bucket_scores, dataset_score, first_line
from kvbench.tasks.longbench.protocol import (
    CATEGORIES,
    CODE,
    DATASET2METRIC,
    DATASET2PROMPT,
    FIRST_LINE,
    LONGBENCH_E,
)
from kvbench.tasks.records import group_in_order, require, require_dataset, where

NEEDS_CLASSES = frozenset(d for d, metric in DATASET2METRIC.items() if metric == "classification_score")


def record_score(dataset: str, prediction: str, answers: Sequence[str],
                 all_classes: Sequence[str] | None = None) -> float:
    """``eval.py`` ``scorer`` for one sample: the first line for trec/triviaqa/samsum/lsht (idempotent, so a
    prediction already cut to its first line scores the same), then the max of the metric over the answers."""
    if dataset in FIRST_LINE:
        prediction = first_line(prediction)
    return best_score(DATASET2METRIC[dataset], prediction, answers, all_classes)


def summarize(scores: dict[str, list[float]], lengths: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Per-sample scores grouped by dataset -> ``datasets``, ``counts``, ``score``, ``categories``,
    ``leaderboard_avg``; with ``lengths`` (LongBench-E) also ``buckets`` and ``bucket_avg``."""
    datasets = {d: dataset_score(values) for d, values in scores.items()}
    categories = category_means(datasets)
    out: dict[str, Any] = {
        "score": mean2(datasets.values()),
        "n": sum(len(values) for values in scores.values()),
        "datasets": datasets,
        "counts": {d: len(values) for d, values in scores.items()},
        "categories": categories,
        "leaderboard_avg": {lang: mean2(cats.values()) for lang, cats in categories.items()},
    }
    if lengths is not None:
        buckets = {d: bucket_scores(values, lengths[d]) for d, values in scores.items()}
        out["buckets"] = buckets
        out["bucket_avg"] = {b: mean2(v[b] for v in buckets.values() if not math.isnan(v[b])) for b in BUCKETS}
    return out


def category_means(datasets: dict[str, float]) -> dict[str, dict[str, float]]:
    """{language: {category: mean of its datasets' scores}} over the datasets present, as the official README's
    EN and ZH tables (code counts in both). A language appears when one of its own (non-code) datasets is present;
    a run of code datasets only is reported under "en"."""
    present = set(datasets)
    languages = [lang for lang, cats in CATEGORIES.items()
                 if any(d in present and d not in CODE for ds in cats.values() for d in ds)]
    if not languages and present & CODE:
        languages = ["en"]
    out: dict[str, dict[str, float]] = {}
    for lang in languages:
        out[lang] = {cat: mean2(datasets[d] for d in ds if d in present)
                     for cat, ds in CATEGORIES[lang].items() if present & set(ds)}
    return out


def mean2(values: Iterable[float]) -> float:
    """Plain mean rounded to 2 decimals (nan when empty)."""
    values = list(values)
    return round(sum(values) / len(values), 2) if values else math.nan


def score_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """LongBench (any of the 21 datasets): ``{"datasets": {name: score}, "score", "categories", ...}``."""
    return _score(records, list(DATASET2PROMPT), "LongBench", with_lengths=False)


def score_records_e(records: list[dict[str, Any]]) -> dict[str, Any]:
    """LongBench-E (the 13 ``_e`` datasets): as ``score_records`` plus the ``length`` buckets."""
    return _score(records, LONGBENCH_E, "LongBench-E", with_lengths=True)


def _score(records: list[dict[str, Any]], valid: list[str], benchmark: str, with_lengths: bool) -> dict[str, Any]:
    if not records:
        raise DataError(f"no {benchmark} records to score")
    aliases = {f"{d}_e": d for d in LONGBENCH_E} if with_lengths else None
    scored: list[tuple[str, tuple[float, float]]] = []
    for index, record in enumerate(records):
        dataset = require_dataset(record, index, valid, benchmark, aliases)
        prediction = require(record, index, "prediction", str)
        answers = require(record, index, "answers", list)
        if not all(isinstance(a, str) for a in answers):
            raise DataError(f"{where(record, index)}: 'answers' must be a list of strings; got {answers!r:.80}")
        classes = require(record, index, "all_classes", list) if dataset in NEEDS_CLASSES else None
        length = float(require(record, index, "length", (int, float))) if with_lengths else math.nan
        try:
            value = record_score(dataset, prediction, answers, classes)
        except (IndexError, TypeError, ValueError) as exc:  # e.g. a retrieval answer without "Paragraph N"
            raise DataError(f"{where(record, index)}: cannot score {dataset}: {type(exc).__name__}: {exc}") from None
        scored.append((dataset, (value, length)))
    groups = group_in_order(scored, valid)
    scores = {d: [v for v, _ in pairs] for d, pairs in groups.items()}
    lengths = {d: [n for _, n in pairs] for d, pairs in groups.items()} if with_lengths else None
    return summarize(scores, lengths)


__all__ = ["category_means", "mean2", "record_score", "score_records", "score_records_e", "summarize"]
