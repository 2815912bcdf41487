"""LEval scorers with the official semantics (OpenLMLab/LEval@cd34b05 ``Evaluation/auto_eval.py``, ``em.py``,
``f1.py``, ``rouge.py``), quirks included (reference/benchmarks.md section 7.1).

Per question (0-1 here; the dataset scores in ``kvbench.tasks.leval.scoring`` are x100 as upstream):

* ``exact_match_score`` (``em.py``, every closed-ended task): the reference is normalised *without* lowercasing
  (punctuation, then the articles a/an/the, then whitespace). A reference made only of the letters A-D is an option
  answer: 1 if the normalised prediction equals it, else 0.25 if the prediction's characters are a subset of the
  reference's (a partly right multi-answer), else 0. Any other reference: ``float`` equality if both parse, else 1
  when the reference, lowercased with spaces removed, is a substring of the prediction treated the same way.
* Pre-processing of ``auto_eval.py`` before it: ``process_output_mc`` / ``process_gt_mc`` (coursera, quality, tpo),
  ``process_math`` (gsm100), ``process_output_code`` / ``process_gt_code`` (codeU), ``judge_*`` (sci_fi).
* ``f1_score`` (``f1.py``): SQuAD token F1 after lowercasing, punctuation, articles, whitespace.
* ``rouge_scores`` (``rouge.py``): Google ``rouge-score`` ROUGE-1/2/L F-measure, ``use_stemmer=False``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import cache

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_OPTIONS = "ABCD"
_OPTION_LETTER = re.compile(r"\s*[A-Z](?=[\s.)])")


# ---- em.py ----------------------------------------------------------------------------------------------------------
def normalize_exam(s: str) -> str:
    """``em.normalize_answer``: drop ``string.punctuation`` -> articles (lowercase only) to " " -> collapse
    whitespace. No lowercasing (unlike ``f1.py``): "The Answer" keeps its capital T."""
    text = "".join(ch for ch in s if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """``em.exact_match_score``: 1 / 0.25 / 0 for option answers, float equality or substring otherwise."""
    gold = normalize_exam(ground_truth)
    if all(ch in _OPTIONS for ch in gold):  # only option letters (or empty): an option answer
        pred = normalize_exam(prediction)
        if pred == gold:
            return 1.0
        return 0.25 if set(pred) <= set(gold) else 0.0
    try:
        return float(float(prediction) == float(ground_truth))
    except ValueError:
        return float(ground_truth.lower().replace(" ", "") in prediction.lower().replace(" ", ""))


# ---- f1.py ----------------------------------------------------------------------------------------------------------
def normalize_f1(s: str) -> str:
    """``f1.normalize_answer``: lowercase -> drop punctuation -> articles to " " -> collapse whitespace."""
    return normalize_exam(s.lower())


def f1_score(prediction: str, ground_truth: str) -> float:
    """``f1.f1_score``: Counter-intersection token F1 of the normalised strings, 0 without overlap."""
    pred, gold = normalize_f1(prediction).split(), normalize_f1(ground_truth).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


# ---- rouge.py -------------------------------------------------------------------------------------------------------
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


@cache
def _rouge_scorer():
    import logging

    from rouge_score import rouge_scorer

    logging.getLogger("absl").setLevel(logging.WARNING)
    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measure (0-1) of ``rouge_score`` with its default tokenizer (lowercase, ``[a-z0-9]+`` tokens)
    and no stemming, as ``compute_rouge(..., use_stemmer=False)``. Upstream first joins ``nltk.sent_tokenize``
    sentences with newlines; that only matters for ROUGE-Lsum (computed upstream, never reported): punkt splits only
    after ``.?!`` followed by space or punctuation, never inside a ``[a-z0-9]`` run, so these three scores are the
    same with or without it, and nltk's punkt data is not needed."""
    scores = _rouge_scorer().score(reference, prediction)
    return {name: scores[name].fmeasure for name in ROUGE_TYPES}


