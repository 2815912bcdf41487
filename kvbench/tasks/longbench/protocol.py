"""The LongBench protocol as data: ``prompts.json`` (THUDM/LongBench@2e00731 ``config/`` files, ``eval.py``'s
``dataset2metric`` and first-line datasets, ``pred.py``'s chat-template exceptions, README categories).

Shared by the task (prompting, generation) and ``scoring.py`` (re-scoring predictions without a model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROTOCOL: dict[str, Any] = json.loads((Path(__file__).with_name("prompts.json")).read_text(encoding="utf-8"))
DATASET2PROMPT: dict[str, str] = PROTOCOL["dataset2prompt"]
DATASET2MAXLEN: dict[str, int] = PROTOCOL["dataset2maxlen"]
DATASET2METRIC: dict[str, str] = PROTOCOL["dataset2metric"]
NO_CHAT_TEMPLATE: frozenset[str] = frozenset(PROTOCOL["no_chat_template"])
FIRST_LINE: frozenset[str] = frozenset(PROTOCOL["first_line"])
NEWLINE_STOP: frozenset[str] = frozenset(PROTOCOL["newline_stop"])
CATEGORIES: dict[str, dict[str, list[str]]] = PROTOCOL["categories"]
CODE = frozenset(CATEGORIES["en"]["code"])  # in both leaderboards
ENGLISH: list[str] = [d for datasets in CATEGORIES["en"].values() for d in datasets]  # the 16 of the KV papers
CHINESE: list[str] = [d for datasets in CATEGORIES["zh"].values() for d in datasets if d not in CODE]
LONGBENCH_E: list[str] = PROTOCOL["longbench_e"]
VARIANTS = ("longbench", "longbench_e")


def category_of(dataset: str) -> str:
    for categories in CATEGORIES.values():
        for category, datasets in categories.items():
            if dataset in datasets:
                return category
    raise KeyError(dataset)


__all__ = [
    "CATEGORIES", "CHINESE", "CODE", "DATASET2MAXLEN", "DATASET2METRIC", "DATASET2PROMPT", "ENGLISH", "FIRST_LINE",
    "LONGBENCH_E", "NEWLINE_STOP", "NO_CHAT_TEMPLATE", "PROTOCOL", "VARIANTS", "category_of",
]
