"""kvbench's Hydra sweeper: ``hydra/sweeper: kvbench`` (the default in conf/config.yaml).

Hydra only instantiates sweepers and launchers that live in the ``hydra_plugins`` namespace; the work is done in
``kvbench.sweep`` (planning, chunking, workers). Importing this module must stay cheap: Hydra imports every plugin
module at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig


class KVBenchSweeper(Sweeper):
    """Hydra's basic sweeper semantics (``params``: a cartesian product in override syntax; the command line wins),
    plus ``blocks`` (several products for tables that are not one), deduplication by job key, skip-before-submit,
    worker chunks that share a model (``jobs_per_worker``, ``max_workers``, ``pin_gpus``) and a summary."""

    def __init__(self, params: dict[str, Any] | None = None, blocks: Sequence[dict[str, Any]] | None = None,
                 jobs_per_worker: int | None = None, max_workers: int | None = None, pin_gpus: bool = False):
        super().__init__()
        self.params = dict(params or {})
        self.blocks = [dict(b) for b in blocks] if blocks else None
        self.jobs_per_worker = jobs_per_worker
        self.max_workers = max_workers
        self.pin_gpus = pin_gpus
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from kvbench.sweep.sweeper import run_sweep

        assert self.config is not None and self.hydra_context is not None
        return run_sweep(self.config, self.hydra_context, self.launcher, list(arguments), self.params, self.blocks,
                         self.jobs_per_worker, self.max_workers, self.pin_gpus)
