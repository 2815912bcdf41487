"""LEval scores from prediction records, as ``Evaluation/auto_eval.py`` computes them per prediction file.

``score_records(records)`` takes ``{"dataset", "prediction", "answers", ...}`` dicts (kvbench's own records, or another
harness's predictions through ``python -m kvbench.score --benchmark leval``) and returns ``{"datasets": {name: score},
"groups": ..., "score": ...}``. Per dataset (``LEvalMetrics`` + ``_compute_helper``, every value ``round(x, 4)``):

* exam: ``100 * mean`` of ``em.exact_match_score`` (max over references) after the task's pre-processing;
  topic_retrieval_longchat: that score for the 1st, 2nd and 3rd topic questions separately (line index ``i % 3``),
  averaged; sci_fi: loyalty (answer from the document) and fact (real-world answer) scored separately, averaged.
* f1: ``100 * mean`` of the max over references of SQuAD F1.
* rouge: per key the mean over questions of the max over references of ROUGE-1/2/L F x100, then their geometric
  mean (of the three means, not per question).

Aggregates: ``groups`` {closed: mean of the exam datasets, qa: mean of the f1 ones, summ: mean of the rouge ones} and
``score`` = mean of the groups present (POD Table 1's LEval "Closed / QA / Summ / Avg"); ``leaderboard`` = the
l-eval.github.io columns (exact-match average, F1 average, ROUGE-L average over the summarisation datasets).

Optional record fields: ``part`` ("loyalty" / "fact") for kvbench's two sci_fi generations (without it a sci_fi
prediction is upstream's combined "<answer> [fact: <answer>]"), ``question_index`` (position of the question in the
dataset's prediction file; default: the record's position among that dataset's records) for topic retrieval.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError, DataError
from kvbench.metrics import leval as m

PROTOCOL: dict[str, Any] = json.loads(Path(__file__).with_name("prompts.json").read_text(encoding="utf-8"))
DATASETS: list[str] = PROTOCOL["closed_ended"] + PROTOCOL["open_ended"]
DATASET2METRIC: dict[str, str] = PROTOCOL["dataset2metric"]
WITH_OPTIONS = frozenset(PROTOCOL["with_options"])
MULTI_ANSWER = frozenset(PROTOCOL["multi_answer"])
GROUPS: dict[str, str] = PROTOCOL["groups"]  # group -> metric
TOPIC, SCI_FI = "topic_retrieval_longchat", "sci_fi"
TOPIC_POSITIONS = ("first", "second", "third")
SCI_FI_PARTS = ("loyalty", "fact")


def question_score(dataset: str, prediction: str, answers: list[str], part: str | None = None) -> float:
    """One question's score (0-1): the dataset's official metric after its pre-processing, max over ``answers``.
    Rouge datasets: the geometric mean of this question's ROUGE-1/2/L (the dataset score is not a mean of these)."""
    metric = DATASET2METRIC[dataset]
    if metric == "rouge":
        scores = best_rouge(prediction, answers)
        return (scores["rouge1"] * scores["rouge2"] * scores["rougeL"]) ** (1 / 3)
    if metric == "f1":
        return max(m.f1_score(prediction, answer) for answer in answers)
    if dataset == SCI_FI:
        parts = [part] if part else list(SCI_FI_PARTS)
        return sum(sci_fi_score(prediction, answers, p, combined=part is None) for p in parts) / len(parts)
    return max(exam_score(dataset, prediction, answer) for answer in answers)


def exam_score(dataset: str, prediction: str, answer: str) -> float:
    """``exact_match_score`` after ``auto_eval.py``'s pre-processing of prediction and reference."""
    if dataset in WITH_OPTIONS:
        return m.exact_match_score(m.process_output_mc(prediction, dataset in MULTI_ANSWER), m.process_gt_mc(answer))
    if dataset == "gsm100":
        return m.exact_match_score(m.process_math(prediction), m.process_math(answer))
    if dataset == "codeU":
        return m.exact_match_score(m.process_output_code(prediction, answer), m.process_gt_code(answer))
    return m.exact_match_score(prediction, answer)  # topic retrieval: raw strings


def sci_fi_score(prediction: str, answers: list[str], part: str, combined: bool) -> float:
    """The loyalty or fact part: ``judge_word`` of the prediction (of its own part when ``combined``) against that
    part of the reference "<True|False> [fact: <True|False>]"."""
    index = SCI_FI_PARTS.index(part)
    text = m.judge_parts(prediction)[index] if combined else prediction
    return max(m.exact_match_score(m.judge_word(text), m.judge_parts(answer)[index]) for answer in answers)


