"""ROUGE scorers as the official benchmark code calls them.

Two ROUGE libraries are in use and they are not interchangeable (reference/benchmarks.md section 0, item 1):
Google ``rouge-score`` (lowercases, drops punctuation, optional Porter stemming) and pltrdy ``rouge==1.0.1``
(case-sensitive, whitespace tokens; LongBench). This module holds the ``rouge-score`` ones.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

# rouge_score logs "Using default tokenizer." at INFO through absl on every scorer; keep job logs readable.
logging.getLogger("absl").setLevel(logging.WARNING)


@cache
def _scorer(rouge_type: str, use_stemmer: bool) -> Any:
    """``rouge_scorer.RougeScorer`` (imported here: rouge-score imports nltk, about 2 s, which a job that never
    scores with ROUGE, and every command line that only refuses its input, should not wait for)."""
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type], use_stemmer=use_stemmer)


def rouge1_f_x10(reference: str, prediction: str) -> float:
    """Needle-in-a-haystack score of PyramidKV / KVCache-Factory ``run_needle_in_haystack.py``.

    ``RougeScorer(['rouge1'], use_stemmer=True).score(needle, response)['rouge1'].fmeasure * 10``, and 0 when the
    response is empty (the official script checks ``len(response) != 0`` after ``strip()``). Range 0-10.
    """
    if len(prediction) == 0:
        return 0.0
    return _scorer("rouge1", True).score(reference, prediction)["rouge1"].fmeasure * 10


def rouge_score_f(rouge_type: str, target: str, prediction: str, use_stemmer: bool = False) -> float:
    """F-measure of one Google ``rouge-score`` type (``rouge1``, ``rougeL``, ``rougeLsum``, ...), default tokenizer
    (lowercase, non-alphanumerics dropped); ``rougeLsum`` splits sentences on newlines."""
    return _scorer(rouge_type, use_stemmer).score(target, prediction)[rouge_type].fmeasure
