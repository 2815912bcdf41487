"""FullKV: the dense baseline. Every prompt and generated token stays in the cache (reference/methods.md B1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.methods.base import Method


@dataclass
class FullKV(Method):
    """Keeps everything; its answers equal plain ``model.generate`` token for token (tested)."""

    name: ClassVar[str] = "fullkv"
