"""The declaration of LongBench, LongBench-E and LongBench-zh (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=50,
    tasks=(
        TaskEntry("longbench", "kvbench.tasks.longbench:LongBenchTask", Rescorer(
            "kvbench.tasks.longbench.scoring:score_records", rank=1,
        )),
        TaskEntry("longbench_e", "kvbench.tasks.longbench:LongBenchETask", Rescorer(
            "kvbench.tasks.longbench.scoring:score_records_e", rank=2,
        )),
        TaskEntry("longbench_zh", "kvbench.tasks.longbench:LongBenchZhTask"),
    ),
    readme=(
        ReadmeRow(
            configs=("longbench", "longbench_e", "longbench_zh"),
            protocol=("LongBench v1 (16 English datasets by default; the 5 Chinese ones) and LongBench-E: official "
                      "prompts, per-dataset max lengths, chat-template exceptions, first-line rule, official metric "
                      "semantics (pltrdy ROUGE, jieba, difflib fuzzywuzzy)"),
            metric="per dataset × 100, category and overall means (LongBench-E also per length bucket)",
        ),
    ),
)
