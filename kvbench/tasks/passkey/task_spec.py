"""The declaration of passkey retrieval (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=20,
    tasks=(
        TaskEntry("passkey", "kvbench.tasks.passkey:PasskeyTask", Rescorer(
            "kvbench.tasks.rescoring:passkey", rank=11,
            single_task=True, cell_fields=("context_length", "depth"),
        )),
    ),
    readme=(
        ReadmeRow(
            configs=("passkey",),
            protocol="InfiniteBench passkey, generated at any length × depth",
            metric="first-integer match, %",
        ),
    ),
)
