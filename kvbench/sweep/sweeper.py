"""What ``hydra/sweeper: kvbench`` (hydra_plugins/kvbench_sweep) does with a sweep: plan it, skip what is finished,
launch one worker per model chunk through the configured Hydra launcher, and summarise the outcomes.

Hydra's basic sweeper hands every point of the product to the launcher, which cannot skip finished jobs and starts
one process (one model load) per job. This keeps Hydra's expansion and launchers and changes what is launched: the
planned, deduplicated, not yet finished jobs, grouped into chunks that each share one model. With ``plan=true`` it
only prints the listing.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from kvbench.store import atomic_write_text
from kvbench.sweep.plan import Composer, SweepJob, expand, format_listing, make_chunks, plan_sweep

log = logging.getLogger(__name__)

_EXIT_CODE = 0


def sweep_exit_code() -> int:
    """1 when the last sweep in this process had failed jobs (``python -m kvbench.run -m`` exits with it)."""
    return _EXIT_CODE


def run_sweep(config: DictConfig, hydra_context: Any, launcher: Any, arguments: list[str], params: dict[str, Any],
              blocks: Sequence[dict[str, Any]] | None, jobs_per_worker: int | None, max_workers: int | None,
              pin_gpus: bool) -> list[Sequence[JobReturn]]:
    """Plan (and print the listing), then, unless ``plan=true``, launch the runnable jobs' workers and summarise."""
    from kvbench.sweep.pending import register_pending_placeholders

    global _EXIT_CODE
    _EXIT_CODE = 0
    register_pending_placeholders()
    started = time.time()
    composer = Composer(hydra_context.config_loader, config.hydra.job.config_name, list(config.hydra.overrides.hydra))
    override_lists = expand(params, blocks, arguments, composer.parser)
    name = sweep_name(config)
    jobs = plan_sweep(composer, override_lists, name)
    print(format_listing(jobs, name) + f"\n(planned in {time.time() - started:.1f} s)", flush=True)
    if config.get("plan"):
        return []

    todo = [j for j in jobs if j.runnable]
    chunks = make_chunks(todo, jobs_per_worker, max_workers)
    skipped = [j for j in jobs if j.status == "finished"]
    if not chunks:
        print(summarize(jobs, {}, skipped), flush=True)
        return []
    sweep_dir = Path(str(config.hydra.sweep.dir))
    chunk_files = write_chunks(sweep_dir, chunks, pin_gpus)
    print(f"launching {len(chunks)} worker(s) for {len(todo)} job(s) (jobs per worker: "
          f"{', '.join(str(len(c)) for c in chunks)}); sweep dir {sweep_dir}", flush=True)
    # A worker's config is the sweep's (the command line without its sweeps, e.g. launcher=slurm) plus its chunk.
    fixed = [o.input_line for o in composer.parser.parse_overrides(arguments) if not o.is_sweep_override()]
    try:
        returns = launcher.launch([[*fixed, f"+sweep_chunk={path}"] for path in chunk_files], initial_job_idx=0)
    except Exception as exc:
        from submitit.core.utils import FailedJobError

        if not isinstance(exc, FailedJobError):
            raise
        # The scheduler refused the submission (sbatch: bad partition, gres, memory, ...): nothing was submitted.
        refusal = " ".join(str(exc).split())
        print(f"error: the launcher could not submit the sweep ({refusal}); nothing was submitted. Set the cluster's "
              "resources with hydra.launcher.partition / gpus_per_node / cpus_per_task / mem_gb / timeout_min "
              "(conf/launcher/slurm.yaml)", file=sys.stderr, flush=True)
        _EXIT_CODE = 2
        return []
    outcomes = collect_outcomes(returns, chunk_files)
    dead = [r for r in returns if r.status != JobStatus.COMPLETED]
    print(summarize(jobs, outcomes, skipped, dead_workers=len(dead)), flush=True)
    _EXIT_CODE = 1 if dead or any(o["status"] == "failed" for o in outcomes.values()) else 0
    return [returns]


