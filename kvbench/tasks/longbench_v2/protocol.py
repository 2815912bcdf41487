"""The LongBench v2 protocol as data: the official prompt templates (``prompts/``, verbatim from
THUDM/LongBench@2e00731 ``prompts/0shot.txt``, ``0shot_cot.txt``, ``0shot_cot_ans.txt``) and ``pred.py``'s settings.

``fill`` is ``pred.py``'s prompt assembly: the template's placeholders replaced *in sequence* (``$DOC$``, ``$Q$``,
``$C_A$`` .. ``$C_D$``, then ``$COT$``) by the stripped fields, so a placeholder that appears inside an earlier field
(a context quoting ``$Q$``) is replaced too, as upstream's chain of ``str.replace`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPTS = Path(__file__).with_name("prompts")
TEMPLATE_0SHOT = (PROMPTS / "0shot.txt").read_text(encoding="utf-8")
TEMPLATE_0SHOT_COT = (PROMPTS / "0shot_cot.txt").read_text(encoding="utf-8")
TEMPLATE_0SHOT_COT_ANS = (PROMPTS / "0shot_cot_ans.txt").read_text(encoding="utf-8")

#: THUDM/LongBench@2e00731 (LongBench v2: pred.py, result.py, prompts/, config/model2maxlen.json)
SOURCE = "THUDM/LongBench@2e00731f8d0bff23dc4325161044d0ed8af94c1e"
HUB_REPO = "THUDM/LongBench-v2"
HUB_SPLIT = "train"
#: config/model2maxlen.json: 120000 for every open model listed (Claude 3.5 Sonnet: 200000)
MAX_LENGTH = 120000
#: pred.py: max_new_tokens of the answer (no CoT, and the CoT's second step) and of the CoT itself
MAX_NEW_TOKENS = 128
COT_MAX_NEW_TOKENS = 1024
CHOICES = ("A", "B", "C", "D")
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question", "choice_A", "choice_B", "choice_C",
          "choice_D", "answer", "context")


def fill(template: str, row: dict[str, Any], cot: str | None = None) -> str:
    """``pred.py``: ``template.replace('$DOC$', context.strip()).replace('$Q$', question.strip())`` ... then
    ``.replace('$COT$', response)`` for the CoT's second step (``cot``: the first step's stripped output)."""
    text = (template.replace("$DOC$", row["context"].strip()).replace("$Q$", row["question"].strip())
            .replace("$C_A$", row["choice_A"].strip()).replace("$C_B$", row["choice_B"].strip())
            .replace("$C_C$", row["choice_C"].strip()).replace("$C_D$", row["choice_D"].strip()))
    return text.replace("$COT$", cot) if cot is not None else text


def truncate_ids(ids: list[int], max_length: int) -> list[int]:
    """``query_llm``: ``input_ids[:max_len//2] + input_ids[-max_len//2:]`` when longer than ``max_len``. Python's
    ``-max_len//2`` is ``(-max_len)//2``, so an odd budget keeps one token more at the end: ``max_len`` in all."""
    if len(ids) <= max_length:
        return list(ids)
    return list(ids[: max_length // 2]) + list(ids[-max_length // 2 :])


__all__ = ["CHOICES", "COT_MAX_NEW_TOKENS", "DIFFICULTIES", "FIELDS", "HUB_REPO", "HUB_SPLIT", "LENGTHS",
           "MAX_LENGTH", "MAX_NEW_TOKENS", "SOURCE", "TEMPLATE_0SHOT", "TEMPLATE_0SHOT_COT", "TEMPLATE_0SHOT_COT_ANS",
           "fill", "truncate_ids"]
