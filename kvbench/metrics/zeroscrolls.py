"""ZeroSCROLLS scorers (Shaham et al., Findings of EMNLP 2023, section 3.3 "Automatic Evaluation").

The leaderboard scores test predictions on its server; the scorer is not in tau-nlp/zero_scrolls. These functions
follow the paper, and for the details it leaves open the SCROLLS metric it says it follows (``tau/scrolls``
``metrics/scrolls.py``: rouge-score without stemming, max per ROUGE type over references) and the scorer functions a
third-party copy labels "copied from official repo" (reference/benchmarks.md section 7.2, marked unverified there).
Per prediction, 0-1:

* ``rouge_scores``: ROUGE-1/2/L F-measure (``rouge-score``, default tokenizer, no stemmer); the per-dataset geometric
  mean is in ``kvbench.tasks.zeroscrolls.scoring``.
* ``f1_score``: SQuAD F1 after lowercasing, dropping punctuation and the articles a/an/the, collapsing whitespace and
  then transliterating to ASCII with ``unidecode`` ("café" and "cafe" match; "—" becomes "--", a token of its own).
* ``accuracy_score``: the first ``\\b[A-D]\\b`` of the prediction equals that of the reference.
* ``exp_similarity_score``: ``0.5 ** (|p - p_hat| / 10)`` for the first ``\\d+\\.?\\d*%`` of each; a prediction without
  one scores 0, a reference without one counts as 0 %.
* ``concordance_index_score``: after keeping only digits, commas and whitespace, the share of summary pairs in the
  reference's relative order (lifelines' ``concordance_index``), 0 unless the IDs are a permutation of the reference's.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import cache
from itertools import combinations

from kvbench.errors import DataError, NotAvailableError

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_LETTER = re.compile(r"\b[A-D]\b")
_PERCENT = re.compile(r"\d+\.?\d*%")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@cache
def _unidecode():
    try:
        from unidecode import unidecode
    except ImportError:
        raise NotAvailableError("ZeroSCROLLS F1 (qasper, narrative_qa, musique) transliterates with the 'unidecode' "
                                "package, which is not installed: pip install 'kvbench[zeroscrolls]' "
                                "(unidecode is GPL-2.0, so it is not a default dependency)") from None
    return unidecode


def check_f1_backend() -> None:
    """NotAvailableError (one line) when ``unidecode`` is missing; called before any model loads."""
    _unidecode()


def normalize_answer(s: str) -> str:
    """Lowercase -> drop ``string.punctuation`` -> articles to " " -> collapse whitespace -> ``unidecode``."""
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return _unidecode()(" ".join(_ARTICLES.sub(" ", text).split()))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Counter-intersection token F1 of the normalised strings, 0 without overlap."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


@cache
def _rouge_scorer():
    import logging

    from rouge_score import rouge_scorer

    logging.getLogger("absl").setLevel(logging.WARNING)
    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measure of ``rouge-score`` (SCROLLS: ``use_stemmer=False``; its nltk sentence split only
    affects ROUGE-Lsum, see ``kvbench.metrics.leval.rouge_scores``)."""
    scores = _rouge_scorer().score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


def option_letter(s: str) -> str | None:
    match = _LETTER.search(s)
    return match.group(0) if match else None


def accuracy_score(prediction: str, ground_truth: str) -> float:
    """1 if the first standalone A-D of the prediction is the reference's (whose must exist: DataError)."""
    gold = option_letter(ground_truth)
    if gold is None:
        raise DataError(f"zeroscrolls quality: reference {ground_truth[:60]!r} has no option letter A-D")
    return float(option_letter(prediction) == gold)


def percentage(s: str) -> float | None:
    """The first ``\\d+\\.?\\d*%`` as a float ("40.5% then 60%" -> 40.5), or None."""
    match = _PERCENT.search(s)
    return float(match.group(0)[:-1]) if match else None


def exp_similarity_score(prediction: str, ground_truth: str, base: float = 0.5, scale: float = 10.0) -> float:
    """``base ** (|gold - pred| / scale)`` in percentage points (halved per 10 points off)."""
    gold, pred = percentage(ground_truth), percentage(prediction)
    if pred is None:
        return 0.0
    return base ** (abs((gold if gold is not None else 0.0) - pred) / scale)


def summary_ids(s: str) -> list[int]:
    """Digits, commas and whitespace kept, commas to spaces, outer punctuation stripped, integers ("Order: 3, 1, 2."
    -> [3, 1, 2]; "Summary 12" -> [12])."""
    kept = re.sub(r"[^0-9\s,]", "", s).replace(",", " ").strip(string.punctuation)
    return [int(token) for token in kept.split()]


def concordance_index_score(prediction: str, ground_truth: str) -> float:
    """Share of ID pairs whose order in the prediction is the reference's; 0 if the predicted IDs are not the
    reference's IDs (as multisets). The reference must be a permutation of 1..n with n >= 2 (DataError)."""
    gold, pred = summary_ids(ground_truth), summary_ids(prediction)
    if sorted(gold) != list(range(1, len(gold) + 1)) or len(gold) < 2:
        raise DataError(f"zeroscrolls book_sum_sort: reference {ground_truth[:60]!r} is not a permutation of 1..n")
    if sorted(pred) != sorted(gold):
        return 0.0
    gold_pos = {summary: i for i, summary in enumerate(gold)}
    pred_pos = {summary: i for i, summary in enumerate(pred)}
    pairs = list(combinations(gold, 2))
    return sum((gold_pos[a] < gold_pos[b]) == (pred_pos[a] < pred_pos[b]) for a, b in pairs) / len(pairs)


__all__ = [
    "ROUGE_TYPES", "accuracy_score", "check_f1_backend", "concordance_index_score", "exp_similarity_score",
    "f1_score", "normalize_answer", "option_letter", "percentage", "rouge_scores", "summary_ids",
]
