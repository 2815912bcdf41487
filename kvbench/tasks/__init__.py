"""Benchmark tasks, registered by config name from their own declarations, plus the field checks they share.

Each task package under ``kvbench/tasks/`` declares itself in its ``task_spec.py`` (``SPEC = TaskSpec(...)``, see
``kvbench.tasks.spec``): the config names it registers and their classes, how ``python -m kvbench.score`` re-scores
them, the cell fields of a generated task's grid and its rows of the README's task table. ``TASKS`` here,
``kvbench.score.BENCHMARKS`` and the README's task table are derived from those declarations; adding a task touches
its own folder and its config under ``conf/task/``.

A task kept outside this repository: put its package (a folder with ``__init__.py``, ``task_spec.py`` and the Task
subclass) in a folder named by the ``KVBENCH_TASK_PATH`` environment variable (``os.pathsep``-separated folders, like
``PYTHONPATH``), its config in that package's ``conf/task/<name>.yaml``, and tell Hydra where the config is:
``KVBENCH_TASK_PATH=/my/tasks python -m kvbench.run task=toy hydra.searchpath=[file:///my/tasks/toy/conf]``.
``python -m kvbench.score --benchmark toy`` and ``python -m kvbench.report readme`` see it through the variable alone.

``build_task(cfg)`` turns the composed ``task`` config node into a validated Task without loading a model or
generating data, so a bad ``task=...`` override fails in well under a second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

from kvbench.errors import ConfigError
from kvbench.registry import Registry
from kvbench.tasks import spec
from kvbench.tasks.base import Sample, Task


class _DeclaredTasks(Registry):
    """The task registry, derived from the task packages' declarations (``kvbench.tasks.spec``): ``entries`` is
    ``{name: "module:Class"}`` for the current search path (``kvbench/tasks/`` plus ``KVBENCH_TASK_PATH``), found
    again when that path changes."""

    def __init__(self) -> None:  # no Registry.__init__: entries are found, not given
        self.kind = "task"
        self.pending: dict[str, str] = {}
        self._found: dict[tuple, dict[str, str]] = {}

    @property
    def entries(self) -> dict[str, str]:
        path = spec.search_path()
        if path not in self._found:
            self._found[path] = spec.task_classes()
        return self._found[path]


TASKS = _DeclaredTasks()


def build_task(cfg: Any) -> Task:
    """Task instance from the composed ``task`` config node (``name`` + protocol fields), validated.

    Raises ConfigError for an unknown name or field or a bad value, NotAvailableError for a configured task whose
    implementation has not landed yet.
    """
    fields = _plain_mapping(cfg)
    name = fields.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"task config needs a 'name'; got {name!r}; valid tasks: {', '.join(TASKS.names())}")
    task = TASKS.build(name, fields)
    task.validate()
    return task


def _plain_mapping(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, DictConfig):  # lists become plain lists, interpolations are resolved
        return dict(OmegaConf.to_container(cfg, resolve=True))
    if isinstance(cfg, Mapping):  # e.g. dict(cfg.task): values may still be ListConfig
        return {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
                for k, v in cfg.items()}
    raise ConfigError(f"task config must be a mapping with a 'name' key; got {type(cfg).__name__}: {cfg!r}")


# ---- field checks shared by the task dataclasses (they raise ConfigError naming the task, field and value) ----


def check_int(task: str, field: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"task {task!r}: {field} must be an integer >= {minimum}; got {value!r}")


def check_bool(task: str, field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"task {task!r}: {field} must be true or false; got {value!r}")


def check_str(task: str, field: str, value: Any, choices: tuple[str, ...] | None = None) -> None:
    if not isinstance(value, str) or (choices is not None and value not in choices):
        valid = f" (one of {', '.join(choices)})" if choices else ""
        raise ConfigError(f"task {task!r}: {field} must be a string{valid}; got {value!r}")


def check_int_list(task: str, field: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"task {task!r}: {field} must be a non-empty list of integers; got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
            raise ConfigError(f"task {task!r}: {field} must hold integers >= {minimum}; got {item!r} in {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(f"task {task!r}: {field} has duplicates: {value!r}")


def check_names(task: str, field: str, value: Any, valid: Sequence[str], what: str) -> None:
    """``value`` is a non-empty list of distinct names, each one of ``valid`` (``what`` they are, for the message:
    "LEval datasets")."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"task {task!r}: {field} must be a non-empty list of names; got {value!r}")
    unknown = [v for v in value if v not in valid]
    if unknown:
        raise ConfigError(f"task {task!r}: {field} {unknown!r} are not {what} (valid: {', '.join(valid)})")
    if len(set(value)) != len(value):
        raise ConfigError(f"task {task!r}: {field} has duplicates: {value!r}")


