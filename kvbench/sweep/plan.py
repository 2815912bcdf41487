"""Expand a sweep into jobs and plan every job without loading anything: identity, key, hash and store state.

A sweep is Hydra's: ``hydra.sweeper.params`` (a cartesian product, Hydra's override syntax) plus, for tables that are
not one product, ``hydra.sweeper.blocks`` (a list of products, each block's keys replacing the shared params), then
the command line (which wins over both). Jobs with the same key (FullKV under several budgets) are one job.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.config_repository import CachingConfigRepository
from omegaconf import DictConfig, OmegaConf, open_dict

from kvbench.budget import parse_budget
from kvbench.errors import DataError, KVBenchError, NotAvailableError

#: What the store says about a planned job. The first three are submitted by a sweep; the rest are not.
RUNNABLE = ("missing", "partial", "failed")
STATUSES = (*RUNNABLE, "finished", "running", "unavailable", "invalid")
IDENTITY_KEYS = ("model", "method", "budget", "task")


@dataclass
class SweepJob:
    """One planned job of a sweep (nothing loaded). ``cfg`` is the job's config without the ``hydra`` node."""

    overrides: list[str]
    model: str
    method: str
    budget: str
    task: str
    status: str
    detail: str = ""
    hash: str | None = None
    path: Path | None = None
    cfg: DictConfig | None = None
    model_key: str = ""  # jobs with the same model_key share one loaded model
    samples_done: int = 0
    settings: list[str] = field(default_factory=list)  # the overrides that tell it apart from the other jobs

    @property
    def runnable(self) -> bool:
        return self.status in RUNNABLE

    @property
    def label(self) -> str:
        extra = f" [{' '.join(self.settings)}]" if self.settings else ""
        return f"{self.model} {self.task} {self.method} {self.budget}{extra}"


