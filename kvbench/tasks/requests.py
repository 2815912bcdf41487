"""What a task asks of the model, as data: the requests a task that drives its own loop sends, and the answers it gets.

A task never builds a session or a method and never calls the engine (``tests/test_layers.py``): like lm-eval's
tasks it describes what it needs and the job runner answers with the engine, under the job's method and budget
(``kvbench.jobs.answer.EngineAnswerer``). Tasks that are generate-then-score need none of this (the runner generates
for them); the others implement ``Task.evaluate(batch, answerer)`` and call the ``Answerer`` they are handed:

* ``GenerateUntil``: greedy generation for a batch of token prompts, up to ``max_new_tokens``, a row ending at EOS or
  once one of ``stop_strings`` appears in its decoded tail (LongBench v2's CoT, lm-eval's ``generate_until``).
* ``TeacherForced``: the log-probability of each given token of a stream, read from the forward that fed the token
  before it, **before** that forward's eviction (PG-19's streaming perplexity: ``score_from=1``; lm-eval's
  ``loglikelihood`` of a continuation given its context: ``score_from=prefill``).
* ``full_cache=True`` on either: a FullKV pass, the full uncompressed cache whatever the job's method and budget
  (LongBench v2's CoT answer request, which holds no document: the method acts where the document is read).

Shapes: prompts and streams are token ids; ``TokenLogProbs.logprobs`` is a ``(N - score_from,)`` float32 tensor and
``greedy`` a bool tensor of the same length (whether each token was the argmax). Every answer carries the cache and
timing statistics of its forward passes (``AnswerStats``), which the task copies into its records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class GenerateUntil:
    """Greedy generation for ``prompts`` (a left-padded batch).

    prompts: token ids per row (already encoded: chat template, truncation).
    max_new_tokens: the most new tokens per row.
    stop_strings: a row stops once the decoded text of its last ``stop_tail`` tokens contains one of them.
    full_cache: run with the full cache (FullKV) instead of the job's method and budget.
    """

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    stop_tail: int = 8
    full_cache: bool = False


@dataclass(frozen=True)
class TeacherForced:
    """Teacher-forced log-probabilities of ``ids[score_from:]``: ``ids[:prefill]`` is one prefill forward (compressed
    at its end, as a prompt), then one token per forward; each token's log-probability is read before the eviction
    of the forward that fed the token before it (``kvbench.engine.teacher_forcing``).

    A token stream: ``score_from=1`` (every token after the first). A continuation given its context:
    ``prefill=score_from=len(context)``.
    """

    ids: tuple[int, ...]
    prefill: int
    score_from: int = 1
    full_cache: bool = False


@dataclass(frozen=True)
class AnswerStats:
    """What the runner records of a request's forward passes: seconds, single-token forwards after the prefill,
    resident KV bytes after the prefill's compression and at the end, entries per layer after the prefill, and the
    mean number of tokens each query attended (unrounded)."""

    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    resident_kv_bytes: int
    resident_kv_bytes_final: int
    layer_entries: list[int]
    attended_tokens_mean: float

    def record_fields(self) -> dict[str, Any]:
        """These stats as a record stores them (``attended_tokens_mean`` to 2 decimals)."""
        return {"prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "decode_steps": self.decode_steps, "resident_kv_bytes": self.resident_kv_bytes,
                "resident_kv_bytes_final": self.resident_kv_bytes_final, "layer_entries": self.layer_entries,
                "attended_tokens_mean": round(self.attended_tokens_mean, 2)}


@dataclass(frozen=True)
class Generation:
    """The new tokens of each row of a ``GenerateUntil`` (up to its first EOS, which is not included)."""

    tokens: list[list[int]]
    stats: AnswerStats


@dataclass(frozen=True)
class TokenLogProbs:
    """The answer to a ``TeacherForced``: ``logprobs`` and ``greedy`` of ``ids[score_from:]``."""

    logprobs: Any
    greedy: Any
    stats: AnswerStats


class Answerer(Protocol):
    """What a task's ``evaluate`` is handed: the job's tokenizer, model spec and budget, and the two requests.

    tokenizer: the model's tokenizer (``kvbench.models.LoadedModel.tokenizer``); spec: its ``ModelSpec``
    (``context_length``, chat template); budget: the job's ``kvbench.budget.Budget`` (a task whose request shape
    depends on it, PG-19's prefill length, reads it).
    """

    tokenizer: Any
    spec: Any
    budget: Any

    def generate(self, request: GenerateUntil) -> Generation: ...

    def loglikelihood(self, request: TeacherForced) -> TokenLogProbs: ...


__all__ = ["AnswerStats", "Answerer", "GenerateUntil", "Generation", "TeacherForced", "TokenLogProbs"]
