"""Task declarations: what a task package says about itself, once, and how kvbench finds them.

Each task package holds a small declaration module, ``task_spec.py``, defining ``SPEC = TaskSpec(...)``: the config
names it registers and their classes, each one's re-scorer for ``python -m kvbench.score`` (with its field aliases,
whether records need a ``dataset``, and the cell fields of a generated task's grid), and the package's rows of the
README's task table. ``kvbench.tasks.TASKS``, ``kvbench.score.BENCHMARKS`` / ``SINGLE_TASK`` / ``BENCHMARK_ALIASES``,
``kvbench.tasks.rescoring.CELL_FIELDS`` and the README's task table are derived from these declarations.

Discovery (``declarations()``) scans the packages under ``kvbench/tasks/`` and then every folder named in the
``KVBENCH_TASK_PATH`` environment variable (``os.pathsep``-separated, like ``PYTHONPATH``): each sub-folder holding a
``task_spec.py`` is a task package. Only that file is executed (by path: the package's ``__init__`` and task modules
are not imported), so listing tasks stays fast and imports no torch or datasets. An external folder is put on
``sys.path`` so that its packages import by their folder name (``toy.task:ToyTask``); a class or scorer written with
a leading dot (``.task:ToyTask``) is relative to the declaring package.

Shapes: ``TaskSpec.tasks`` is a tuple of ``TaskEntry`` (one per registered config name), ``TaskSpec.readme`` a tuple
of ``ReadmeRow`` (one per row of the README's task table); ``rank`` orders packages (README rows, registry) and
``Rescorer.rank`` orders ``--benchmark`` values; an external declaration may leave them out (it comes after, by
name).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path

#: the declaration module's file name inside a task package
SPEC_FILE = "task_spec.py"
#: the environment variable naming extra folders of task packages (os.pathsep-separated)
PATH_VARIABLE = "KVBENCH_TASK_PATH"
TASKS_DIR = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Rescorer:
    """How ``python -m kvbench.score --benchmark <task>`` re-scores predictions of a task.

    ``target``: ``"module:function"``, the function taking the records (``score_records(records, **options) ->
    {"datasets": {name: score}, ...}``); ``single_task``: records need no ``dataset`` field (the benchmark's name is
    used); ``aliases``: field name -> the names a record may carry it under, where the benchmark's upstream files name
    fields otherwise (default ``kvbench.score.ALIASES``); ``cell_fields``: the fields each record needs for a
    generated task's grid (``kvbench.tasks.rescoring``); ``rank``: position among ``--benchmark`` values.
    """

    target: str
    single_task: bool = False
    aliases: Mapping[str, tuple[str, ...]] | None = None
    cell_fields: tuple[str, ...] = ()
    rank: float = math.inf


@dataclasses.dataclass(frozen=True)
class TaskEntry:
    """One registered task: its config ``name`` (what ``task.name`` says), its class ``"module:Class"`` and, where
    ``python -m kvbench.score`` can re-score it, its ``Rescorer`` (registered under the same name)."""

    name: str
    cls: str
    rescorer: Rescorer | None = None


@dataclasses.dataclass(frozen=True)
class ReadmeRow:
    """One row of the README's task table: the ``configs`` it covers (names under ``conf/task/``: what ``task=...``
    takes) and its hand-written ``protocol`` and ``metric`` cells (Markdown)."""

    configs: tuple[str, ...]
    protocol: str
    metric: str


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A task package's declaration (``SPEC`` in its ``task_spec.py``). ``rank`` orders packages in the README and the
    registry; ``package`` and ``folder`` are filled in by discovery."""

    tasks: tuple[TaskEntry, ...]
    readme: tuple[ReadmeRow, ...] = ()
    rank: float = math.inf
    package: str = ""
    folder: Path | None = None

    def __post_init__(self) -> None:
        for entry in self.tasks:
            if not isinstance(entry, TaskEntry):
                raise TypeError(f"TaskSpec.tasks holds TaskEntry values; got {entry!r}")
        for row in self.readme:
            if not isinstance(row, ReadmeRow):
                raise TypeError(f"TaskSpec.readme holds ReadmeRow values; got {row!r}")


