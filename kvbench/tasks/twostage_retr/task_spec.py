"""The declaration of OmniKV's two-stage retrieval (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=30,
    tasks=(
        TaskEntry("2stageretr", "kvbench.tasks.twostage_retr:TwoStageRetrTask", Rescorer(
            "kvbench.tasks.rescoring:twostage_retr", rank=12,
            single_task=True, cell_fields=("dict_len",),
        )),
    ),
    readme=(
        ReadmeRow(
            configs=("2stageretr",),
            protocol="OmniKV's two-stage retrieval, seeded generator",
            metric="substring accuracy, %",
        ),
    ),
)
