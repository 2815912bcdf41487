"""The declaration of the reasoning math tasks (kvbench.tasks.spec): names, re-scoring, README rows."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

# where R-KV's / TriAttention's output files (output, answer) and kvpress's columns (predicted_answer) keep the fields
ALIASES = {"prediction": ("prediction", "output", "predicted_answer"), "answers": ("answers", "answer", "gt")}

SPEC = TaskSpec(
    rank=120,
    tasks=(
        TaskEntry("math500", "kvbench.tasks.math:Math500Task", Rescorer(
            "kvbench.tasks.math.scoring:math500", rank=13, single_task=True, aliases=ALIASES)),
        TaskEntry("aime24", "kvbench.tasks.math:Aime24Task", Rescorer(
            "kvbench.tasks.math.scoring:aime24", rank=14, single_task=True, aliases=ALIASES)),
        TaskEntry("aime25", "kvbench.tasks.math:Aime25Task", Rescorer(
            "kvbench.tasks.math.scoring:aime25", rank=15, single_task=True, aliases=ALIASES)),
    ),
    readme=(
        ReadmeRow(
            configs=("math500", "aime24", "aime25"),
            protocol=("Reasoning traces: MATH-500, AIME 2024 / 2025 with TriAttention's protocol (R-KV's prompt, no "
                      "chat template, temperature 0.6 / top-p 0.95, n = 1 / 8, 8K / 32K tokens); kvpress's and "
                      "R-KV's as overrides"),
            metric="math-verify 0.9 equivalence of the answer after `</think>`, accuracy × 100 (pass@1, maj@n)",
        ),
    ),
)
