"""Answer checking for the math tasks: the reasoning trace's answer region, then math-verify (HF, 0.9.0).

A prediction is graded in two steps:

1. ``answer_region``: where the final answer may be read. With ``think="after_close"`` (default) a reasoning trace
   ``... </think> answer`` is read after its last ``</think>``; a trace that opened thinking (``<think>`` in the
   prediction, or in the prompt's generation header as DeepSeek-R1-Distill's chat template writes it) and was cut
   before ``</think>`` has no answer (score 0, majority key ""). With ``think="ignore"`` the whole output is read,
   as R-KV's, TriAttention's and kvpress's evaluation scripts do (they never look for ``</think>``).
2. ``parse`` + ``verify`` of math-verify: the reference answer (the dataset's ``answer`` field) is parsed as LaTeX
   (``$answer$`` with ``LatexExtractionConfig()``), the prediction with
   ``LatexExtractionConfig(boxed_match_priority=0)`` and ``ExprExtractionConfig()`` (a ``\\boxed{}`` first, then
   "final answer is" anchors, then the last LaTeX / plain expression), and ``verify(gold, prediction)`` decides
   (symbolic and numeric equivalence, sets and intervals, units and ``\\text{}`` stripped, ``\\dfrac``).

``majority_key`` is a canonical string of the parsed prediction (sympy's ``str`` of the first parsed value), so
``\\dfrac{1}{2}``, ``0.5`` and ``\\frac12`` vote together for maj@n.

math-verify times its sympy work out with ``signal.alarm``, which only works in the main thread; elsewhere the
timeouts are off (``None``) rather than raising.
"""

from __future__ import annotations

import functools
import threading
from importlib import metadata

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
THINK_MODES = ("after_close", "ignore")
#: the math-verify release the tests pin (verdicts in tests/fixtures/math/tricky_answers.jsonl were recorded with it)
MATH_VERIFY_VERSION = "0.9.0"


def math_verify_version() -> str:
    """The installed math-verify version (recorded in the task protocol)."""
    try:
        return metadata.version("math-verify")
    except metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        return "not installed"


def math_verify_series() -> str:
    """``major.minor`` of the installed math-verify: what the task protocol (and so the job key) records, so that a
    patch release does not re-run 32K-token generations; the exact version goes with the scores (``aggregate``)."""
    return ".".join(math_verify_version().split(".")[:2])


def answer_region(prediction: str, think: str = "after_close", think_opened: bool = False) -> str | None:
    """The text the final answer is read from, or None where the trace was cut before ``</think>`` (no answer).

    ``think_opened``: the prompt ended inside a ``<think>`` block (the chat template opened it)."""
    if think == "ignore":
        return prediction
    close = prediction.rfind(THINK_CLOSE)
    if close >= 0:
        return prediction[close + len(THINK_CLOSE):]
    if think_opened or THINK_OPEN in prediction:
        return None
    return prediction


def _timeout() -> int | None:
    """math-verify's timeout in seconds: 5 (its default) in the main thread, None (off) elsewhere."""
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def parse_gold(answer: str) -> tuple:
    """The reference answer parsed by math-verify (``$answer$``, LaTeX extraction); cached."""
    from math_verify import LatexExtractionConfig, parse

    return tuple(parse(f"${answer}$", [LatexExtractionConfig()], parsing_timeout=_timeout()))


def parse_prediction(text: str) -> list:
    """A prediction's answer parsed by math-verify (boxed first, then anchors, then the last expression)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(text, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                 parsing_timeout=_timeout())


def is_correct(prediction_text: str | None, answer: str) -> bool:
    """math-verify's verdict on one answer region against one reference answer (False for no answer)."""
    from math_verify import verify

    if prediction_text is None:
        return False
    predicted = parse_prediction(prediction_text)
    gold = list(parse_gold(answer))
    if not predicted or not gold:
        return False
    return bool(verify(gold, predicted, timeout_seconds=_timeout()))


def canonical_answer(prediction_text: str | None) -> str:
    """The majority-vote key of an answer region: sympy's string of the first parsed value ("" for no answer)."""
    if prediction_text is None:
        return ""
    predicted = parse_prediction(prediction_text)
    if not predicted:
        return ""
    return str(_unassigned(predicted[0])).strip()


def _unassigned(value):
    """``x = 5`` -> ``5``: an equation whose left side is a lone symbol absent from its right side votes as its value
    (math-verify's ``verify`` calls ``x=5`` and ``5`` equal, so maj@n must count them as one answer); other equations
    (``x^2 = 4``) and relations stay whole."""
    import sympy

    if isinstance(value, sympy.Equality) and isinstance(value.lhs, sympy.Symbol) and \
            value.lhs not in getattr(value.rhs, "free_symbols", set()):
        return value.rhs
    return value


__all__ = ["MATH_VERIFY_VERSION", "THINK_MODES", "answer_region", "canonical_answer", "is_correct",
           "math_verify_series", "math_verify_version", "parse_gold", "parse_prediction"]
