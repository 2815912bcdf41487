"""hydra-submitit-launcher's local and Slurm launchers that wait for every job (kvbench.sweep.launchers.WaitForAll).

``hydra.launcher._target_`` in conf/launcher/{local,slurm}.yaml; Hydra only instantiates launchers from the
``hydra_plugins`` namespace.
"""

from __future__ import annotations

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as _LocalLauncher
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SlurmLauncher

from kvbench.sweep.launchers import WaitForAll


class LocalLauncher(WaitForAll, _LocalLauncher):
    """submitit's local executor: one process per worker on this machine."""


class SlurmLauncher(WaitForAll, _SlurmLauncher):
    """submitit's Slurm executor: one array job, one array task per worker."""
