"""The declaration of InfiniteBench (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=70,
    tasks=(
        TaskEntry("infinitebench", "kvbench.tasks.infinitebench:InfiniteBenchTask", Rescorer(
            "kvbench.tasks.infinitebench.scoring:score_records", rank=3,
        )),
    ),
    readme=(
        ReadmeRow(
            configs=("infinitebench",),
            protocol=("InfiniteBench, the 12 tasks: official open-model templates without chat template, 128K middle "
                      "truncation (`task.truncate_to`), max new tokens per task, the `compute_scores.py` scorers with "
                      "their label types and first-letter multiple-choice rule"),
            metric="per task × 100 (and the official mean in [0, 1]), mean over tasks",
        ),
    ),
)
