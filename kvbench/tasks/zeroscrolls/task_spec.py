"""The declaration of ZeroSCROLLS (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=90,
    tasks=(
        TaskEntry("zeroscrolls", "kvbench.tasks.zeroscrolls:ZeroScrollsTask", Rescorer(
            "kvbench.tasks.zeroscrolls.scoring:score_records", rank=6,
        )),
    ),
    readme=(
        ReadmeRow(
            configs=("zeroscrolls",),
            protocol=("ZeroSCROLLS (tau-nlp/zero_scrolls) on the labelled validation split: the dataset's prompts, "
                      "upstream's truncation and generation budgets per task"),
            metric=("ROUGE / F1 / accuracy / exponential similarity / concordance index per task × 100, their mean "
                    "(KVMerger Table 6)"),
        ),
    ),
)
