"""The declaration of RULER (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=40,
    tasks=(
        TaskEntry("ruler", "kvbench.tasks.ruler:RulerTask", Rescorer(
            "kvbench.tasks.ruler.scoring:score_records", rank=4,
        )),
    ),
    readme=(
        ReadmeRow(
            configs=("ruler",),
            protocol=("RULER's 13 tasks generated for the model's tokenizer at any length (byte-identical to the "
                      "official generator for the same tokenizer/seed/template), pinned word lists, official templates "
                      "and answer prefixes"),
            metric="string_match_all / _part × 100 per task, averages per length",
        ),
    ),
)
