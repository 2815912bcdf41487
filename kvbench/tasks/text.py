"""Text helpers below the task contract (``tasks.base``) and prompt encoding (``tasks.encoding``), which both use
them: one acyclic unit."""

from __future__ import annotations

from typing import Any


def middle_truncate(text: str, tokenizer: Any, max_tokens: int) -> str:
    """``text`` unchanged if it has at most ``max_tokens`` tokens (no special tokens), else the first and last
    ``max_tokens // 2`` tokens decoded (skipping special tokens) and joined, as LongBench ``pred.py`` does."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[len(ids) - half :], skip_special_tokens=True) if half else ""
    return head + tail
