"""The task contract: a benchmark is mostly data (prompts, max lengths, metric names) plus small scorers.

A task yields ``Sample``s; the runner turns each into token ids with ``encode_sample`` (chat template on/off and
middle truncation as the protocol says), generates, then calls ``task.score`` per sample and
``task.aggregate`` over all records. ``Task.version`` is the protocol version: it is part of the result key, so
changing a prompt or a scorer must bump it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvbench.tasks.requests import Answerer


@dataclass
class Sample:
    """One benchmark item.

    id: stable and unique within the task (records are resumed by id).
    prompt: the user text *before* any chat template (the question is inside it unless the protocol says not).
    answers: reference answers; scorers take the max over them where the protocol does.
    meta: anything the aggregate needs (context length, depth, dataset, ...); stored in the record.
    system: system prompt for the chat template, or None for the tokenizer's default.
    assistant_prefix: text that starts the answer (after the chat template's assistant header, or appended to a
        raw prompt), e.g. "The pass key is".
    max_new_tokens / stop_strings: per-sample generation settings where a benchmark's protocol varies them by
        sub-dataset (LongBench's dataset2maxlen, samsum's newline stop); None means the task's own.
    question: the tail of ``prompt`` that comes after the context (``prompt == context + question``), or None where
        the task cannot separate it; ``question=after_compression`` feeds it after the context was compressed.
    follow_ups / turn_answers: multi-turn samples (``turns=N``): the user text of turns 2..N, and the reference
        answers of every turn (turn 1's are ``answers``).
    """

    id: str
    prompt: str
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    assistant_prefix: str = ""
    max_new_tokens: int | None = None
    stop_strings: list[str] | None = None
    question: str | None = None
    follow_ups: list[str] = field(default_factory=list)
    turn_answers: list[list[str]] = field(default_factory=list)


def question_after(prompt: str, marker: str) -> str:
    """The tail of ``prompt`` after the last ``marker`` (the end of its context), for ``Sample.question``."""
    at = prompt.rfind(marker)
    if at < 0:
        raise ValueError(f"the prompt has no {marker!r} to end its context")
    return prompt[at + len(marker):]


def question_from(prompt: str, start: str) -> str:
    """The tail of ``prompt`` from the last ``start`` on (the question's first words), for ``Sample.question``."""
    at = prompt.rfind(start)
    if at < 0:
        raise ValueError(f"the prompt has no {start!r} to start its question")
    return prompt[at:]


class Task(ABC):
    """Base class of every benchmark task. Subclasses are dataclasses whose fields are the protocol."""

    name: str = "task"
    version: str = "1"
    metric: str = "score"  # name of the per-sample metric, e.g. "rouge1_f_x10", "accuracy"
    max_new_tokens: int = 32
    chat_template: bool = False  # apply the model's chat template to the prompt
    stop_strings: Sequence[str] = ()  # generation stops at any of these; they are cut from the prediction
    truncate_to: int | None = None  # middle-truncate prompts to this many tokens (None: model's max_input_tokens)
    #: the task's samples carry ``Sample.question`` (the prompt's tail after the context): question=after_compression
    separable_question: ClassVar[bool] = False
    #: the task asks several questions per sample on one context (``Sample.follow_ups``): turns=N
    multi_turn: ClassVar[bool] = False
    #: what the aggregate multiplies per-sample scores by (100: 0/1 scores reported in percent); sampled jobs' pass@1
    #: and maj@n (``kvbench.store.scores``) read on the same scale
    score_scale: ClassVar[float] = 1.0

    @abstractmethod
    def samples(self, tokenizer: Any) -> list[Sample]:
        """All samples of this task, in a fixed order (tokenizer-aware generators may use the tokenizer)."""

    def max_new_tokens_for(self, sample: Sample) -> int:
        return sample.max_new_tokens if sample.max_new_tokens is not None else self.max_new_tokens

    def stop_strings_for(self, sample: Sample) -> list[str]:
        return list(sample.stop_strings if sample.stop_strings is not None else self.stop_strings)

    def chat_template_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of ``tokenizer.apply_chat_template`` (a template variable such as Qwen3's
        ``enable_thinking``); none by default."""
        return {}

    def chat_template_for(self, sample: Sample) -> bool:
        """Whether this sample's prompt goes into the chat template (LongBench: not for its few-shot/code sets)."""
        return self.chat_template

    def truncate_prompt(self, sample: Sample, tokenizer: Any, max_tokens: int) -> str:
        """``sample.prompt`` fitted into ``max_tokens`` tokens, before any chat template. Default: LongBench's middle
        truncation (``kvbench.tasks.encoding.middle_truncate``). LEval and ZeroSCROLLS override it: they cut only
        their document, the way their official scripts do, and keep the question."""
        from kvbench.tasks.text import middle_truncate

        return middle_truncate(sample.prompt, tokenizer, max_tokens)

    def inseparable(self) -> list[str]:
        """Parts of this configured task (sub-datasets) whose question cannot be separated from the context, where
        ``separable_question`` holds for the rest: ``question=after_compression`` refuses them at plan time."""
        return []

    def prepare_data(self) -> None:
        """Make the data available (download, unpack) before any model loads; fails with DataError."""

    def evaluate(self, batch: list[Sample], answerer: Answerer) -> list[dict[str, Any]] | None:
        """Evaluate ``batch`` with the task's own loop instead of generation, or None (default) to generate.

        Tasks that are not generate-then-score (PG-19's streaming perplexity, lm-eval's loglikelihood requests,
        LongBench v2's two CoT requests) describe what they need as requests (``kvbench.tasks.requests``) and send
        them to ``answerer``, which the job runner answers with the engine under the job's method and budget; they
        never build a session or call the engine. They return one record per sample: ``id``, ``score``, ``meta``
        and any of the runner's statistics (``prompt_tokens``, ``new_tokens``, ``prefill_seconds``,
        ``decode_seconds``, ``decode_steps``, ``resident_kv_bytes``, ``resident_kv_bytes_final``, ``layer_entries``,
        ``attended_tokens_mean``, which each answer's ``stats`` carry; missing ones are 0).
        """
        return None

    def own_loop(self) -> bool:
        """Whether this instance evaluates with its own loop (``evaluate`` returns records) rather than the runner's
        generation: such a job decodes greedily and on the host-driven path. Default: the class overrides
        ``evaluate``; a task whose loop depends on its fields (LongBench v2's ``cot``) says so per instance."""
        return type(self).evaluate is not Task.evaluate

    def postprocess(self, prediction: str, sample: Sample) -> str:
        """Official post-processing of a raw generation before scoring (default: strip)."""
        return prediction.strip()

    @abstractmethod
    def score(self, prediction: str, sample: Sample) -> float:
        """Per-sample score of a post-processed prediction (on the task's reporting scale)."""

    def majority_key(self, prediction: str, sample: Sample) -> str:
        """The answer a sampled job's majority vote (maj@n) counts ``prediction`` (post-processed) as: equal keys are
        one answer. Default: the stripped prediction; tasks with a canonical answer form (math) override it."""
        return prediction.strip()

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Scores over all records. Default: the mean of ``record["score"]`` as ``{"score": ..., "n": ...}``."""
        values = [float(r["score"]) for r in records]
        return {"score": round(sum(values) / len(values), 4) if values else float("nan"), "n": len(values)}

    def protocol(self) -> dict[str, Any]:
        """The protocol as data (stored in meta.json and hashed into the result key)."""
        return {
            "task": self.name,
            "version": self.version,
            "metric": self.metric,
            "max_new_tokens": self.max_new_tokens,
            "chat_template": self.chat_template,
            "stop_strings": list(self.stop_strings),
            "truncate_to": self.truncate_to,
        }

    def validate(self) -> None:
        """Check fields (and that data files exist) before any model loads; raise ConfigError/DataError."""
