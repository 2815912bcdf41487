"""GSM8K, CoQA and TruthfulQA through EleutherAI's lm-evaluation-harness (optional extra: pip install -e .[lmeval]).

Importing this package does not import lm-eval; a task checks for it in ``validate()`` (before any model loads).
"""

from kvbench.tasks.lmeval.coqa import CoQATask
from kvbench.tasks.lmeval.gsm8k import GSM8KTask
from kvbench.tasks.lmeval.harness import INSTALL_HINT, LM_EVAL_PIN
from kvbench.tasks.lmeval.task import LMEvalTask
from kvbench.tasks.lmeval.truthfulqa import TruthfulQATask

__all__ = ["INSTALL_HINT", "LM_EVAL_PIN", "CoQATask", "GSM8KTask", "LMEvalTask", "TruthfulQATask"]
