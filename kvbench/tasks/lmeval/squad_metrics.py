"""SQuAD answer normalisation and EM/F1, for lm-eval's CoQA scorer on transformers 5.

lm-eval 0.4.13's ``tasks/coqa/utils.py`` imports ``transformers.data.metrics.squad_metrics`` for ``compute_exact`` and
``compute_f1``; transformers 5 removed that module, so the CoQA task cannot even load. ``install()`` registers this
module under that name **only when the import fails**, so lm-eval's own ``process_results`` (leave-one-out over the
golds, ``results[0].strip().split("\\n")[0]``) runs unchanged.

The functions have the semantics of transformers 4.x ``data/metrics/squad_metrics.py``, which follows the official
SQuAD 2.0 evaluation script: lower-case, drop ASCII punctuation (``string.punctuation``), drop the articles
a/an/the (word boundaries), collapse whitespace; EM = normalised strings equal; F1 over whitespace tokens of the
normalised strings with multiset overlap, 1/0 when either side is empty (equal or not), 0 without overlap.
"""

from __future__ import annotations

import collections
import re
import string
import sys
import types

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)
MODULE = "transformers.data.metrics.squad_metrics"


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (in that order)."""
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def get_tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def compute_exact(a_gold: str, a_pred: str) -> int:
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    gold, pred = get_tokens(a_gold), get_tokens(a_pred)
    if not gold or not pred:  # a no-answer: 1 if both are empty, else 0
        return int(gold == pred)
    same = sum((collections.Counter(gold) & collections.Counter(pred)).values())
    if same == 0:
        return 0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def install() -> bool:
    """Make ``import transformers.data.metrics.squad_metrics`` work; True if this module had to stand in."""
    try:
        __import__(MODULE)
        return False
    except ModuleNotFoundError:
        pass
    import transformers.data as data_pkg

    package = sys.modules.get("transformers.data.metrics") or types.ModuleType("transformers.data.metrics")
    package.__path__ = []  # a namespace for the one submodule
    package.squad_metrics = sys.modules[__name__]
    sys.modules["transformers.data.metrics"] = package
    sys.modules[MODULE] = sys.modules[__name__]
    data_pkg.metrics = package
    return True


__all__ = ["compute_exact", "compute_f1", "get_tokens", "install", "normalize_answer"]
