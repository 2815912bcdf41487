"""Prompt encoding shared by every task: middle truncation of the raw prompt, then chat template on/off.

The order is LongBench's (``pred.py``; reference/benchmarks.md section 0 item 4 and section 1.2): the *raw* prompt
is truncated in the middle (decode + re-encode), and only then wrapped in the chat template, so template tokens
come on top of the budget. InfiniteBench does the same with ``TRUNCATE_LEN``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbench.errors import ConfigError
from kvbench.models.spec import ModelSpec
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.text import middle_truncate


def prompt_token_budget(task: Task, spec: ModelSpec, sample: Sample | None = None) -> int:
    """Tokens the raw prompt may keep before middle truncation.

    ``task.truncate_to`` or else ``spec.max_input_tokens`` is a prompt budget already (LongBench ``model2maxlen``:
    3500 for a 4k model, which leaves room for up to 596 new tokens) and is used as it is, capped at
    ``context_length - max_new_tokens`` so that prompt and answer fit the model's window; without either, that cap
    is the budget. (InfiniteBench reserves nothing, so at exactly its 128K budget on a 128K model the cap is 6
    tokens stricter.)
    """
    new_tokens = task.max_new_tokens_for(sample) if sample is not None else task.max_new_tokens
    window = int(spec.context_length) - int(new_tokens)
    if window < 1:  # e.g. InfiniteBench math_calc (30000 new tokens) on an 8K model
        which = f"sample {sample.id!r}" if sample is not None else "its samples"
        raise ConfigError(f"task {task.name!r}: {which} may generate {new_tokens} new tokens, more than model "
                          f"{spec.name!r}'s context of {spec.context_length} tokens; select other datasets or a "
                          f"longer-context model")
    explicit = task.truncate_to or spec.max_input_tokens
    return min(int(explicit), window) if explicit else window


def uses_chat_template(task: Task, spec: ModelSpec, tokenizer: Any, sample: Sample | None = None) -> bool:
    """The chat template applies when the task asks for it (for this sample), the model config allows it and the
    tokenizer has one."""
    wanted = task.chat_template_for(sample) if sample is not None else task.chat_template
    return bool(wanted and spec.chat_template and getattr(tokenizer, "chat_template", None))


def render_prompt(task: Task, sample: Sample, tokenizer: Any, spec: ModelSpec) -> tuple[str, bool]:
    """The full prompt text (after truncation and chat template, with the assistant prefix) and whether the chat
    template was applied (then the text already holds the special tokens and is encoded without adding more)."""
    prompt = task.truncate_prompt(sample, tokenizer, prompt_token_budget(task, spec, sample))
    if uses_chat_template(task, spec, tokenizer, sample):
        messages = [{"role": "system", "content": sample.system}] if sample.system else []
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text + sample.assistant_prefix, True
    return prompt + sample.assistant_prefix, False


def encode_sample(task: Task, sample: Sample, tokenizer: Any, spec: ModelSpec) -> list[int]:
    """Token ids of one sample as the task's protocol feeds them to ``spec``'s model.

    1. Fit ``sample.prompt`` into ``prompt_token_budget(task, spec)`` tokens: ``task.truncate_prompt`` (middle
       truncation unless the task cuts its own way).
    2. Chat template on (``task.chat_template and spec.chat_template`` and the tokenizer has one):
       ``apply_chat_template([system?, user], add_generation_prompt=True, tokenize=False) + assistant_prefix``,
       encoded with ``add_special_tokens=False`` (the template carries BOS where the model wants it).
       Off: ``prompt + assistant_prefix`` encoded with the tokenizer's default special tokens (BOS for Llama).
    """
    text, templated = render_prompt(task, sample, tokenizer, spec)
    if templated:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any stop string."""
    end = len(text)
    for stop in stop_strings:
        if stop:
            index = text.find(stop)
            if index != -1:
                end = min(end, index)
    return text[:end]


def decode_prediction(task: Task, token_ids: Sequence[int], tokenizer: Any, sample: Sample | None = None) -> str:
    """Generated ids -> raw prediction: decoded skipping special tokens, cut at the first stop string (the
    sample's own where it has them, else ``task.stop_strings``).

    ``task.postprocess`` (e.g. ``strip``) runs after this, before scoring.
    """
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    return cut_at_stop(text, task.stop_strings_for(sample) if sample is not None else task.stop_strings)


__all__ = [
    "cut_at_stop", "decode_prediction", "encode_sample", "middle_truncate", "prompt_token_budget", "render_prompt",
    "uses_chat_template",
]
