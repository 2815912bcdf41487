"""InfiniteBench scorers with the official semantics (OpenBMB/InfiniteBench@88b3daa ``src/compute_scores.py``).

Every task scores one prediction against one *label*, the value ``eval_utils.get_answer`` stores: the row's
``answer`` as is, except for longbook_choice_eng and code_debug, where it becomes ``[answer_text, letter]``
(reference/benchmarks.md section 2). Labels have mixed types (section 0, pitfall 6): str for passkey,
number_string and kv_retrieval, **int** for code_run, int or float for math_find, a list of ints for math_calc and
lists of str elsewhere. ``official_label`` turns an answer from the raw files, an official results file or a
harness that stringified everything (HF ``Sequence(string)`` features) into that type; the scorers then compare
exactly as upstream does, quirks included:

* passkey / number_string: the first digit run of the prediction equals the label *as a string*;
* kv_retrieval: the label is one of the words left after replacing ``\\n : " ' . , ? ! { }`` by spaces;
* code_run: the *last* word (after replacing ``\\n . ` ' " :``) cast with ``int()`` equals the int label;
* code_debug: ``"B."``/``"B:"`` at the start, else the text right after the first of the prefixes
  ``answer is:``, ``is:``, ``answer:``, ``correct option is:`` (in that order of preference) starts with the letter
  or the function name;
* math_find: the first ``\\d+\\.\\d+|\\d+`` compared with ``int()`` or ``float()`` according to the label's type;
* math_calc: leading run of digit runs equal to the label list, divided by its length (signs are lost);
* longdialogue_qa_eng: ``label[0]`` is one of the upper-cased words (whole words only);
* longbook_choice_eng: the *first* letter wins, then the prefixes ``answer is:``, ``answer:``, ``answer is``,
  ``option is``, then the first word that is a substring of "ABCD";
* longbook_qa_eng: LongBench's SQuAD-style token F1, max over answers; longbook_qa_chn: *character* F1;
* longbook_sum_eng: ``rougeLsum`` F of Google ``rouge-score`` without stemming (HF ``evaluate``'s ``rouge``
  default), max over references as ``score_multi``.

Each function returns a float in [0, 1]; a task's official score is the plain mean (``compute_scores.get_score``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from kvbench.errors import DataError
from kvbench.metrics.longbench import f1_score, normalize_zh_answer, qa_f1_score
from kvbench.metrics.rouge import rouge_score_f
from kvbench.metrics.string_match import first_int

_FIRST_NUMBER = re.compile(r"\d+\.\d+|\d+")
_NON_DIGIT = re.compile("[^0-9]")
_INT = re.compile(r"[+-]?\d+")
OPTIONS = "ABCD"


def _replace(text: str, chars: Sequence[str]) -> str:
    for c in chars:
        text = text.replace(c, " ")
    return text


def _squeeze(text: str) -> str:
    while "  " in text:
        text = text.replace("  ", " ")
    return text


# ---- retrieval ------------------------------------------------------------------------------------------------------
def passkey_score(prediction: str, label: str) -> float:
    """passkey / number_string: the first run of ASCII digits equals ``label`` as a string."""
    return float(first_int(prediction) == label)


def kv_retrieval_score(prediction: str, label: str) -> float:
    """kv_retrieval: ``label in words`` after replacing ``\\n : " ' . , ? ! { }`` with spaces and splitting."""
    return float(label in _replace(prediction, ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]).split())


# ---- code -----------------------------------------------------------------------------------------------------------
def code_run_score(prediction: str, label: int) -> float:
    """code_run: the last word, after replacing ``\\n . ` ' " :`` with spaces, parsed by Python's ``int()``
    (so "-3", "+3" and "1_000" parse, "3.0" does not) equals the int label."""
    words = _replace(prediction.strip(), ["\n", ".", "`", "'", '"', ":"]).split()
    if not words:
        return 0.0
    try:
        return float(int(words[-1]) == label)
    except ValueError:
        return 0.0


