"""Passkey retrieval, InfiniteBench protocol (OpenBMB/InfiniteBench), with the data generated here at any length.

InfiniteBench's ``passkey`` set is built by ``data/construct_synthetic_dataset.py::build_passkey`` (the
Landmark-attention haystack): ``noise * j + needle + noise * (n - j)`` with a 5-digit key of random digits, asked
with the open-model template ``yarn_mistral_templates["passkey"]`` (no chat template), 6 new tokens, scored with
``first_int_match``. Its released data exists only at 128K/256K tokens; here the number of noise units ``n`` is
fitted to each requested length with the model's tokenizer, and ``j = round(n * depth / 100)``.
reference/benchmarks.md section 2 and Appendix B.1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.errors import ConfigError
from kvbench.metrics import first_int_match
from kvbench.tasks import (
    check_common,
    check_depths,
    check_int,
    check_int_list,
    depth_label,
    grid_scores,
    linear_depths,
    mean_score,
    protocol_fields,
)
from kvbench.tasks.base import Sample, Task, question_after

# ---- the protocol as data (InfiniteBench, verbatim) ----
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key?"
# src/prompt.py::yarn_mistral_templates["passkey"]; its tail is the answer prefix.
TEMPLATE = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is"
)
ANSWER_PREFIX = "The pass key is"
KEY_DIGITS = 5


def make_key(rng: random.Random) -> str:
    """Five independent random digits, as ``build_passkey`` (so a key may start with 0)."""
    return "".join(str(rng.randint(0, 9)) for _ in range(KEY_DIGITS))


def build_context(units: int, depth: float, key: str) -> tuple[str, int]:
    """``noise * j + needle + noise * (units - j)`` with ``j = round(units * depth / 100)``; returns (text, j)."""
    before = round(units * depth / 100)
    return NOISE * before + NEEDLE.format(key=key) + NOISE * (units - before), before


def fit_units(count_tokens: Callable[[int], int], max_tokens: int) -> int:
    """Largest number of noise units whose prompt has at most ``max_tokens`` tokens (0 if even none fits).

    Estimated from the per-unit token count, then corrected one unit at a time, so long contexts cost a few
    tokenizer calls rather than a search over all sizes.
    """
    base = count_tokens(0)
    probe = 16
    per_unit = max((count_tokens(probe) - base) / probe, 1e-9)
    units = max(int((max_tokens - base) / per_unit), 0)
    while units > 0 and count_tokens(units) > max_tokens:
        units -= 1
    while count_tokens(units + 1) <= max_tokens:
        units += 1
    return units


@dataclass
class PasskeyTask(Task):
    """InfiniteBench passkey at any length: accuracy (x100) per (context length, depth) cell.

    context_lengths: prompt sizes in tokens, counted on the raw prompt (template + haystack + question + "The pass
        key is", the tokenizer's default special tokens included, chat-template tokens not). Each prompt is the
        longest that fits, so it is at most one noise unit (about 25 tokens) short. InfiniteBench itself: 128K.
    depths / n_depths: needle depth in percent of the noise units; null -> ``np.round(np.linspace(0, 100, n))``.
    repeats: keys per cell (InfiniteBench: 5). seed: keys are drawn from ``random.Random`` seeded with
        ``(seed, length, depth, repeat)``, so a cell gets the same key whatever else the grid holds.
    max_new_tokens: 6, InfiniteBench's value (a 5-digit key is at most 6 tokens after "The pass key is" for
        per-digit tokenizers, fewer for Llama-3); the score reads only the first digit run anyway.
    chat_template: false is InfiniteBench (open models: no chat template). true puts the template, up to the
        question, into the user turn and starts the assistant turn with "The pass key is".
    """

    name: ClassVar[str] = "passkey"
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "first_int_match"
    separable_question: ClassVar[bool] = True  # "\n\nWhat is the pass key?" follows the haystack
    score_scale: ClassVar[float] = 100.0  # 0/1 per key, accuracy in percent

    context_lengths: list[int] = field(default_factory=lambda: [1000, 1500, 2000])
    depths: list[float] | None = None
    n_depths: int = 11
    repeats: int = 1
    seed: int = 42
    max_new_tokens: int = 6
    chat_template: bool = False
    stop_strings: list[str] = field(default_factory=list)
    truncate_to: int | None = None

    def validate(self) -> None:
        check_common(self)
        check_int_list(self.name, "context_lengths", self.context_lengths, minimum=64)
        check_depths(self.name, self.depths, self.n_depths)
        check_int(self.name, "repeats", self.repeats)
        check_int(self.name, "seed", self.seed, minimum=0)

    def depth_list(self) -> list[float]:
        return linear_depths(self.depths, self.n_depths)

    def render(self, context: str) -> tuple[str, str]:
        """(user prompt, assistant prefix): raw mode keeps the template verbatim (prompt + prefix == template);
        chat mode ends the user turn at the question."""
        full = TEMPLATE.format(context=context, input=QUESTION)
        head = full[: -len(ANSWER_PREFIX)]
        return (head.rstrip("\n") if self.chat_template else head), ANSWER_PREFIX

    def samples(self, tokenizer: Any) -> list[Sample]:
        out = []
        for length in self.context_lengths:
            for depth in self.depth_list():
                for repeat in range(self.repeats):
                    rng = random.Random(f"passkey/{self.seed}/{length}/{depth_label(depth)}/{repeat}")
                    key = make_key(rng)

                    def count(units: int, depth: float = depth, key: str = key) -> int:
                        raw = TEMPLATE.format(context=build_context(units, depth, key)[0], input=QUESTION)
                        return len(tokenizer.encode(raw))

                    units = fit_units(count, length)
                    if count(units) > length:
                        raise ConfigError(
                            f"task 'passkey': context_lengths {length} is shorter than the prompt without any "
                            f"haystack ({count(0)} tokens with this tokenizer)"
                        )
                    context, before = build_context(units, depth, key)
                    prompt, prefix = self.render(context)
                    out.append(
                        Sample(
                            id=f"L{length}_D{depth_label(depth)}_R{repeat}",
                            prompt=prompt,
                            question=question_after(prompt, context),
                            answers=[key],
                            assistant_prefix=prefix,
                            meta={
                                "context_length": length,
                                "depth": depth,
                                "repeat": repeat,
                                "noise_units": units,
                                "needle_unit_index": before,
                                "raw_prompt_tokens": count(units),
                            },
                        )
                    )
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return first_int_match(prediction, sample.answers[0])

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Accuracy x100 over all samples (InfiniteBench prints the mean in [0, 1]) and per (length, depth) cell."""
        return {
            "score": mean_score(records, scale=self.score_scale, digits=2),
            "n": len(records),
            "grid": grid_scores(records, scale=100.0, digits=2),
        }

    def protocol(self) -> dict[str, Any]:
        return {**super().protocol(), **protocol_fields(self), "depths": self.depth_list()}


__all__ = ["ANSWER_PREFIX", "NEEDLE", "NOISE", "QUESTION", "TEMPLATE", "PasskeyTask", "build_context", "make_key"]