# ---- expansion -----------------------------------------------------------------------------------------------------
def override_value(value: Any) -> str:
    """A YAML value from ``blocks`` in Hydra's override syntax (strings are taken as written: ``a,b`` sweeps)."""
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        return "[" + ",".join(_list_item(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as a Hydra override value")


def _list_item(value: Any) -> str:
    if isinstance(value, str) and not all(c.isalnum() or c in "_-." for c in value):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return override_value(value)


def expand(params: Mapping[str, Any] | None, blocks: Sequence[Mapping[str, Any]] | None, arguments: Sequence[str],
           parser: Any) -> list[list[str]]:
    """Every job's override list: for each block, the cartesian product of params | block | command line."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    jobs: list[list[str]] = []
    for block in blocks or [{}]:
        merged = {**dict(params or {}), **dict(block)}
        lines = [f"{key}={override_value(value)}" for key, value in merged.items()] + list(arguments)
        (batch,) = BasicSweeper.split_arguments(parser.parse_overrides(lines), None)
        jobs += batch
    return jobs


# ---- composition ---------------------------------------------------------------------------------------------------
class _SharedFileCache(CachingConfigRepository):
    """Hydra wraps the loader's repository in a fresh CachingConfigRepository per composition, deep-copying it; this
    one is shared instead, so the files it parsed (a quarter of a composition's time) stay parsed across them."""

    def __deepcopy__(self, memo: dict) -> _SharedFileCache:
        return self

    def load_config(self, config_path: str) -> Any:
        # Composition merges into loaded configs, so every composition gets its own copy of what was parsed.
        return copy.deepcopy(super().load_config(config_path))


#: Config groups whose options are merged at their own package only (model/, method/, task/ have no @package header
#: and no defaults outside their package; tests/test_sweep.py checks it), so a job's node of such a group depends on
#: the other choices only through the experiment, never through each other.
NODE_GROUPS = ("model", "method", "task")


class Composer:
    """Hydra's composition of a job's config, factorised over the choices of model, method and task.

    Composing from scratch costs about 0.1 s of CPU per job and a table has hundreds of jobs. Hydra composes the
    defaults tree from the group choices, then applies the value overrides (``budget=128``, ``method.kernel=7``) in
    order (``ConfigLoaderImpl._apply_overrides_to_config``). This composes the *frame* (every other group choice,
    e.g. ``+experiment=X``) once, composes each model / method / task choice once within that frame and takes its
    node, then applies the value overrides the same way. tests/test_sweep.py checks the result equals Hydra's own
    ``load_sweep_config`` for every kind of job the experiments contain.
    """

    def __init__(self, config_loader: Any, config_name: str, hydra_overrides: Sequence[str] = ()):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.loader = config_loader
        self.config_name = config_name
        self.hydra_overrides = list(hydra_overrides)
        self.parser = OverridesParser.create(config_loader=config_loader)
        self._full: dict[tuple[str, ...], DictConfig] = {}
        self._composed: dict[tuple[str, ...], DictConfig] = {}
        self._nodes: dict[tuple[tuple[str, ...], str], DictConfig] = {}
        self._is_group: dict[str, bool] = {}
        self._files = _SharedFileCache(config_loader.repository)
        self.compositions = 0

    def _group(self, override: Any) -> bool:
        key = override.key_or_group
        if key not in self._is_group:
            self._is_group[key] = override.package is not None or self.loader.repository.group_exists(key)
        return self._is_group[key]

    def full_config(self, group_overrides: Sequence[str]) -> DictConfig:
        """Hydra's composition (``hydra`` node included) for these group choices, composed once."""
        from hydra.types import RunMode

        key = tuple(group_overrides)
        if key not in self._full:
            original = self.loader.repository
            self.loader.repository = self._files
            try:
                self._full[key] = self.loader.load_configuration(self.config_name,
                                                                 self.hydra_overrides + list(key), RunMode.RUN)
            finally:
                self.loader.repository = original
            self.compositions += 1
        return self._full[key]

    def _job_config(self, group_overrides: tuple[str, ...]) -> DictConfig:
        if group_overrides not in self._composed:
            cfg = copy.deepcopy(self.full_config(group_overrides))
            with open_dict(cfg):
                del cfg["hydra"]
            self._composed[group_overrides] = cfg
        return self._composed[group_overrides]

    def _split(self, overrides: Sequence[str]) -> tuple[tuple[str, ...], list[Any], list[Any]]:
        """(frame group overrides, model/method/task choices, value overrides) of a job's overrides."""
        parsed = self.parser.parse_overrides(list(overrides))
        groups = [o for o in parsed if self._group(o)]
        nodes = [o for o in groups if o.key_or_group in NODE_GROUPS and o.package is None and not o.is_add()
                 and not o.is_force_add() and not o.is_delete()]
        frame = tuple(o.input_line for o in groups if o not in nodes)
        return frame, nodes, [o for o in parsed if not self._group(o)]

    def prefetch(self, override_lists: Sequence[Sequence[str]]) -> None:
        """Compose the model / method / task nodes the jobs need, several per composition: the i-th composition of
        a frame takes the i-th model, method and task choice (the nodes do not depend on each other)."""
        wanted: dict[tuple[str, ...], dict[str, list[str]]] = {}
        for overrides in override_lists:
            frame, nodes, _ = self._split(overrides)
            for o in nodes:
                lines = wanted.setdefault(frame, {}).setdefault(o.key_or_group, [])
                if (frame, o.input_line) not in self._nodes and o.input_line not in lines:
                    lines.append(o.input_line)
        for frame, by_group in wanted.items():
            for i in range(max((len(v) for v in by_group.values()), default=0)):
                lines = [v[i] for v in by_group.values() if i < len(v)]
                cfg = self._job_config((*frame, *lines))
                for line in lines:
                    self._nodes[(frame, line)] = cfg[line.partition("=")[0]]

    def compose(self, overrides: Sequence[str]) -> DictConfig:
        """The job's config (without the ``hydra`` node), as Hydra composes it for a launched job."""
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        frame, nodes, values = self._split(overrides)
        cfg = copy.deepcopy(self._job_config(frame))
        for override in nodes:
            key = (frame, override.input_line)
            if key not in self._nodes:
                self._nodes[key] = self._job_config((*frame, override.input_line))[override.key_or_group]
            cfg[override.key_or_group] = copy.deepcopy(self._nodes[key])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg


# ---- planning ------------------------------------------------------------------------------------------------------
def plan_sweep(composer: Composer, override_lists: Sequence[Sequence[str]], sweep_name: str | None = None,
               ) -> list[SweepJob]:
    """Compose and plan every job (no model, no data), drop duplicates (same key), read each job's store state."""
    jobs: list[SweepJob] = []
    seen: set[str] = set()
    try:
        composer.prefetch(override_lists)
    except Exception:  # a composition error belongs to its job: plan_one reports it there
        pass
    for overrides in override_lists:
        job = plan_one(composer, list(overrides), sweep_name)
        ident = job.hash or json.dumps([job.model_key, job.method, job.budget, job.task, _cfg_identity(job.cfg),
                                        job.detail if job.cfg is None else ""], sort_keys=True, default=str)
        if ident in seen:
            continue
        seen.add(ident)
        jobs.append(job)
    _fill_settings(jobs)
    return jobs


def plan_one(composer: Composer, overrides: list[str], sweep_name: str | None = None) -> SweepJob:
    try:
        cfg = composer.compose(overrides)
    except Exception as exc:  # a composition error is this job's problem, not the sweep's
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return SweepJob(overrides, *_identity_from_overrides(overrides), status="invalid", detail=first)
    if sweep_name and cfg.get("sweep_name") is None:
        cfg.sweep_name = sweep_name
    return plan_config(cfg, overrides)


def plan_config(cfg: DictConfig, overrides: list[str] | None = None) -> SweepJob:
    """Plan a composed job config and read its state from the store."""
    from kvbench.jobs import plan_job
    from kvbench.store import JobDir

    overrides = list(overrides or [])
    model_key = json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True, default=str)
    try:
        job = plan_job(cfg)
    except NotAvailableError as exc:
        return SweepJob(overrides, *_identity_from_config(cfg), status="unavailable", detail=str(exc), cfg=cfg,
                        model_key=model_key)
    except KVBenchError as exc:
        return SweepJob(overrides, *_identity_from_config(cfg), status="invalid", detail=str(exc), cfg=cfg,
                        model_key=model_key)
    jobdir = JobDir(cfg.paths.results_dir, job.parts, job.key)
    status, detail, done = store_state(jobdir, cfg.limit)
    return SweepJob(overrides, *job.parts[:1], job.parts[2], job.parts[3], job.parts[1], status=status,
                    detail=detail, hash=jobdir.hash, path=jobdir.path, cfg=cfg, model_key=model_key,
                    samples_done=done)


def store_state(jobdir: Any, limit: int | None) -> tuple[str, str, int]:
    """(status, detail, records written) of a job directory."""
    if jobdir.finished_scores(limit) is not None:
        return "finished", "", 0
    try:
        done = len(jobdir.read_records()) if jobdir.samples_path.exists() else 0
    except DataError as exc:  # a corrupted record: the run refuses it until ``store verify --clean`` sets it aside
        return "invalid", str(exc), 0
    if jobdir.lock_held():
        return "running", f"{done} samples so far", done
    failure = jobdir.read_failure()
    if failure is not None:
        return "failed", describe_failure(failure), done
    if done:
        return "partial", f"{done} samples done; resumes", done
    return "missing", "", 0


def describe_failure(failure: Mapping[str, Any]) -> str:
    where = f" on {failure['host']}" if failure.get("host") else ""
    when = f" at {failure['time']}" if failure.get("time") else ""
    return f"{failure.get('kind', 'failed')}: {failure.get('error', '?')}{where}{when}"


def _identity_from_config(cfg: DictConfig) -> tuple[str, str, str, str]:
    def name(node: str) -> str:
        value = OmegaConf.select(cfg, f"{node}.name", default=None)
        return str(value) if value is not None else "?"

    try:  # the job plan's parse (a job it refused still lists its budget as the plan would have labelled it)
        budget = parse_budget(cfg.get("budget"), name("method"))
    except KVBenchError:
        return name("model"), name("method"), str(cfg.get("budget")), name("task")
    label = budget.label()
    try:  # a method that is implemented names its own jobs (POD by its window) even when the task is not
        from kvbench.methods import build_method

        label = build_method(OmegaConf.to_container(cfg.method, resolve=True), budget).budget_label(budget) or label
    except (KVBenchError, KeyError, TypeError):
        pass
    return name("model"), name("method"), label, name("task")


def _identity_from_overrides(overrides: Sequence[str]) -> tuple[str, str, str, str]:
    found = {}
    for line in overrides:
        key, _, value = line.lstrip("+~").partition("=")
        if key in IDENTITY_KEYS:
            found[key] = value
    return tuple(found.get(k, "?") for k in IDENTITY_KEYS)  # type: ignore[return-value]


def _cfg_identity(cfg: DictConfig | None) -> Any:
    if cfg is None:
        return None
    return {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("method", "task") if k in cfg}


def _fill_settings(jobs: list[SweepJob]) -> None:
    """Each job's overrides that the other jobs do not share, minus what the identity columns already say."""
    if not jobs:
        return
    common = set(jobs[0].overrides).intersection(*(set(j.overrides) for j in jobs[1:]))
    for job in jobs:
        job.settings = [o for o in job.overrides
                        if o not in common and o.lstrip("+~").partition("=")[0] not in IDENTITY_KEYS]


# ---- listing -------------------------------------------------------------------------------------------------------
def format_listing(jobs: Sequence[SweepJob], title: str = "") -> str:
    """The planned jobs as a table, then how many are in each state."""
    rows = [("#", "model", "method", "budget", "task", "settings", "hash", "status")]
    for i, job in enumerate(jobs):
        status = job.status if not job.detail else f"{job.status}: {job.detail}"
        if job.status == "unavailable":
            status = f"not available yet: {job.detail}"
        rows.append((str(i), job.model, job.method, job.budget, job.task, " ".join(job.settings) or "-",
                     (job.hash or "-")[:12], status))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines = [" | ".join([*(v.ljust(w) for v, w in zip(r[:-1], widths)), r[-1]]) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-------")
    counts = {s: sum(j.status == s for j in jobs) for s in STATUSES}
    summary = ", ".join(f"{n} {_STATUS_WORDS[s]}" for s, n in counts.items() if n)
    head = f"{title}: " if title else ""
    return "\n".join([f"{head}{len(jobs)} planned jobs ({summary})", *lines])


_STATUS_WORDS = {"missing": "to run", "partial": "to resume", "failed": "failed (will rerun)", "finished": "finished",
                 "running": "running elsewhere", "unavailable": "not available yet", "invalid": "invalid"}


# ---- workers -------------------------------------------------------------------------------------------------------
def make_chunks(jobs: Sequence[SweepJob], jobs_per_worker: int | None, max_workers: int | None,
                ) -> list[list[SweepJob]]:
    """Split runnable jobs into worker chunks: a chunk holds one model's jobs (at most ``jobs_per_worker``), so
    its worker loads the model once; with ``max_workers`` the chunks are folded into that many workers (largest
    first onto the least loaded), each running its chunks one model after another."""
    if jobs_per_worker is not None and jobs_per_worker < 1:
        raise ValueError(f"jobs_per_worker must be >= 1 or null; got {jobs_per_worker}")
    if max_workers is not None and max_workers < 1:
        raise ValueError(f"max_workers must be >= 1 or null; got {max_workers}")
    by_model: dict[str, list[SweepJob]] = {}
    for job in jobs:
        by_model.setdefault(job.model_key, []).append(job)
    size = jobs_per_worker or max((len(g) for g in by_model.values()), default=1)
    chunks = [group[i : i + size] for group in by_model.values() for i in range(0, len(group), size)]
    if max_workers is None or len(chunks) <= max_workers:
        return chunks
    workers: list[list[SweepJob]] = [[] for _ in range(max_workers)]
    for chunk in sorted(chunks, key=len, reverse=True):  # stable: equal sizes keep their order
        min(workers, key=len).extend(chunk)
    return [w for w in workers if w]