def check_depths(task: str, depths: Any, n_depths: Any) -> None:
    """``depths`` is null (then ``n_depths`` evenly spaced, rounded) or a list of percentages in [0, 100]."""
    if depths is None:
        check_int(task, "n_depths", n_depths, minimum=1)
        return
    if not isinstance(depths, (list, tuple)) or not depths:
        raise ConfigError(f"task {task!r}: depths must be null or a non-empty list of percents; got {depths!r}")
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 100:
            raise ConfigError(f"task {task!r}: depths must lie in [0, 100]; got {depth!r} in {depths!r}")
    if len(set(depths)) != len(depths):
        raise ConfigError(f"task {task!r}: depths has duplicates: {depths!r}")


def check_stop_strings(task: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ConfigError(f"task {task!r}: stop_strings must be a list of non-empty strings; got {value!r}")


def check_common(task: Task) -> None:
    """The fields every task has (kvbench.tasks.base.Task)."""
    check_int(task.name, "max_new_tokens", task.max_new_tokens)
    check_bool(task.name, "chat_template", task.chat_template)
    check_stop_strings(task.name, task.stop_strings)
    if task.truncate_to is not None:
        check_int(task.name, "truncate_to", task.truncate_to)


# ---- helpers shared by the length x depth grid tasks (needle, passkey) ----


def linear_depths(depths: list[float] | None, n_depths: int) -> list[float]:
    """``depths`` as given, else ``np.round(np.linspace(0, 100, n_depths)).astype(int)`` (gkamradt / KVCache-Factory:
    10 depths give 0, 11, 22, 33, 44, 56, 67, 78, 89, 100)."""
    if depths is not None:
        return [float(d) for d in depths]
    return [float(d) for d in np.round(np.linspace(0, 100, n_depths)).astype(int)]


def depth_label(depth: float) -> str:
    """"50" for 50.0, "12.5" for 12.5: used in sample ids and grid keys."""
    return str(int(depth)) if float(depth).is_integer() else f"{depth:g}"


def grid_scores(records: list[dict[str, Any]], scale: float = 1.0, digits: int = 4) -> dict[str, dict[str, float]]:
    """Mean score per (context_length, depth) cell from ``record["meta"]``, keys as strings (JSON-safe), sorted."""
    cells: dict[tuple[int, float], list[float]] = {}
    for record in records:
        meta = record.get("meta") or {}
        key = (int(meta["context_length"]), float(meta["depth"]))
        cells.setdefault(key, []).append(float(record["score"]))
    grid: dict[str, dict[str, float]] = {}
    for (length, depth), values in sorted(cells.items()):
        grid.setdefault(str(length), {})[depth_label(depth)] = round(scale * sum(values) / len(values), digits)
    return grid


def mean_score(records: list[dict[str, Any]], scale: float = 1.0, digits: int = 4) -> float:
    values = [float(r["score"]) for r in records]
    return round(scale * sum(values) / len(values), digits) if values else math.nan


def protocol_fields(task: Task) -> dict[str, Any]:
    """Every dataclass field of a task (the protocol), JSON-friendly, for ``Task.protocol()``."""
    fields = dataclasses.asdict(task)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


__all__ = ["TASKS", "Sample", "Task", "build_task"]
