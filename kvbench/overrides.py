"""Checks of the command line's overrides, before Hydra composes anything: unknown group options, unknown fields of
the chosen model/method/task, malformed budgets. Each bad choice is one line (Hydra would print a multi-line error and
exit with 1); ``python -m kvbench.run`` and ``python -m kvbench.bench`` both call ``precheck_overrides``."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from kvbench.budget import parse_budget
from kvbench.config import CONF_DIR, top_level_values
from kvbench.config import root_config as _root_config
from kvbench.errors import ConfigError

GROUPS = ("model", "method", "task", "launcher", "logger", "experiment")
FIELD_GROUPS = ("model", "method", "task")  # groups whose fields a dotted override sets: method.window=16


def _group_options(group: str) -> list[str]:
    """A group's configs: ``conf/<group>/``, for tasks also those of the task packages in ``KVBENCH_TASK_PATH``
    (which Hydra finds through ``hydra.searchpath``)."""
    folders = [CONF_DIR / group]
    if group == "task":
        from kvbench.tasks.spec import external_config_dirs

        folders += [conf / group for conf in external_config_dirs()]
    return sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})


def precheck_overrides(argv: list[str], config_name: str = "config") -> None:
    """Reject unknown group options, unknown fields of the chosen model/method/task and malformed budgets in one line
    (Hydra would print a multi-line error and exit with 1).

    Every bad choice on the command line is named at once."""
    problems, bad_groups = [], set()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.partition("=")
        problem = _top_level_problem(arg, config_name)
        if problem:
            problems.append(problem)
            continue
        key = key.lstrip("+~")
        if key in GROUPS:
            options = _group_options(key)
            bad = [choice for choice in _split_sweep(value) if choice and choice not in options]
            problems += [_unknown_option_message(key, choice, options) for choice in bad]
            bad_groups.update([key] if bad else [])
        elif key == "budget":  # the job plan's own parse (parse_budget), on each value written
            for choice in _split_sweep(value):
                try:
                    parse_budget(_yaml_scalar(choice))
                except ConfigError as exc:
                    problems.append(str(exc))
    problems += _field_problems(argv, skip=bad_groups)
    if problems:
        raise ConfigError("; ".join(problems))


#: keys a command line may set besides a config's values and groups: Hydra's own, kvbench's sweep workers'
_OTHER_ROOTS = ("hydra", "sweep_chunk")


def _config_groups(config_name: str) -> set[str]:
    """The groups of the config's defaults list (paths, model, ...; ``override hydra/sweeper`` is Hydra's)."""
    groups = set()
    for entry in _root_config(config_name).get("defaults", []):
        if isinstance(entry, dict):
            groups.update(str(k).split()[-1].partition("/")[0] for k in entry)
    return groups


def _top_level_problem(arg: str, config_name: str = "config") -> str | None:
    """An override of a top-level value the config lacks (``foo=1``, ``+foo=1``: Hydra would refuse the first in six
    lines and silently accept the second) or ``+`` on one it has; None for groups, their fields and Hydra's keys."""
    if arg.startswith("++"):
        return None  # adds or overrides whatever is there: an explicit escape hatch
    op = arg[0] if arg[0] in "+~" else ""
    key = arg[len(op):].partition("=")[0]
    root = key.partition(".")[0]
    if "/" in key or root in GROUPS or root in _OTHER_ROOTS or root in _config_groups(config_name):
        return None
    known = top_level_values(config_name)
    containers = {name.partition(".")[0] for name in known if "." in name}
    if key in known or (key in containers and op == "~"):
        if op == "+":
            return f"{key} is already set; set it without the '+' ({key}=...)"
        return None
    groups = sorted(_config_groups(config_name) - {"hydra"})
    return f"unknown top-level value {key!r}; valid: {', '.join(known)} (and the groups {', '.join(groups)})"


