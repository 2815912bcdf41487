"""The declaration of LongBench v2 (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=60,
    tasks=(
        TaskEntry("longbench_v2", "kvbench.tasks.longbench_v2:LongBenchV2Task", Rescorer(
            "kvbench.tasks.longbench_v2.scoring:score_records", rank=7,
            single_task=True, aliases={"prediction": ("prediction", "response"), "answers": ("answers", "answer")},
        )),
    ),
    readme=(
        ReadmeRow(
            configs=("longbench_v2",),
            protocol=("LongBench v2 (THUDM/LongBench@2e00731 `pred.py`): the official 0-shot and CoT prompts "
                      "(`task.cot`, the CoT's two requests), middle truncation to 120000 tokens, chat template, hub "
                      "`THUDM/LongBench-v2` or a local `data.json` / `.jsonl`"),
            metric=("`extract_answer` accuracy × 100, overall and per difficulty (easy / hard) and length (short / "
                    "medium / long) as `result.py`"),
        ),
    ),
)
