"""The declaration of the lm-evaluation-harness tasks (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=110,
    tasks=(
        TaskEntry("gsm8k", "kvbench.tasks.lmeval:GSM8KTask"),
        TaskEntry("coqa", "kvbench.tasks.lmeval:CoQATask"),
        TaskEntry("truthfulqa", "kvbench.tasks.lmeval:TruthfulQATask"),
    ),
    readme=(
        ReadmeRow(
            configs=("gsm8k", "coqa", "truthfulqa"),
            protocol=("EleutherAI lm-evaluation-harness tasks (prompts, filters, scorers, aggregation untouched) on "
                      "kvbench's compressed model (`[lmeval]` extra)"),
            metric="lm-eval's metrics (`exact_match,strict-match`, `em`, `bleu_max` by default)",
        ),
    ),
)
