"""LongBench v1 scorers with the official semantics (THUDM/LongBench@2e00731 ``LongBench/metrics.py`` and ``eval.py``).

Each function mirrors the official one of the same name, quirks included (reference/benchmarks.md section 1.3):

* ``rouge_score`` calls pltrdy ``rouge==1.0.1`` (case-sensitive, whitespace tokens, sentences split on ".",
  summary-level ROUGE-L F) and turns *any* exception into 0.0, as the official bare ``except`` does. That includes
  the ``RecursionError`` its recursive LCS reconstruction raises on long pairs (a sentence pair of roughly 1000
  tokens combined). The call runs on a fresh thread so that the threshold does not depend on how deep the caller's
  stack is (``get_scores`` runs 5 frames deep there; official ``eval.py``: 4), at Python's default recursion limit,
  1,000, as ``eval.py`` runs (``OFFICIAL_RECURSION_LIMIT``, set for the call: torch's inductor raises the process's
  limit to 2,000 when it compiles, which a job's captured decode does before its records are scored; the score of a
  long pair would then be its ROUGE-L, not the official 0).
* ``classification_score`` removes items from the list it iterates over (an item right after a removed one is
  never checked).
* ``code_sim_score`` uses ``fuzz.ratio`` of ``fuzzywuzzy`` on its pure-python ``difflib`` backend: the official
  requirements list ``fuzzywuzzy`` without ``python-Levenshtein``. ``fuzz_ratio`` below is that code path
  (``SequenceMatcher(None, a, b)`` with autojunk, ``int(round(100 * ratio))``, banker's rounding), so the score
  does not change when python-Levenshtein or rapidfuzz happens to be installed.

Aggregation (``eval.py`` ``scorer`` / ``scorer_e``): per sample the max over reference answers (starting from 0),
per dataset ``round(100 * total / n, 2)``; LongBench-E per length bucket ``round(100 * np.mean(scores), 2)`` with
nan for an empty bucket.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
import string
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Any

import numpy as np

CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ZH_PUNCTUATION = frozenset(string.punctuation + CN_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")


# ---- normalisation and F1 (metrics.py) ------------------------------------------------------------------------------
def normalize_answer(s: str) -> str:
    """``normalize_answer``: lower -> drop ``string.punctuation`` -> articles to " " -> collapse whitespace."""
    text = "".join(ch for ch in s.lower() if ch not in _EN_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(s: str) -> str:
    """``normalize_zh_answer``: lower -> drop ASCII and CJK punctuation -> remove all whitespace (no articles)."""
    text = "".join(ch for ch in s.lower() if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """``f1_score`` over token lists: Counter-intersection F1, 0 when nothing overlaps."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``qa_f1_score``: word F1 of the normalised strings (SQuAD style)."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


@cache
def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)  # it logs "Building prefix dict ..." to stderr on first use
    return jieba


def _jieba_words(text: str) -> list[str]:
    return list(_jieba().cut(text, cut_all=False))


def qa_f1_zh_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``qa_f1_zh_score``: jieba words of the *raw* strings, each normalised, empty ones dropped, then F1
    (word level, not InfiniteBench's character level)."""

    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh_answer(w) for w in _jieba_words(text)) if t]

    return f1_score(tokens(prediction), tokens(ground_truth))


