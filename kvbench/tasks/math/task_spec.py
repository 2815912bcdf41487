"""The declaration of the reasoning math tasks (kvbench.tasks.spec): names and README rows."""

from kvbench.tasks.spec import ReadmeRow, TaskEntry, TaskSpec

SPEC = TaskSpec(
    rank=120,
    tasks=(
        TaskEntry("math500", "kvbench.tasks.math:Math500Task"),
        TaskEntry("aime24", "kvbench.tasks.math:Aime24Task"),
        TaskEntry("aime25", "kvbench.tasks.math:Aime25Task"),
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
