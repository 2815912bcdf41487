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
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **task.chat_template_kwargs())
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


def encode_split(task: Task, sample: Sample, tokenizer: Any, spec: ModelSpec) -> tuple[list[int], list[int]]:
    """``encode_sample`` cut in two for ``question=after_compression``: (context ids, question ids) whose
    concatenation is exactly ``encode_sample``'s ids. The question part starts at the first token of the full
    encoding that lies beyond the context text (``sample.question`` is the prompt's tail; the chat template's closing
    tokens and the assistant prefix follow it): the ids of the text before the question are encoded alone and the cut
    falls after their longest common prefix with the full ids, so a token straddling the seam stays with the context.
    """
    if not sample.question:
        raise ConfigError(f"task {task.name!r}: sample {sample.id!r} has no separable question")
    prompt = task.truncate_prompt(sample, tokenizer, prompt_token_budget(task, spec, sample))
    if not prompt.endswith(sample.question):
        raise ConfigError(f"task {task.name!r}: sample {sample.id!r} lost its question to truncation (the prompt no "
                          "longer ends with it); use a larger truncation length or question=with_context")
    text, templated = render_prompt(task, sample, tokenizer, spec)
    seam = len(prompt) - len(sample.question)
    if templated:  # where the user turn's text ended up in the template (some templates trim it)
        at = text.rfind(prompt)
        core = sample.question.strip()
        seam = at + seam if at >= 0 else text.rfind(core) if core else -1
        if seam < 0:
            raise ConfigError(f"task {task.name!r}: the chat template of model {spec.name!r} rewrote the prompt; its "
                              "question cannot be located for question=after_compression")
    full = list(tokenizer.encode(text, add_special_tokens=not templated))
    head = list(tokenizer.encode(text[:seam], add_special_tokens=not templated))
    cut = 0
    while cut < min(len(head), len(full)) and head[cut] == full[cut]:
        cut += 1
    return full[:cut], full[cut:]


def encode_follow_up(task: Task, sample: Sample, turn: int, tokenizer: Any, spec: ModelSpec) -> list[int]:
    """Ids fed for turn ``turn`` >= 1 of a multi-turn sample after the previous turn's answer: with the chat template,
    what the template puts between an assistant answer and the next assistant header (end of turn, the user turn
    with ``sample.follow_ups[turn - 1]``, the generation prompt), then the assistant prefix; without it, a newline,
    the follow-up and the assistant prefix."""
    follow_up = sample.follow_ups[turn - 1]
    if uses_chat_template(task, spec, tokenizer, sample):
        marker = "\u2063KVBENCH_ANSWER\u2063"
        messages = [{"role": "system", "content": sample.system}] if sample.system else []
        messages += [{"role": "user", "content": "context"}, {"role": "assistant", "content": marker},
                     {"role": "user", "content": follow_up}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **task.chat_template_kwargs())
        if marker not in text:
            raise ConfigError(f"task {task.name!r}: the chat template of model {spec.name!r} drops assistant turns; "
                              "multi-turn prompts cannot be built with it")
        tail = text[text.index(marker) + len(marker):]
        return list(tokenizer.encode(tail + sample.assistant_prefix, add_special_tokens=False))
    return list(tokenizer.encode("\n" + follow_up + sample.assistant_prefix, add_special_tokens=False))


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
    "cut_at_stop", "decode_prediction", "encode_follow_up", "encode_sample", "encode_split", "middle_truncate",
    "prompt_token_budget", "render_prompt", "uses_chat_template",
]