def code_debug_score(prediction: str, label: Sequence[str]) -> float:
    """code_debug with ``label = [function_name, letter]``: True when the stripped prediction starts with
    "<letter>." or "<letter>:"; else, after replacing ``\\n ` ' " - *`` and "Option"/"option" with spaces and
    squeezing double spaces, the first prefix of ``answer is:``, ``is:``, ``answer:``, ``correct option is:`` found
    decides: the text one character after it must start with the letter or the function name."""
    prediction = prediction.strip()
    function, letter = label[0], label[1]
    if prediction[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    text = _squeeze(_replace(prediction, ["\n", "`", "'", '"', "-", "*", "Option", "option"]))
    for prefix in ("answer is:", "is:", "answer:", "correct option is:"):
        index = text.find(prefix)
        if index == -1:
            continue
        if len(text) < index + len(prefix) + 1:  # the prediction ends with the prefix
            return 0.0
        rest = text[index + len(prefix) + 1 :]
        return float(rest.startswith(letter) or rest.startswith(function))
    return 0.0


# ---- math -----------------------------------------------------------------------------------------------------------
def math_find_score(prediction: str, label: int | float) -> float:
    """math_find: the first ``\\d+\\.\\d+|\\d+`` of the prediction (no sign) as ``int`` for an int label, as
    ``float`` for a float label. Upstream's ``int("3.5")`` raises for a decimal prediction against an int label,
    stopping the whole run; kvbench scores that sample 0."""
    match = _FIRST_NUMBER.search(prediction)
    if match is None:
        return 0.0
    number = match.group(0)
    if isinstance(label, float):
        return float(float(number) == label)
    try:
        return float(int(number) == label)
    except ValueError:
        return 0.0


def math_calc_score(prediction: str, label: Sequence[int], drop_first: bool = False) -> float:
    """math_calc: every digit run of the prediction as an int (signs are lost: "-1" reads 1); the number of leading
    positions equal to the label list, up to the first mismatch, over ``len(label)``. ``drop_first`` drops the
    first predicted number, as upstream does for ``--model_name gpt4`` (its default model name)."""
    numbers = [int(piece) for piece in _NON_DIGIT.split(prediction) if piece]
    if drop_first:
        numbers = numbers[1:]
    count = 0
    for expected, got in zip(label, numbers):
        if expected != got:
            break
        count += 1
    return count / len(label)


# ---- novels and dialogue --------------------------------------------------------------------------------------------
def longdialogue_qa_score(prediction: str, label: Sequence[str]) -> float:
    """longdialogue_qa_eng: ``label[0]`` is one of the upper-cased words of the prediction (after replacing
    ``\\n : " ' . , ? ! { }``); later names in the label list are never used, and a two-word name never matches."""
    words = _replace(prediction.strip(), ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]).split()
    return float(label[0] in [word.upper() for word in words])


def longbook_choice_score(prediction: str, label: Sequence[str]) -> float:
    """longbook_choice_eng with ``label = [answer_text, letter]``. In order: an empty prediction is wrong; a first
    character in "ABCD" decides (``in label``); the whole prediction equal to the text or the letter is right;
    after replacing ``\\n " ' . , ? ! { }`` and squeezing spaces, the first prefix of ``answer is:``, ``answer:``,
    ``answer is``, ``option is`` found decides (the text one character after it starts with the letter or the
    answer text); else the first word that is a substring of "ABCD" decides."""
    prediction = prediction.strip()
    if prediction == "":
        return 0.0
    if prediction[0] in OPTIONS:
        return float(prediction[0] in label)
    if prediction in label:
        return 1.0
    text = _squeeze(_replace(prediction, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]))
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        index = text.find(prefix)
        if index == -1:
            continue
        if len(text) < index + len(prefix) + 1:
            return 0.0
        rest = text[index + len(prefix) + 1 :]
        return float(any(rest.startswith(option) for option in label))
    for word in text.split():
        if word in OPTIONS:  # substring test, as upstream: "AB" counts, then fails ``in label``
            return float(word in label)
    return 0.0


def longbook_qa_eng_score(prediction: str, label: Sequence[str]) -> float:
    """longbook_qa_eng: max over answers of LongBench's ``qa_f1_score`` (SQuAD normalisation, token F1)."""
    return max((qa_f1_score(prediction, answer) for answer in label), default=0.0)


def longbook_qa_chn_score(prediction: str, label: Sequence[str]) -> float:
    """longbook_qa_chn: max over answers of the *character* F1 of ``normalize_zh_answer`` strings (not jieba)."""
    chars = list(normalize_zh_answer(prediction))
    return max((f1_score(chars, list(normalize_zh_answer(answer))) for answer in label), default=0.0)


def longbook_sum_score(prediction: str, label: Sequence[str]) -> float:
    """longbook_sum_eng: ``evaluate.load("rouge").compute([pred], [label], use_aggregator=False)["rougeLsum"][0]``:
    Google rouge-score ``rougeLsum`` (sentences split on newlines), no stemmer, F-measure, max over references."""
    return max((rouge_score_f("rougeLsum", answer, prediction, use_stemmer=False) for answer in label), default=0.0)


