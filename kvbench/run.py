"""``python -m kvbench.run``: compose -> check -> run the job (``kvbench.jobs``) or the sweep (``kvbench.sweep``).

Everything the user can get wrong is checked before a model loads, and reported as one line with exit code 2. The
command line is only this: the job runner and the sweep machinery live below it and never import it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kvbench.config import register_resolvers
from kvbench.errors import KVBenchError
from kvbench.jobs import plan_job, run_job  # noqa: F401  (re-exported for one release: import them from kvbench.jobs)
from kvbench.overrides import precheck_overrides

log = logging.getLogger("kvbench")


# ---- entry points ----------------------------------------------------------------------------------------------------
@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if cfg.get("sweep_chunk"):  # a worker launched by kvbench's sweeper: several jobs, one model load
        from kvbench.sweep.worker import run_worker

        return run_worker(cfg.sweep_chunk)
    if cfg.plan:  # list this one job and its state in the store; run nothing
        from kvbench.sweep.plan import format_listing, plan_config

        print(format_listing([plan_config(cfg)]))
        return None
    try:
        scores = run_job(cfg, prepared=_take_prepared())
    except KVBenchError as exc:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            log.error("job failed: %s", exc)
            return None
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    return scores.get("score")


def _expose_hydra_plugins() -> None:
    """Make this checkout's ``hydra_plugins`` (kvbench's sweeper and launchers) visible to Hydra's plugin scan.

    A regular install puts ``hydra_plugins/kvbench_sweep`` into site-packages. An editable install (``pip install
    -e .``) maps the ``kvbench`` package only, so outside the checkout Hydra would not find the sweeper ("Unknown
    plugin class"). Then the checkout's root goes to the end of ``sys.path`` and of ``PYTHONPATH`` (submitit's
    worker processes unpickle the launcher from there)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    if not (root / "hydra_plugins" / "kvbench_sweep").is_dir() or importlib.util.find_spec(
            "hydra_plugins.kvbench_sweep") is not None:
        return
    sys.path.append(str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(root)) if p)


def main() -> None:
    register_resolvers()
    _expose_hydra_plugins()
    try:
        precheck_overrides(sys.argv[1:])
        _preflight(sys.argv[1:])
    except KVBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if _is_sweep(sys.argv[1:]):  # a paper's table names baselines that have not landed: list them, do not fail
        from kvbench.sweep.pending import register_pending_placeholders

        register_pending_placeholders()
    try:
        _hydra_main()
    except KeyboardInterrupt as exc:  # Ctrl-C: one line (a job says what it kept), not Python's traceback
        message = str(exc) or "interrupted; a rerun of the same command resumes any job it started"
        print(f"error: {message}", file=sys.stderr)
        sys.exit(130)
    sweeper = sys.modules.get("kvbench.sweep.sweeper")
    if sweeper is not None and sweeper.sweep_exit_code():
        sys.exit(sweeper.sweep_exit_code())


#: the job kvbench.run's preflight planned and prepared (its task holds its data), for the run after it in this process
_PREPARED: list = []


def _take_prepared() -> object | None:
    """The preflight's job, once (run_job reads the task's data from it instead of preparing it again)."""
    return _PREPARED.pop() if _PREPARED else None


def _preflight(argv: list[str]) -> None:
    """One job's checks before Hydra creates anything (its log directory lives under the results root): compose the
    config as Hydra will, refuse a results directory that cannot be written, then plan the job (every value checked,
    nothing loaded) and refuse a job another process is running. Sweeps and Hydra's own flags (--help, --cfg) are
    left to Hydra and the sweeper; a config that does not compose is left to Hydra to explain."""
    sweep = _is_sweep(argv)
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR
    from kvbench.jobs.runner import refuse_before_loading
    from kvbench.store import JobDir, check_results_writable

    # a sweep: only where its results go (its jobs are planned by the sweeper)
    overrides = [a for a in argv if a.partition("=")[0].startswith("paths.")] if sweep else argv
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except Exception:  # noqa: BLE001 - Hydra reports its own composition errors when it runs
        return
    check_results_writable(cfg.paths.results_dir)
    if sweep:
        return
    if cfg.plan:
        return  # the listing shows an invalid job as such
    job = plan_job(cfg)
    jobdir = JobDir(cfg.paths.results_dir, job.parts, job.key)
    if jobdir.finished_scores(cfg.limit) is not None:
        return  # skipped by the run, which says so
    refuse_before_loading(job, jobdir)  # the job runner's own refusals, here before Hydra creates anything
    _PREPARED[:] = [job]  # its data is read: run_job takes the task from here instead of reading it twice


def _is_sweep(argv: list[str]) -> bool:
    """-m, or an experiment (experiments set hydra.mode=MULTIRUN)."""
    return any(a in ("-m", "--multirun") or a.lstrip("+").startswith("experiment=") for a in argv)


if __name__ == "__main__":
    main()
