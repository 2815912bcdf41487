"""The declaration of LEval (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=80,
    tasks=(
        TaskEntry("leval", "kvbench.tasks.leval:LEvalTask", Rescorer(
            "kvbench.tasks.leval.scoring:score_records", rank=5,
        )),
    ),
    readme=(
        ReadmeRow(
            configs=("leval",),
            protocol=("LEval's 20 sub-tasks (OpenLMLab/LEval): the official prompts, system prompts and document "
                      "truncation; GPT-4- and human-judged rows skipped, as upstream's automatic evaluation does"),
            metric=("exam accuracy / F1 / ROUGE per sub-task × 100; Closed / QA / Summ groups and their mean (POD "
                    "Table 1)"),
        ),
    ),
)
