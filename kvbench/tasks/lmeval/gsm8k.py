"""GSM8K through lm-eval (Cobbe et al. 2021; D2O Sec. 5.1 / Figure 5: "GSM8K (Exact Match Accuracy)")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.tasks.lmeval.task import LMEvalTask


@dataclass
class GSM8KTask(LMEvalTask):
    """lm-eval ``gsm8k`` (v3: 5-shot from train with seed 1234, "Question: ...\\nAnswer:", greedy until
    "Question:" / "</s>" / "<|im_end|>", up to 256 tokens; exact match after the ``strict-match`` ("#### N") and
    ``flexible-extract`` (last number) filters). D2O does not name the filter; ``strict-match`` is the default
    (the answer format the few-shot examples teach), ``primary_metric=exact_match,flexible-extract`` the other.
    Also accepts ``gsm8k_cot`` (8 fixed CoT shots) and ``gsm8k_cot_zeroshot``."""

    name: ClassVar[str] = "gsm8k"
    LM_EVAL_TASKS: ClassVar[dict[str, tuple[str, str, str]]] = {
        "gsm8k": ("gsm8k/gsm8k.yaml", "gsm8k", "exact_match,strict-match"),
        "gsm8k_cot": ("gsm8k/gsm8k-cot.yaml", "gsm8k", "exact_match,strict-match"),
        "gsm8k_cot_zeroshot": ("gsm8k/gsm8k-cot-zeroshot.yaml", "gsm8k", "exact_match,strict-match"),
    }

    lm_eval_task: str = "gsm8k"
