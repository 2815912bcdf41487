"""String-match scorers: InfiniteBench ``first_int_match`` and OmniKV's case-insensitive substring match."""

from __future__ import annotations

import re
from collections.abc import Iterable

_NON_DIGIT = re.compile("[^0-9]")


def first_int(prediction: str) -> str:
    """The first run of ASCII digits in ``prediction``, or "" (InfiniteBench ``compute_scores.first_int_match``).

    Official: ``re.split("[^0-9]", pred)`` and take the first non-empty piece. So a sign is dropped ("-12" -> "12"),
    a decimal stops at the point ("3.14" -> "3"), and thousands separators split ("1,234" -> "1").
    """
    for piece in _NON_DIGIT.split(prediction):
        if piece:
            return piece
    return ""


def first_int_match(prediction: str, label: str) -> float:
    """InfiniteBench passkey / number_string score: 1.0 if the first digit run equals ``label`` as a string.

    ``label`` is compared as a string, exactly as the official ``label == first_int_match(pred)``: leading zeros
    count ("01234" does not match "1234") and an int label never matches (pass ``str(label)``).
    """
    return float(label == first_int(prediction))


def substring_any(prediction: str, answers: Iterable[str]) -> float:
    """1.0 if any answer occurs in the prediction, case-insensitively (OmniKV ``cot_pred.py`` 2StageRetr accuracy:
    ``ans.lower() in llm_out.lower()``). Any output that lists the right color among others scores."""
    lowered = prediction.lower()
    return float(any(answer.lower() in lowered for answer in answers))
