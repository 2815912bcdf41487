"""CoQA through lm-eval (Reddy et al. 2019; D2O Sec. 5.1 / Figure 5, Tables 4, 7-11: "CoQA (Exact Match)")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.tasks.lmeval.task import LMEvalTask


@dataclass
class CoQATask(LMEvalTask):
    """lm-eval ``coqa`` (v3: validation, 500 stories, 0-shot; the story and the conversation so far, only each
    story's last question is asked; greedy until "\\nQ:", first line of the answer; SQuAD-normalised ``em`` and
    ``f1`` with CoQA's leave-one-out over the golds). D2O reports exact match: ``em,none`` (lm-eval's 0-1 scale;
    the paper prints x100)."""

    name: ClassVar[str] = "coqa"
    LM_EVAL_TASKS: ClassVar[dict[str, tuple[str, str, str]]] = {"coqa": ("coqa/default.yaml", "coqa", "em,none")}

    lm_eval_task: str = "coqa"