def best_rouge(prediction: str, answers: list[str]) -> dict[str, float]:
    """Per ROUGE type the max over the references (``agg_fn=max`` per key), F-measure x100."""
    per_answer = [m.rouge_scores(prediction, answer) for answer in answers]
    return {key: 100 * max(s[key] for s in per_answer) for key in m.ROUGE_TYPES}


def dataset_score(dataset: str, records: list[dict[str, Any]]) -> tuple[float, dict[str, float] | None]:
    """The dataset's ``LEval_score`` and its parts (rouge keys, topic positions, sci_fi parts) where it has them."""
    metric = DATASET2METRIC[dataset]
    if metric == "rouge":
        rows = [best_rouge(r["prediction"], r["answers"]) for r in records]
        means = {key: sum(row[key] for row in rows) / len(rows) for key in m.ROUGE_TYPES}
        geometric = (means["rouge1"] * means["rouge2"] * means["rougeL"]) ** (1 / 3)
        return round(geometric, 4), {key: round(v, 4) for key, v in means.items()}
    if dataset == TOPIC:
        positions: dict[str, list[float]] = {name: [] for name in TOPIC_POSITIONS}
        for order, r in enumerate(records):
            index = r.get("question_index", order)
            positions[TOPIC_POSITIONS[int(index) % 3]].append(question_score(dataset, r["prediction"], r["answers"]))
        parts = {name: round(100 * sum(v) / len(v), 4) for name, v in positions.items() if v}
        return sum(parts.values()) / len(parts), parts
    if dataset == SCI_FI:
        values: dict[str, list[float]] = {name: [] for name in SCI_FI_PARTS}
        for r in records:
            for part in [r["part"]] if r.get("part") else SCI_FI_PARTS:
                values[part].append(sci_fi_score(r["prediction"], r["answers"], part, combined=not r.get("part")))
        parts = {name: round(100 * sum(v) / len(v), 4) for name, v in values.items() if v}
        return sum(parts.values()) / len(parts), parts
    scores = [question_score(dataset, r["prediction"], r["answers"]) for r in records]
    return round(100 * sum(scores) / len(scores), 4), None


def score_records(records: list[dict]) -> dict:
    """Per-dataset LEval scores and the aggregates of the module docstring (datasets in the official order)."""
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    for number, record in enumerate(records, start=1):
        dataset = record.get("dataset")
        if dataset not in DATASET2METRIC:
            raise ConfigError(f"leval: record {number} has dataset {dataset!r}; valid LEval datasets: "
                              f"{', '.join(DATASETS)}")
        answers = record.get("answers")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise DataError(f"leval: record {number} ({dataset}) needs 'answers', a non-empty list of strings")
        if record.get("part") not in (None, *SCI_FI_PARTS):
            raise DataError(f"leval: record {number} has part={record['part']!r}; valid: loyalty, fact")
        by_dataset.setdefault(dataset, []).append({**record, "prediction": str(record.get("prediction") or "")})
    datasets: dict[str, float] = {}
    details: dict[str, dict[str, float]] = {}
    for dataset in [d for d in DATASETS if d in by_dataset]:
        datasets[dataset], parts = dataset_score(dataset, by_dataset[dataset])
        if parts is not None:
            details[dataset] = parts
    groups = {group: _mean(v for d, v in datasets.items() if DATASET2METRIC[d] == metric)
              for group, metric in GROUPS.items() if any(DATASET2METRIC[d] == metric for d in datasets)}
    rouge_l = [details[d]["rougeL"] for d in datasets if DATASET2METRIC[d] == "rouge"]
    return {
        "datasets": datasets,
        "counts": {d: len(by_dataset[d]) for d in datasets},
        "groups": groups,
        "score": _mean(groups.values()),
        "leaderboard": {"exact_match_avg": groups.get("closed", math.nan), "f1_avg": groups.get("qa", math.nan),
                        "rougeL_avg": _mean(rouge_l)},
        "details": details,
    }


def _mean(values: Any) -> float:
    values = list(values)
    return round(sum(values) / len(values), 4) if values else math.nan


__all__ = ["DATASETS", "DATASET2METRIC", "dataset_score", "question_score", "score_records"]
