"""Find kvbench's number for a paper cell in the run store.

A paper row becomes a *target*: kvbench model name, method (name + the fields that make it the paper's variant, plus
optional task fields such as 2StageRetr's ``cot``) and budget label. A column becomes a store location via
``names.task_source`` (LongBench dataset -> ``longbench`` runs, ``datasets.<id>``). Runs of the target are then
searched for that location. Several sweeps may hold the same cell (a 2-sample test run and a full run, datasets split
across jobs); the pick is deterministic:

1. runs whose non-default method fields are exactly the target's (``h2o`` rather than ``h2o[chunk=256]`` for H2O);
2. then the most samples behind the number (``counts[dataset]`` for LongBench, else ``n_samples``);
3. then the job hash.

``Lookup.get`` returns the value and the chosen run's hash; ``Lookup.ambiguous`` lists cells where several runs
tied on 1-2, which the report footnotes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kvbench.report import names
from kvbench.report.store import cfg_matches, non_default_fields, resident_kv_bytes

#: metrics that are measurements of time or memory, never compared with a quality score
EFFICIENCY_WORDS = ("time", "latency", "memory", "throughput", "batch", "speedup", "duration", "saving",
                    "degradation", "encoding")


def is_quality_metric(metric: object) -> bool:
    return not any(word in str(metric).lower() for word in EFFICIENCY_WORDS)


@dataclass(frozen=True)
class Target:
    """What kvbench runs for one paper row."""

    model: str
    method: dict[str, Any]  # name + required fields
    budget: str
    task_fields: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.method.items() if k != "name")
        name = names.OUR_LABELS.get(self.method["name"], self.method["name"])
        return f"{name}[{extra}] @ {self.budget}" if extra else f"{name} @ {self.budget}"


def _dig(scores: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = scores
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, (int, float)) and not isinstance(node, bool) and not math.isnan(float(node)):
        return float(node)
    return None


def _support(scores: dict[str, Any], path: tuple[str, ...]) -> int:
    if path[0] == "datasets":
        counts = scores.get("counts") or {}
        if path[-1] in counts:
            return int(counts[path[-1]])
    return int(scores.get("n_samples", scores.get("n", 0)) or 0)


class Lookup:
    """Store cells by target and column, with a deterministic choice among several runs."""

    def __init__(self, runs: pd.DataFrame):
        self.runs = runs
        self.ambiguous: list[str] = []
        self._used: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # target -> the runs its cells came from
        self._groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
        for row in runs.to_dict("records"):
            self._groups.setdefault((row["model"], row["task"], row["method"], row["budget"]), []).append(row)

    def get(self, target: Target, column: str) -> tuple[float | None, str | None]:
        source = names.task_source(column)
        if source is None:
            return None, None
        task, path = source
        candidates = []
        for run in self._groups.get((target.model, task, target.method["name"], target.budget), []):
            if task == "longbench" and run["variant"] not in ("", "longbench"):
                continue
            required = {k: v for k, v in target.method.items() if k != "name"}
            if not cfg_matches(run["method_cfg"], required) or not cfg_matches(run["task_cfg"], target.task_fields):
                continue
            value = _dig(run["scores"], path)
            if value is None:
                continue
            exact = set(non_default_fields(run["method_cfg"])) <= set(required)
            candidates.append((not exact, -_support(run["scores"], path), run["hash"], value, run))
        if not candidates:
            return None, None
        candidates.sort(key=lambda c: c[:3])
        best = candidates[0]
        if len(candidates) > 1 and candidates[1][:2] == best[:2]:
            self.ambiguous.append(f"{target.label} {column}: {len(candidates)} runs, took {best[2]}")
        self._used.setdefault(self._key(target), {})[best[2]] = best[4]
        return best[3], best[2]

    @staticmethod
    def _key(target: Target) -> tuple[str, str]:
        return target.model, f"{target.label} {sorted(target.task_fields.items())}"

    def resident_kv(self, target: Target) -> float | None:
        """Mean resident KV bytes of the runs that supplied ``target``'s cells so far (None when none recorded)."""
        values = [resident_kv_bytes(run["scores"]) for run in self._used.get(self._key(target), {}).values()]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None