def search_path() -> tuple[Path, ...]:
    """The folders scanned for task packages: ``kvbench/tasks/`` first, then ``KVBENCH_TASK_PATH``'s."""
    extra = [Path(p).expanduser().resolve() for p in os.environ.get(PATH_VARIABLE, "").split(os.pathsep) if p]
    return (TASKS_DIR, *dict.fromkeys(p for p in extra if p != TASKS_DIR))


def declarations() -> tuple[TaskSpec, ...]:
    """Every task package's declaration, ordered by rank then package name (cached per search path)."""
    return _declarations(search_path())


@functools.lru_cache(maxsize=8)
def _declarations(path: tuple[Path, ...]) -> tuple[TaskSpec, ...]:
    from kvbench.errors import ConfigError

    specs: list[TaskSpec] = []
    for folder in path:
        if not folder.is_dir():
            raise ConfigError(f"{PATH_VARIABLE} names {str(folder)!r}, which is not a folder")
        prefix = "kvbench.tasks." if folder == TASKS_DIR else ""
        if prefix == "" and str(folder) not in sys.path:
            sys.path.append(str(folder))  # its packages import by their folder name
        for package_dir in sorted(p for p in folder.iterdir() if (p / SPEC_FILE).is_file()):
            specs.append(_load(package_dir, prefix + package_dir.name))
    specs.sort(key=lambda s: (s.rank, s.package))
    _check_unique(specs)
    return tuple(specs)


def _load(package_dir: Path, package: str) -> TaskSpec:
    from kvbench.errors import ConfigError

    file = package_dir / SPEC_FILE
    module_spec = importlib.util.spec_from_file_location(f"_kvbench_task_spec.{package}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # the declaration only: not the package's __init__ nor its task modules
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, TaskSpec):
        raise ConfigError(f"{file} must define SPEC = TaskSpec(...); got {spec!r:.80}")

    def absolute(target: str) -> str:
        return package + target if target.startswith(".") else target

    tasks = tuple(dataclasses.replace(
        entry, cls=absolute(entry.cls),
        rescorer=entry.rescorer and dataclasses.replace(entry.rescorer, target=absolute(entry.rescorer.target)))
        for entry in spec.tasks)
    return dataclasses.replace(spec, tasks=tasks, package=package, folder=package_dir)


def _check_unique(specs: list[TaskSpec]) -> None:
    from kvbench.errors import ConfigError

    seen: dict[str, str] = {}
    for spec in specs:
        for entry in spec.tasks:
            if entry.name in seen:
                raise ConfigError(f"task {entry.name!r} is declared twice: by {seen[entry.name]} and {spec.package}")
            seen[entry.name] = spec.package


def task_classes() -> dict[str, str]:
    """``{task name: "module:Class"}`` in declaration order (``kvbench.tasks.TASKS``)."""
    return {entry.name: entry.cls for spec in declarations() for entry in spec.tasks}


def rescorers() -> dict[str, Rescorer]:
    """``{benchmark name: Rescorer}`` ordered by the rescorer's rank, then by declaration order."""
    found = [(entry.rescorer.rank, i, entry.name, entry.rescorer)
             for i, entry in enumerate(e for spec in declarations() for e in spec.tasks) if entry.rescorer]
    return {name: rescorer for _, _, name, rescorer in sorted(found, key=lambda item: item[:2])}


def declaring(task: str) -> TaskSpec:
    """The declaration that registers ``task`` (KeyError for an unknown name)."""
    for spec in declarations():
        if any(entry.name == task for entry in spec.tasks):
            return spec
    raise KeyError(task)


def external_config_dirs() -> list[Path]:
    """The ``conf/`` folders of the task packages found through ``KVBENCH_TASK_PATH`` (each holds ``task/<name>.yaml``;
    give Hydra the folder with ``hydra.searchpath=[file://<folder>]``)."""
    return [s.folder / "conf" for s in declarations()
            if s.folder is not None and s.folder.parent != TASKS_DIR and (s.folder / "conf").is_dir()]


def readme_rows() -> list[tuple[TaskSpec, ReadmeRow]]:
    """The README task table's rows, each with its declaration, in declaration order."""
    return [(spec, row) for spec in declarations() for row in spec.readme]


__all__ = ["PATH_VARIABLE", "SPEC_FILE", "ReadmeRow", "Rescorer", "TaskEntry", "TaskSpec", "declarations",
           "declaring", "external_config_dirs", "readme_rows", "rescorers", "search_path", "task_classes"]