# ---- auto_eval.py pre-processing --------------------------------------------------------------------------------
def process_output_mc(response: str, multi_answer: bool) -> str:
    """``process_output_mc`` (coursera, quality, tpo; ``multi_answer`` = "coursera" in the file name).

    Blank -> "None". A response that is a substring of "ABCD" is kept ("AB" too). Single-answer tasks: the first of
    A-D anywhere ("Answer: C" gives "A"). Otherwise (coursera, or no A-D at all): the leading run of A-D letters if it
    has two or more (sorted, deduplicated); else that run plus every capital followed by whitespace, "." or ")"
    before the first "Question", keeping A-D (sorted, deduplicated); else the first run of A-D letters anywhere;
    else "A" (upstream's random guess).
    """
    if len(response.strip()) == 0:
        return "None"
    if response in _OPTIONS:
        return response
    if not multi_answer:
        for ch in response:
            if ch in _OPTIONS:
                return ch
    cleaned, rest = "", response
    for ch in response:  # the leading run; ``rest`` loses one character per letter taken, as upstream
        if ch not in _OPTIONS:
            break
        cleaned += ch
        rest = rest[1:]
    if len(cleaned) > 1:
        return "".join(sorted(set(cleaned)))
    rest = rest.split("Question")[0]
    cleaned += " ".join(_OPTION_LETTER.findall(rest)).strip()
    cleaned = "".join(sorted(set(re.sub(r"[^A-D]", "", cleaned))))
    if not cleaned:
        taking = False
        for ch in rest:
            if ch in _OPTIONS:
                cleaned += ch
                taking = True
            elif taking:
                break
    return cleaned or "A"


def process_gt_mc(response: str) -> str:
    """``process_gt_mc``: the first whitespace token with everything but A-D removed ("(B) text" -> "B"), or "A"."""
    return re.sub(r"[^A-D]", "", response.split()[0]) or "A"


def process_math(response: str) -> str:
    """``process_math`` (gsm100, both sides): the token after "The answer is", else the last space-separated token
    with a digit in the first paragraph; then its digits up to the first "." ("1,234.50" -> "1234")."""
    match = re.search(r"The answer is (\S+)", response)
    if match:
        token = match.group(1)
    else:
        words = response.split("\n\n")[0].split(" ")[::-1]
        token = next((w for w in words if any(ch.isdigit() for ch in w)), "")
    digits = ""
    for ch in token:
        if ch.isdigit():
            digits += ch
        if ch == ".":
            break
    return digits


def process_gt_code(response: str) -> str:
    """``process_gt_code`` (codeU): whitespace runs to one space; drop "," "'" "\\" and ".0"; join "] [", "[ [",
    "] ]"."""
    response = re.sub(r"\s+", " ", response)
    for old, new in ((",", ""), ("'", ""), ("\\", ""), (".0", ""), ("] [", "]["), ("[ [", "[["), ("] ]", "]]")):
        response = response.replace(old, new)
    return response


def process_output_code(response: str, ground_truth: str) -> str:
    """``process_output_code`` (codeU): ``process_gt_code``, drop filler phrases (and every "is", even inside words),
    then the ``len(gt.split()) + 3`` whitespace tokens after the last "the final output", else the last ones."""
    n = len(ground_truth.split()) + 3
    response = process_gt_code(response)
    for filler in ("will be", "of the code", "is", "would be", "the value of", "the result of", "printed"):
        response = response.replace(filler, "")
    if "the final output" in response:
        return " ".join(re.split(r"\s+", response.split("the final output")[-1])[:n])
    return " ".join(re.split(r"\s+", response)[-n:])


# ---- sci_fi (loyalty to the document, and real-world fact) ----------------------------------------------------------
def judge_parts(text: str) -> tuple[str, str]:
    """``process_gt_judge``: lowercase, split at "[fact:"; the loyalty part and the fact part without its last
    character (the closing "]"), both stripped. A text without "[fact:" gives an empty fact part (upstream raises
    IndexError there)."""
    parts = text.lower().split("[fact:")
    return parts[0].strip(), (parts[1][:-1].strip() if len(parts) > 1 else "")


def judge_word(text: str) -> str:
    """``process_output_judge`` for one part: the first whitespace token containing "true" ("true") or "false"
    ("false"), checked in that order per token; "<error>" if none (upstream: no random guess here)."""
    for word in text.lower().split():
        if "true" in word:
            return "true"
        if "false" in word:
            return "false"
    return "<error>"


__all__ = [
    "ROUGE_TYPES", "exact_match_score", "f1_score", "judge_parts", "judge_word", "normalize_exam", "normalize_f1",
    "process_gt_code", "process_gt_mc", "process_math", "process_output_code", "process_output_mc", "rouge_scores",
]