def _field_problems(argv: list[str], skip: set[str]) -> list[str]:
    """Dotted overrides of a group's fields that Hydra would refuse with a multi-line error: setting or deleting a
    field the chosen option lacks (``method.nosuchfield=3``, ``~task.nosuch``), or adding with ``+`` one it has.

    The chosen options (``method=h2o``, each of ``method=h2o,snapkv``, else the experiment's or the default) are
    composed from the real configs; a group an experiment sweeps is left to Hydra. ``+method.nosuch=3`` composes and
    is refused by the method's dataclass (``registry.build_dataclass``), also before any model loads."""
    edits = [edit for edit in map(_field_edit, argv) if edit is not None and edit[1] not in skip]
    if not edits:
        return []
    from hydra import compose, initialize_config_dir

    problems, nodes = [], {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for op, group, path in edits:
            for overrides in _chosen_options(argv, group):
                if (group, overrides) not in nodes:
                    nodes[group, overrides] = _compose_group(compose, group, overrides)
                if nodes[group, overrides] is None:
                    continue
                name, fields = nodes[group, overrides]
                problem = _field_problem(op, group, name, fields, path)
                if problem and problem not in problems:
                    problems.append(problem)
    return problems


def _compose_group(compose: Any, group: str, overrides: tuple[str, ...]) -> tuple[str, dict] | None:
    """(option name, its fields unresolved) of ``group`` composed from the real configs with ``overrides``; None if
    they do not compose on their own (Hydra then says why) or an experiment's sweep chooses the group."""
    try:
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        if _names_key(OmegaConf.to_container(cfg.hydra.sweeper, resolve=False), group):
            return None
        return cfg.hydra.runtime.choices[group], OmegaConf.to_container(cfg[group], resolve=False)
    except Exception:
        return None


def _names_key(tree: Any, key: str) -> bool:
    """Whether ``key`` (``+``-prefixed or not) is a key anywhere in ``tree`` (a sweeper's params and blocks)."""
    if isinstance(tree, dict):
        return any(str(k).lstrip("+") == key or _names_key(v, key) for k, v in tree.items())
    if isinstance(tree, list):
        return any(_names_key(v, key) for v in tree)
    return False


def _field_edit(arg: str) -> tuple[str, str, str] | None:
    """``(op, group, dotted path)`` of an override of a field group (op ``""``, ``"+"`` or ``"~"``), else None.
    ``++`` adds or overrides whatever is there: Hydra never refuses it."""
    if arg.startswith(("-", "++")) or not arg:
        return None
    op = arg[0] if arg[0] in "+~" else ""
    key, eq, _ = arg[len(op):].partition("=")
    group, dot, path = key.partition(".")
    if group not in FIELD_GROUPS or not dot or not path or (not eq and op != "~"):
        return None
    return op, group, path


def _chosen_options(argv: list[str], group: str) -> list[tuple[str, ...]]:
    """Overrides that compose each option of the group the command line chooses: each of the last ``group=...``,
    else each experiment's choice, else the default (no override)."""
    chosen, experiments = None, []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") == group:
            chosen = value
        elif eq and key.lstrip("+") == "experiment":
            experiments = [(f"+experiment={name}",) for name in _split_sweep(value) if name]
    if chosen is not None:
        return [(f"{group}={choice}",) for choice in _split_sweep(chosen) if choice]
    return experiments or [()]


def _field_problem(op: str, group: str, name: str, fields: dict, path: str) -> str | None:
    """The one-line problem of an override of ``path`` in the composed ``fields`` of ``group`` option ``name``."""
    parts = path.split(".")
    node = fields
    for depth, part in enumerate(parts):
        if not isinstance(node, dict):
            return None  # inside a list or a value: Hydra's own check applies
        if part not in node:
            if op == "+":
                return None  # adding a new key: the dataclass says whether it is a field
            where = ".".join(parts[:depth])
            valid = sorted(node)
            if not where and group != "model":  # a method's or task's name is its registry key, not a field
                valid = [k for k in valid if k != "name"]
            listing = f"valid fields{' of ' + where if where else ''}: {', '.join(valid) or '(none)'}"
            return f"{group} {name!r} has no field {'.'.join(parts[: depth + 1])}; {listing}"
        node = node[part]
    if op == "+":
        return (f"{group} {name!r} already has field {path}; set it without the '+' ({group}.{path}=...) or with '++'")
    return None


def _split_sweep(value: str) -> list[str]:
    if value.startswith(("range(", "choice(", "glob(", "interval(")):
        return []  # Hydra sweep functions: let Hydra expand them
    return [v.strip() for v in value.split(",")]


def _yaml_scalar(text: str) -> Any:
    return OmegaConf.create({"v": text})["v"] if text else text


def _unknown_option_message(group: str, choice: str, options: list[str]) -> str:
    from kvbench.methods import METHODS
    from kvbench.tasks import TASKS

    registry = {"method": METHODS, "task": TASKS}.get(group)
    if registry is not None and choice in registry.pending:
        reason = registry.pending[choice]
        return f"{group} {choice!r} is not implemented yet ({reason}); available: {', '.join(options)}"
    return f"unknown {group} {choice!r}; valid {group}s: {', '.join(options)}"
