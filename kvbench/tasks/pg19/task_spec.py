"""The declaration of PG-19 streaming perplexity (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=100,
    tasks=(
        TaskEntry("pg19", "kvbench.tasks.pg19:PG19Task"),
    ),
    readme=(
        ReadmeRow(
            configs=("pg19",),
            protocol=("StreamingLLM `eval_long_ppl.py` streaming perplexity with the compressed cache (loss before "
                      "eviction), D2O Figure 6's cumulative NLL curve; PG-19 books from `task.data_dir` or the hub, "
                      "`task.source=essays` offline"),
            metric="perplexity `exp(mean NLL)` + curve",
        ),
    ),
)
