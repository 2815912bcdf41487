"""hydra-submitit-launcher's local and Slurm launchers, waiting for every job instead of stopping at the first failure.

The upstream ``launch`` returns ``[j.results()[0] for j in jobs]``: the first job that died (scancel, OOM killer,
lost node) raises, the sweep stops there and the outcome of the array tasks after it is never collected. Here every
job is polled until it is done, and a dead one becomes a FAILED JobReturn carrying submitit's error, so the sweeper
can say which jobs it took with it. Everything else (the executors, their parameters from ``hydra.launcher``, the
pickled ``__call__`` that composes and runs the job) is the upstream launcher's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class WaitForAll:
    """Mixed into hydra-submitit-launcher's launchers (hydra_plugins/kvbench_sweep/kvbench_launchers.py)."""

    _EXECUTOR: str
    params: dict[str, Any]
    config: Any

    def _executor(self) -> Any:
        """A submitit AutoExecutor with ``hydra.launcher``'s parameters: the shared ones (timeout_min, mem_gb, ...)
        as they are, the executor-specific ones (partition, array_parallelism, ...) prefixed with its name."""
        import submitit

        params = dict(self.params)
        folder = params.pop("submitit_folder")
        init = {}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=folder, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and len(job_overrides) > 0
        executor = self._executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("submitit '%s' sweep output dir: %s", self._EXECUTOR, sweep_dir)
        calls = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            calls.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*calls))
        log.info("submitted %s", ", ".join(str(j.job_id) for j in jobs))
        return wait_for_all(jobs, job_overrides)


def wait_for_all(jobs: Sequence[Any], job_overrides: Sequence[Sequence[str]], poll_s: float = 1.0,
                 ) -> list[JobReturn]:
    """Poll every submitit job until done; a job that raises (or died without a result) gives a FAILED return."""
    results: list[JobReturn | None] = [None] * len(jobs)
    pending = set(range(len(jobs)))
    while pending:
        for i in sorted(pending):
            if not jobs[i].done():
                continue
            pending.discard(i)
            try:
                results[i] = jobs[i].results()[0]
            except Exception as exc:  # UncompletedJobError / FailedJobError: the job died or its function raised
                log.error("job %s failed: %s", jobs[i].job_id, str(exc).splitlines()[0] if str(exc) else exc)
                results[i] = JobReturn(overrides=list(job_overrides[i]), status=JobStatus.FAILED, _return_value=exc)
        if pending:
            time.sleep(poll_s)
    return [r for r in results if r is not None]