SCORERS: dict[str, Callable[..., float]] = {
    "passkey": passkey_score,
    "number_string": passkey_score,
    "kv_retrieval": kv_retrieval_score,
    "longbook_sum_eng": longbook_sum_score,
    "longbook_choice_eng": longbook_choice_score,
    "longbook_qa_eng": longbook_qa_eng_score,
    "longbook_qa_chn": longbook_qa_chn_score,
    "longdialogue_qa_eng": longdialogue_qa_score,
    "math_find": math_find_score,
    "math_calc": math_calc_score,
    "code_run": code_run_score,
    "code_debug": code_debug_score,
}
MULTIPLE_CHOICE = frozenset({"longbook_choice_eng", "code_debug"})


# ---- labels ---------------------------------------------------------------------------------------------------------
def official_label(task: str, answer: Any, options: Sequence[str] | None = None) -> Any:
    """The label ``compute_scores.py`` compares against, in its official type, from ``answer`` as found in the raw
    files (``["71432"]``, ``[4]``, ``[[1, 4, 8]]``, ...), in official results files (``"71432"``, ``4``,
    ``["Walking Georgie", "A"]``) or stringified by other harnesses (``["4"]``). Raises DataError if impossible.

    Upstream unwraps a one-element list for passkey, number_string, code_run and math_find but not kv_retrieval,
    whose list label then never matches; kvbench unwraps it as well (the labels of the official results files are
    str). String labels become int for code_run and int/float for math_find (upstream would score code_run 0 and
    raise TypeError on math_find). A plain string answer for the list tasks becomes a one-element list (upstream
    would iterate over its characters). longbook_choice_eng / code_debug follow ``get_answer``: an answer text (or a
    one-element list) plus ``options`` gives ``[text, "ABCD"[options.index(text)]]``; ``[text, letter]`` is kept.
    """
    try:
        if task in MULTIPLE_CHOICE:
            return _choice_label(answer, options)
        if task == "math_calc":
            values = answer[0] if isinstance(answer, list) and answer and isinstance(answer[0], list) else answer
            return _non_empty([_to_int(v) for v in _as_list(values)])
        value = answer[0] if isinstance(answer, list) and answer else answer  # upstream: label[0] of a list
        if task in ("passkey", "number_string", "kv_retrieval"):
            return _to_str(value)
        if task == "code_run":
            return _to_int(value)
        if task == "math_find":
            return _to_number(value)
        if task in SCORERS:  # the list-of-strings tasks
            return _non_empty([_to_str(v) for v in _as_list(answer)])
    except (TypeError, ValueError) as exc:
        raise DataError(f"{task}: cannot use answer {answer!r:.120} as its label ({exc})") from None
    raise DataError(f"unknown InfiniteBench task {task!r}; valid: {', '.join(SCORERS)}")


def _choice_label(answer: Any, options: Sequence[str] | None) -> list[str]:
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in tuple(OPTIONS):
        return [_to_str(answer[0]), answer[1]]
    text = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
    if not isinstance(text, str):
        raise ValueError("expected an answer text, a one-element list or [answer, letter]")
    if not options:
        raise ValueError("no 'options' to find its letter (give options or answers as [answer, letter])")
    if text not in options:
        raise ValueError(f"{text!r} is not one of the options {list(options)!r:.200}")
    return [text, OPTIONS[list(options).index(text)]]


def _non_empty(values: list[Any]) -> list[Any]:
    if not values:
        raise ValueError("the label list is empty")
    return values


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _to_str(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value if isinstance(value, str) else str(value)


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("expected an integer, got bool")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT.fullmatch(value.strip()):
        return int(value)
    raise ValueError(f"expected an integer, got {value!r}")


def _to_number(value: Any) -> int | float:
    if isinstance(value, bool):
        raise TypeError("expected a number, got bool")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        return int(text) if _INT.fullmatch(text) else float(text)
    raise TypeError(f"expected a number, got {type(value).__name__}")


def score_one(task: str, prediction: str, label: Any, math_calc_drop_first: bool = False) -> float:
    """The official per-sample score (0-1) of ``prediction`` against an ``official_label``."""
    if task == "math_calc":
        return math_calc_score(prediction, label, drop_first=math_calc_drop_first)
    return SCORERS[task](prediction, label)


__all__ = [
    "MULTIPLE_CHOICE", "SCORERS", "code_debug_score", "code_run_score", "kv_retrieval_score", "longbook_choice_score",
    "longbook_qa_chn_score", "longbook_qa_eng_score", "longbook_sum_score", "longdialogue_qa_score",
    "math_calc_score", "math_find_score", "official_label", "passkey_score", "score_one",
]