# ---- ROUGE-L (pltrdy rouge==1.0.1) ----------------------------------------------------------------------------------
def _pltrdy_rouge_l_f(prediction: str, ground_truth: str, out: list[float]) -> None:
    from rouge import Rouge

    try:
        out.append(Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"])
    except Exception:  # the official bare except: empty hypothesis/reference, RecursionError, ...
        out.append(0.0)


#: the recursion limit official ``eval.py`` scores at (a fresh Python's default), on which pltrdy's RecursionError
#: on long pairs, scored 0, depends
OFFICIAL_RECURSION_LIMIT = 1000


def rouge_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``rouge_score``: ``Rouge().get_scores([pred], [gt], avg=True)["rouge-l"]["f"]``, 0.0 on any exception.

    Evaluated on a fresh thread, where ``get_scores`` runs 5 frames deep (official ``eval.py``: 4 for English,
    5 through ``rouge_zh_score``), with the process's recursion limit at ``OFFICIAL_RECURSION_LIMIT`` for the call
    (restored after), so that the RecursionError -> 0 quirk depends neither on the caller's stack nor on what raised
    the limit before (torch's inductor sets 2,000 when it compiles).
    """
    out: list[float] = []
    thread = threading.Thread(target=_pltrdy_rouge_l_f, args=(prediction, ground_truth, out), daemon=True)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(OFFICIAL_RECURSION_LIMIT)  # (this thread is shallow: the scorers run near the top)
    try:
        thread.start()
        thread.join()
    finally:
        sys.setrecursionlimit(limit)
    return out[0] if out else 0.0


def rouge_zh_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``rouge_zh_score``: both sides cut into jieba words joined by spaces, then ``rouge_score``."""
    return rouge_score(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


# ---- classification, retrieval, count -------------------------------------------------------------------------------
def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None,
                         **_: Any) -> float:
    """``classification_score`` (trec, lsht): every class name that is a substring of the prediction is a match;
    matches that are a proper substring of the ground truth are removed *while iterating over the same list*
    (the official quirk: the item after a removed one is skipped); 1/len(matches) if the ground truth is among them.

    ``all_classes=["Other", "Other location", "Other location type"]``, prediction = truth = "Other location
    type": "Other" is removed, "Other location" is skipped, so the score is 1/2 (a clean filter would give 1).
    """
    matches = [name for name in (all_classes or ()) if name in prediction]
    for term in matches:  # mutating while iterating, on purpose
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(1 for number in numbers if number == target) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``retrieval_score`` (passage_retrieval_en): the id is the first ``Paragraph (\\d+)`` of the ground truth;
    score = (numbers in the prediction equal to it) / (numbers in the prediction), 0 without numbers."""
    return _fraction_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``retrieval_zh_score`` (passage_retrieval_zh): as ``retrieval_score`` with ``段落(\\d+)``."""
    return _fraction_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``count_score`` (passage_count): (numbers in the prediction equal to the count) / (numbers in it)."""
    return _fraction_equal(prediction, str(ground_truth))


# ---- code similarity (fuzzywuzzy, difflib backend) ------------------------------------------------------------------
def fuzz_ratio(s1: str, s2: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` 0.18.0 without python-Levenshtein: 100 if equal, 0 if either is empty, else
    ``int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))`` (round half to even)."""
    if s1 == s2:
        return 100
    if not s1 or not s2:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """``code_sim_score`` (lcc, repobench-p): the first line of ``prediction.lstrip('\\n')`` containing none of
    "`", "#", "//" ("" if none), then ``fuzz.ratio(line, ground_truth) / 100`` (integer percent)."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n") if "`" not in ln and "#" not in ln
                 and "//" not in ln), "")
    return fuzz_ratio(line, ground_truth) / 100


LONGBENCH_METRICS: dict[str, Callable[..., float]] = {
    "qa_f1_score": qa_f1_score,
    "qa_f1_zh_score": qa_f1_zh_score,
    "rouge_score": rouge_score,
    "rouge_zh_score": rouge_zh_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}


# ---- eval.py: per sample, per dataset, per length bucket ------------------------------------------------------------
def first_line(prediction: str) -> str:
    """``prediction.lstrip('\\n').split('\\n')[0]``: what ``eval.py`` scores for trec, triviaqa, samsum, lsht."""
    return prediction.lstrip("\n").split("\n")[0]


def best_score(metric: str, prediction: str, answers: Iterable[str], all_classes: Sequence[str] | None = None) -> float:
    """``scorer``'s inner loop: ``max`` over the reference answers, starting from 0."""
    fn = LONGBENCH_METRICS[metric]
    score = 0.0
    for answer in answers:
        score = max(score, fn(prediction, answer, all_classes=all_classes))
    return float(score)


def dataset_score(scores: Sequence[float]) -> float:
    """``scorer``: ``round(100 * total_score / len(predictions), 2)`` (sum in the given order)."""
    total = 0.0
    for value in scores:
        total += value
    return round(100 * total / len(scores), 2) if scores else math.nan


BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int | float) -> str:
    """``scorer_e``: ``length < 4000`` -> "0-4k", ``< 8000`` -> "4-8k", else "8k+" (the ``length`` field: words
    for English and code, characters for Chinese; not tokens)."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def bucket_scores(scores: Sequence[float], lengths: Sequence[int | float]) -> dict[str, float]:
    """``scorer_e``: ``round(100 * np.mean(bucket), 2)`` per length bucket; nan for an empty bucket."""
    buckets: dict[str, list[float]] = {name: [] for name in BUCKETS}
    for value, length in zip(scores, lengths, strict=True):
        buckets[length_bucket(length)].append(value)
    return {name: round(100 * float(np.mean(values)), 2) if values else math.nan for name, values in buckets.items()}


@cache
def scorer_backends() -> dict[str, Any]:
    """Versions and backends the scores depend on (recorded in the task protocol)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "rouge": installed("rouge"),
        "jieba": installed("jieba"),
        "fuzzywuzzy": installed("fuzzywuzzy"),
        "code_sim_backend": "difflib",  # kvbench.metrics.longbench.fuzz_ratio, whatever else is installed
        "recursion_limit": OFFICIAL_RECURSION_LIMIT,  # rouge_score's, whatever the process's
    }


__all__ = [
    "BUCKETS", "CN_PUNCTUATION", "LONGBENCH_METRICS", "best_score", "bucket_scores", "classification_score",
    "code_sim_score", "count_score", "dataset_score", "f1_score", "first_line", "fuzz_ratio", "length_bucket",
    "normalize_answer", "normalize_zh_answer", "qa_f1_score", "qa_f1_zh_score", "retrieval_score",
    "retrieval_zh_score", "rouge_score", "rouge_zh_score", "scorer_backends",
]
