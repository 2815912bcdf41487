"""Pieces every RULER generator shares: the prompt wrapper, RULER's token count, its haystack-size search.

RULER sizes each sample so that ``len(tokenizer.tokenize(input)) + tokens_to_generate <= max_seq_length``, where
``input`` is the *whole* prompt: model template + task text + answer prefix (``prepare.py`` builds
``Templates[model_template_type].format(task_template=...) + answer_prefix`` before the generator formats it).
The haystack size comes from a binary search (``generate_samples`` in niah.py / qa.py / ...), then each sample is
redrawn with ``incremental`` fewer haystack units while it is too long. Every draw consumes the generator's random
stream, so kvbench repeats the same draws in the same order to get the same samples for the same seed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError

PROTOCOL: dict[str, Any] = json.loads(Path(__file__).with_name("protocol.json").read_text(encoding="utf-8"))
GENERATORS: dict[str, dict[str, Any]] = PROTOCOL["generators"]  # constants.py TASKS: template, answer_prefix, ...
TASK_ARGS: dict[str, dict[str, Any]] = PROTOCOL["tasks"]  # synthetic.yaml: task name -> generator + args
MODEL_TEMPLATES: dict[str, str] = PROTOCOL["model_templates"]  # template.py Templates
TEMPLATES = ("chat", *MODEL_TEMPLATES)
MAX_FLOOR_RETRIES = 50  # RULER retries forever at the smallest size; kvbench stops with an error


@dataclass
class Prompting:
    """How a task text becomes the prompt RULER counts and the model reads.

    template: ``chat`` (kvbench default: the tokenizer's chat template around the task text, the answer prefix
        after the assistant header) or one of RULER's ``Templates`` (``base``, ``meta-llama3``, ``meta-chat``, ...):
        a raw string wrapped around the task text, exactly as ``prepare.py`` does. Without a tokenizer chat
        template, ``chat`` falls back to ``base``.
    """

    tokenizer: Any
    template: str = "chat"

    @property
    def uses_chat_template(self) -> bool:
        return self.template == "chat" and bool(getattr(self.tokenizer, "chat_template", None))

    def full_template(self, generator: str) -> str:
        """``Templates[type].format(task_template=TASKS[g]['template']) + TASKS[g]['answer_prefix']`` (raw
        templates); the bare task template + answer prefix for ``chat`` (the wrapping happens in ``render``)."""
        spec = GENERATORS[generator]
        wrapper = "{task_template}" if self.template == "chat" else MODEL_TEMPLATES[self.template]
        return wrapper.format(task_template=spec["template"]) + spec["answer_prefix"]

    def split(self, input_text: str, generator: str) -> tuple[str, str]:
        """RULER's cut at ``rfind(answer_prefix[:10])``: (input, answer_prefix) as saved in its jsonl."""
        index = input_text.rfind(GENERATORS[generator]["answer_prefix"][:10])
        return input_text[:index], input_text[index:]

    def render(self, input_text: str, generator: str) -> str:
        """The full prompt text: ``input_text`` itself for raw templates; for ``chat`` the part before the answer
        prefix goes into the user turn and the answer prefix follows the assistant header."""
        if not self.uses_chat_template:
            return input_text
        user, prefix = self.split(input_text, generator)
        messages = [{"role": "user", "content": user}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + prefix

    def count(self, text: str) -> int:
        """``len(tokenizer.tokenize(text))``: RULER's HF ``text_to_tokens`` (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def count_prompt(self, input_text: str, generator: str) -> int:
        return self.count(self.render(input_text, generator))


def binary_search(build: Callable[[int], int], lower: int, upper: int, max_tokens: int) -> int | None:
    """RULER's search for the largest haystack size whose prompt fits: ``build(size)`` draws a sample of that size
    (consuming randomness) and returns its token total; None if even ``lower`` does not fit."""
    best = None
    while lower <= upper:
        middle = (lower + upper) // 2
        if build(middle) <= max_tokens:
            best, lower = middle, middle + 1
        else:
            upper = middle - 1
    return best


def fit_sample(draw: Callable[[int], tuple[Any, int]], size: int, step: int, max_tokens: int, task: str) -> Any:
    """RULER's per-sample loop: draw at ``size``; while the total exceeds ``max_tokens`` (or the draw fails),
    draw again with ``step`` fewer units (never below ``step``). Returns the draw."""
    retries = 0
    while True:
        try:
            sample, total = draw(size)
            if total <= max_tokens:
                return sample
        except ValueError:  # RULER's bare except: e.g. random.sample larger than the population
            pass
        if size > step:
            size -= step
        else:
            retries += 1
            if retries > MAX_FLOOR_RETRIES:
                raise ConfigError(
                    f"task 'ruler': {task} does not fit in {max_tokens} tokens even with the smallest haystack "
                    f"({size} units); use a larger context length"
                )


__all__ = ["GENERATORS", "MODEL_TEMPLATES", "TASK_ARGS", "TEMPLATES", "Prompting", "binary_search", "fit_sample"]
