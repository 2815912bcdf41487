"""RULER's scorers (NVIDIA/RULER ``scripts/eval/synthetic/constants.py`` and ``scripts/eval/evaluate.py``).

Per dataset, over predictions ``p_i`` and reference lists ``R_i`` (case-insensitive substring tests):

    string_match_all  = round(sum_i (sum_{r in R_i} [r.lower() in p_i.lower()]) / |R_i|  / N * 100, 2)
    string_match_part = round(sum_i  max_{r in R_i} [r.lower() in p_i.lower()]           / N * 100, 2)

``all`` (niah*, vt, cwe, fwe) gives partial credit for each reference found; ``part`` (qa_1, qa_2) needs any one
reference. lm-eval's copy of ``string_match_part`` divides by the number of references, which makes it
``string_match_all`` (reference/benchmarks.md section 9); this module follows RULER. Predictions are first
post-processed as ``evaluate.py`` does: strip, every control character ``[\\x00-\\x1f]`` -> ``"\\n"``, strip.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """``evaluate.py::postprocess_pred``."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def match_all(prediction: str, references: Sequence[str]) -> float:
    """One sample's ``string_match_all`` term: the fraction of references contained in the prediction."""
    lowered = prediction.lower()
    return sum(1.0 if r.lower() in lowered else 0.0 for r in references) / len(references)


def match_part(prediction: str, references: Sequence[str]) -> float:
    """One sample's ``string_match_part`` term: 1.0 if any reference is contained in the prediction."""
    lowered = prediction.lower()
    return max(1.0 if r.lower() in lowered else 0.0 for r in references)


SAMPLE_METRICS = {"string_match_all": match_all, "string_match_part": match_part}


def dataset_score(terms: Sequence[float]) -> float:
    """``round(sum(terms) / len(terms) * 100, 2)``, the official arithmetic in the official order."""
    return round(sum(terms) / len(terms) * 100, 2)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    return dataset_score([match_all(p, r) for p, r in zip(predictions, references)])


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    return dataset_score([match_part(p, r) for p, r in zip(predictions, references)])


__all__ = ["SAMPLE_METRICS", "dataset_score", "match_all", "match_part", "postprocess_pred", "string_match_all",
           "string_match_part"]