def sweep_name(config: DictConfig) -> str:
    """``sweep_name``, else the experiment's name, else the sweep directory's."""
    if config.get("sweep_name"):
        return str(config.sweep_name)
    experiment = OmegaConf.select(config, "hydra.runtime.choices.experiment", default=None)
    return str(experiment) if experiment else Path(str(config.hydra.sweep.dir)).name


# ---- chunks and outcomes ---------------------------------------------------------------------------------------------
def write_chunks(sweep_dir: Path, chunks: Sequence[Sequence[SweepJob]], pin_gpus: bool) -> list[Path]:
    """One JSON file per worker: its jobs' fully resolved configs (what was planned is what runs)."""
    folder = sweep_dir / ".kvbench" / "chunks"
    folder.mkdir(parents=True, exist_ok=True)
    gpus = visible_gpus() if pin_gpus else []
    paths = []
    for index, chunk in enumerate(chunks):
        items = [{"hash": j.hash, "label": j.label, "path": str(j.path),
                  "config": OmegaConf.to_container(j.cfg, resolve=True)} for j in chunk]
        path = folder / f"{index:04d}.json"
        atomic_write_text(path, json.dumps({"worker": index, "workers": len(chunks), "gpus": gpus,
                                            "sweep_dir": str(sweep_dir), "jobs": items}, indent=1, default=str))
        paths.append(path)
    return paths


def visible_gpus() -> list[str]:
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES, else every device torch finds), for pinning workers."""
    import os

    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return listed
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def collect_outcomes(returns: Sequence[JobReturn], chunk_files: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Every launched job's outcome by hash: what its worker returned, or, for a worker that died (killed,
    cancelled before it could answer, lost node), what its record and the store say."""
    from kvbench.sweep.worker import outcomes_of_dead_worker

    outcomes: dict[str, dict[str, Any]] = {}
    for ret, path in zip(returns, chunk_files):
        value = ret._return_value
        if ret.status == JobStatus.COMPLETED and isinstance(value, dict) and "outcomes" in value:
            for outcome in value["outcomes"]:
                outcomes[outcome["hash"]] = outcome
            continue
        cause = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else f"worker returned {value!r}"
        for outcome in outcomes_of_dead_worker(path, cause):
            outcomes[outcome["hash"]] = outcome
    return outcomes


def summarize(jobs: Sequence[SweepJob], outcomes: dict[str, dict[str, Any]], skipped: Sequence[SweepJob],
              dead_workers: int = 0) -> str:
    """succeeded / skipped / failed (with causes) / not run / not available, one line per failure."""
    by_status: dict[str, list[tuple[SweepJob, dict]]] = {}
    labels = {j.hash: j for j in jobs}
    for hash_, outcome in outcomes.items():
        by_status.setdefault(outcome["status"], []).append((labels.get(hash_), outcome))
    unavailable = [j for j in jobs if j.status == "unavailable"]
    other = [j for j in jobs if j.status in ("invalid", "running")]
    counts = [f"{len(by_status.get('succeeded', []))} succeeded",
              f"{len(skipped) + len(by_status.get('skipped', []))} skipped (finished earlier)",
              f"{len(by_status.get('failed', []))} failed",
              f"{len(by_status.get('not_run', []))} not run",
              f"{len(unavailable)} not available yet"]
    if other:
        counts.append(f"{len(other)} not submitted (invalid or running elsewhere)")
    if dead_workers:
        counts.append(f"{dead_workers} worker(s) died")
    lines = ["sweep summary: " + ", ".join(counts)]
    for status, title in (("failed", "failed"), ("not_run", "not run")):
        for job, outcome in by_status.get(status, []):
            label = job.label if job is not None else outcome["hash"]
            lines.append(f"  {title}: {label}: {outcome.get('cause', '?')}"
                         + (f"  ({outcome['path']})" if outcome.get("path") else ""))
    for job in other:
        lines.append(f"  not submitted: {job.label}: {job.status}: {job.detail}")
    return "\n".join(lines)
