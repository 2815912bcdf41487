"""ZeroSCROLLS scores from prediction records (paper section 3.3; metrics in ``kvbench.metrics.zeroscrolls``).

``score_records(records)`` takes ``{"dataset", "prediction", "answers", ...}`` dicts (kvbench's records, or another
harness's through ``python -m kvbench.score --benchmark zeroscrolls``) and returns ``{"datasets": {name: score},
"score": ..., ...}``. Per dataset ``100 * mean`` over examples, rounded to 4 decimals (SCROLLS' metric rounding):

* rouge (gov_report, summ_screen_fd, qmsum, squality): per ROUGE type the max over references, then the geometric
  mean of ROUGE-1/2/L. ``rouge_aggregation="instance"`` (default, the paper: "for each instance ... combined into a
  single score by computing their geometric mean") averages the per-example geometric means; ``"corpus"`` (the
  SCROLLS metric code) takes the geometric mean of the three dataset means.
* f1 (qasper, narrative_qa, musique), accuracy (quality), exponential similarity (space_digest), concordance index
  (book_sum_sort): the max over references.

``score`` is the plain mean over the datasets present (the leaderboard's "Avg" over the 10 tasks; KVMerger Table 6's
average over its 7).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError, DataError
from kvbench.metrics import zeroscrolls as m

PROTOCOL: dict[str, Any] = json.loads(Path(__file__).with_name("prompts.json").read_text(encoding="utf-8"))
DATASETS: list[str] = PROTOCOL["datasets"]
DATASET2METRIC: dict[str, str] = PROTOCOL["dataset2metric"]
ROUGE_AGGREGATIONS = ("instance", "corpus")
_ES = PROTOCOL["exp_similarity"]
SCORERS = {
    "f1": m.f1_score,
    "accuracy": m.accuracy_score,
    "exp_similarity": lambda pred, gold: m.exp_similarity_score(pred, gold, _ES["base"], _ES["scale"]),
    "concordance_index": m.concordance_index_score,
}


def best_rouge(prediction: str, answers: list[str]) -> dict[str, float]:
    """Per ROUGE type the max over the references (0-1)."""
    per_answer = [m.rouge_scores(prediction, answer) for answer in answers]
    return {key: max(s[key] for s in per_answer) for key in m.ROUGE_TYPES}


def geometric_mean(scores: dict[str, float]) -> float:
    return (scores["rouge1"] * scores["rouge2"] * scores["rougeL"]) ** (1 / 3)


def example_score(dataset: str, prediction: str, answers: list[str]) -> float:
    """One example's score (0-1): the dataset's metric, max over ``answers`` (rouge: the per-example geometric
    mean of the per-type maxima)."""
    metric = DATASET2METRIC[dataset]
    if metric == "rouge":
        return geometric_mean(best_rouge(prediction, answers))
    return max(SCORERS[metric](prediction, answer) for answer in answers)


def dataset_score(dataset: str, records: list[dict[str, Any]], rouge_aggregation: str = "instance") -> float:
    """``round(100 * mean, 4)`` of the examples; rouge per ``rouge_aggregation``."""
    if DATASET2METRIC[dataset] == "rouge" and rouge_aggregation == "corpus":
        rows = [best_rouge(r["prediction"], r["answers"]) for r in records]
        return round(100 * geometric_mean({k: sum(row[k] for row in rows) / len(rows) for k in m.ROUGE_TYPES}), 4)
    scores = [example_score(dataset, r["prediction"], r["answers"]) for r in records]
    return round(100 * sum(scores) / len(scores), 4)


def score_records(records: list[dict], rouge_aggregation: str = "instance") -> dict:
    """Per-dataset ZeroSCROLLS scores (official task order) and their plain mean."""
    if rouge_aggregation not in ROUGE_AGGREGATIONS:
        raise ConfigError(f"zeroscrolls: rouge_aggregation={rouge_aggregation!r}; valid: instance, corpus")
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    for number, record in enumerate(records, start=1):
        dataset = record.get("dataset")
        if dataset not in DATASET2METRIC:
            raise ConfigError(f"zeroscrolls: record {number} has dataset {dataset!r}; valid ZeroSCROLLS datasets: "
                              f"{', '.join(DATASETS)}")
        answers = record.get("answers")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise DataError(f"zeroscrolls: record {number} ({dataset}) needs 'answers', a non-empty list of strings "
                            f"(the test split is unlabeled)")
        by_dataset.setdefault(dataset, []).append({**record, "prediction": str(record.get("prediction") or "")})
    datasets = {d: dataset_score(d, by_dataset[d], rouge_aggregation) for d in DATASETS if d in by_dataset}
    values = list(datasets.values())
    return {
        "datasets": datasets,
        "counts": {d: len(by_dataset[d]) for d in datasets},
        "score": round(sum(values) / len(values), 4) if values else math.nan,
        "rouge_aggregation": rouge_aggregation,
    }


__all__ = ["DATASETS", "DATASET2METRIC", "ROUGE_AGGREGATIONS", "dataset_score", "example_score", "score_records"]
