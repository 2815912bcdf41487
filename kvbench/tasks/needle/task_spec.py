"""The declaration of the needle-in-a-haystack protocols (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=10,
    tasks=(
        TaskEntry("needle", "kvbench.tasks.needle:NeedleTask", Rescorer(
            "kvbench.tasks.rescoring:needle", rank=8,
            single_task=True, cell_fields=("context_length", "depth"),
        )),
        TaskEntry("needle_retrieval_head", "kvbench.tasks.needle.retrieval_head:NeedleRetrievalHeadTask", Rescorer(
            "kvbench.tasks.rescoring:needle_retrieval_head", rank=9,
            single_task=True, cell_fields=("context_length", "depth"),
        )),
        TaskEntry("needle_kvpress", "kvbench.tasks.needle.kvpress:NeedleKVPressTask", Rescorer(
            "kvbench.tasks.rescoring:needle_kvpress", rank=10,
            single_task=True, cell_fields=("context_length", "depth"),
        )),
        TaskEntry("needle_multiturn", "kvbench.tasks.needle.multiturn:NeedleMultiTurnTask"),
    ),
    readme=(
        ReadmeRow(
            configs=("needle",),
            protocol="PyramidKV / KVCache-Factory needle in a haystack (raw prompt)",
            metric="ROUGE-1 F × 10",
        ),
        ReadmeRow(
            configs=("needle_chat",),
            protocol=("the same inside the chat template: the CPU default, because SmolLM2 reads the raw prompt's "
                      "literal `<|im_start|>` as a special token (FullKV: 0.30 raw vs 9.53 chat)"),
            metric="ROUGE-1 F × 10",
        ),
        ReadmeRow(
            configs=("needle_retrieval_head",),
            protocol=("Retrieval-Head repository's needle (D2O Table 3): raw prompt, period walk-back, 40 lengths × 10 "
                      "depths"),
            metric="ROUGE-1 recall × 100",
        ),
        ReadmeRow(
            configs=("needle_kvpress",),
            protocol="NVIDIA/kvpress needle: no period snapping, `<book>` wrapper, hub or offline source",
            metric="pltrdy ROUGE × 100",
        ),
        ReadmeRow(
            configs=("needle_multiturn",),
            protocol=("kvbench's multi-turn needles (SCBench-style): `turns` city → number facts in the needle essays, "
                      "one question per turn on one compressed cache (`turns=N`)"),
            metric="string match × 100, overall and per turn (`turn_scores`)",
        ),
    ),
)
