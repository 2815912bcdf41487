"""LongBench v2 scores, as THUDM/LongBench@2e00731 ``pred.py`` (``extract_answer``, ``judge``) and ``result.py``
compute them.

Per sample: ``extract_answer(response)`` — ``*`` removed, then the first match of
``The correct answer is \\(([A-D])\\)``, else of ``The correct answer is ([A-D])``, else None — and
``judge = pred == answer`` (no answer found: wrong; with ``compensated``, result.py's switch, 0.25). Per run
(``result.py``): accuracy × 100 over all samples, over ``easy`` and ``hard`` (every difficulty that is not "easy"
counts as hard) and over ``short``, ``medium`` and ``long`` (every length that is neither short nor medium counts as
long), each ``round(100 * sum / n, 1)``. A group with no sample is NaN here (result.py divides by zero).

``score_records`` re-scores predictions from any harness: records with ``answer`` (A-D), ``difficulty``, ``length``
and ``prediction`` (the response; upstream's results files call it ``response``, accepted too; upstream's ``pred`` is
the extracted letter and is not read). A kvbench job's ``samples.jsonl`` works as it is: ``answer``, ``difficulty``
and ``length`` are read from each record's ``meta`` when not top-level.
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvbench.errors import DataError

_PARENS = re.compile(r"The correct answer is \(([A-D])\)")
_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """``pred.py`` ``extract_answer``: the letter A-D of "The correct answer is (X)", else of "The correct answer
    is X", after removing every ``*`` (markdown bold); None when neither matches."""
    response = response.replace("*", "")
    match = _PARENS.search(response)
    if match:
        return match.group(1)
    match = _BARE.search(response)
    return match.group(1) if match else None


def judge(response: str, answer: str, compensated: bool = False) -> float:
    """1.0 when the extracted letter equals ``answer``, else 0.0; no extractable letter is wrong (0.0), or 0.25 with
    ``compensated`` (``result.py``'s ``compensated`` switch, off upstream)."""
    pred = extract_answer(response)
    if pred is None and compensated:
        return 0.25
    return float(pred == answer)


def _acc(values: list[float]) -> float:
    return round(100 * sum(values) / len(values), 1) if values else math.nan


def summarize(scored: list[tuple[float, str, str]]) -> dict[str, Any]:
    """``result.py`` from (score, difficulty, length) per sample: ``score`` (Overall), ``difficulty`` {easy, hard},
    ``length`` {short, medium, long}, ``counts``, ``n``."""
    groups: dict[str, list[float]] = {"easy": [], "hard": [], "short": [], "medium": [], "long": []}
    for value, difficulty, length in scored:
        groups["easy" if difficulty == "easy" else "hard"].append(value)
        groups[length if length in ("short", "medium") else "long"].append(value)
    return {
        "score": _acc([value for value, _, _ in scored]),
        "n": len(scored),
        "difficulty": {k: _acc(groups[k]) for k in ("easy", "hard")},
        "length": {k: _acc(groups[k]) for k in ("short", "medium", "long")},
        "counts": {k: len(v) for k, v in groups.items()},
    }


def score_records(records: list[dict[str, Any]], compensated: bool = False) -> dict[str, Any]:
    """Scores of prediction records (``prediction`` or ``response``, ``answer``, ``difficulty``, ``length``)."""
    if not records:
        raise DataError("no LongBench v2 records to score")
    scored = []
    for index, record in enumerate(records):
        where = f"record {index + 1}" + (f" ({record['_id']})" if isinstance(record, dict) and "_id" in record else "")
        if not isinstance(record, dict):
            raise DataError(f"{where} is not a JSON object")
        response = record.get("prediction", record.get("response"))
        if not isinstance(response, str):
            raise DataError(f"{where}: needs a string 'prediction' (or upstream's 'response'); got {response!r:.80}")
        meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
        fields = {key: record.get(key, meta.get(key)) for key in ("answer", "difficulty", "length")}
        for key, value in fields.items():
            if not isinstance(value, str):
                raise DataError(f"{where}: needs a string {key!r} (top-level or in 'meta'); got {value!r:.80}")
        scored.append((judge(response, fields["answer"], compensated), fields["difficulty"], fields["length"]))
    return summarize(scored)


__all__ = ["extract_answer", "judge", "score_records", "summarize"]
