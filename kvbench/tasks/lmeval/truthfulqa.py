"""TruthfulQA through lm-eval (Lin et al. 2022; D2O Sec. 5.1 / Figure 5, Tables 10-11: "TruthfulQA (BLEU)")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.tasks.lmeval.task import LMEvalTask


@dataclass
class TruthfulQATask(LMEvalTask):
    """lm-eval ``truthfulqa_gen`` (v3: 817 questions, 0-shot after the 6-question QA primer, greedy until
    "\\n\\n"; sacrebleu sentence BLEU and rouge-score ROUGE-1/2/Lsum against the correct and incorrect references:
    ``*_max`` over the correct ones, ``*_acc`` = correct max > incorrect max, ``*_diff``). D2O reports "BLEU" without
    saying which: ``bleu_max,none`` (the BLEU score; its numbers, 26-45, fit either) is the default,
    ``primary_metric=bleu_acc,none`` the other reading. ``lm_eval_task=truthfulqa_mc1|truthfulqa_mc2`` (``acc,none``,
    loglikelihoods of the answer choices) is the multiple-choice variant."""

    name: ClassVar[str] = "truthfulqa"
    LM_EVAL_TASKS: ClassVar[dict[str, tuple[str, str, str]]] = {
        "truthfulqa_gen": ("truthfulqa/truthfulqa_gen.yaml", "truthfulqa_gen", "bleu_max,none"),
        "truthfulqa_mc1": ("truthfulqa/truthfulqa_mc1.yaml", "truthfulqa_mc", "acc,none"),
        "truthfulqa_mc2": ("truthfulqa/truthfulqa_mc2.yaml", "truthfulqa_mc", "acc,none"),
    }

    lm_eval_task: str = "truthfulqa_gen"
