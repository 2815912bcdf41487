"""hydra-submitit-launcher's local and Slurm launchers that wait for every job (kvbench.sweep.launchers.WaitForAll).

``hydra.launcher._target_`` in conf/launcher/{local,slurm}.yaml; Hydra only instantiates launchers from the
``hydra_plugins`` namespace. Hydra imports every module of the namespace at start: where hydra-submitit-launcher is
not installed (a GPU node holding only the session bundle's wheels) this module still imports, and choosing one of
these launchers stops in one line naming the missing package instead of Hydra printing an import error at every run.
"""

from __future__ import annotations

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as _LocalLauncher
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SlurmLauncher
except ModuleNotFoundError as missing:  # no submitit launcher here: the launchers say so when chosen
    from hydra.plugins.launcher import Launcher

    from kvbench.errors import NotAvailableError

    _MISSING = missing.name

    class _Unavailable(Launcher):
        def __init__(self, *args, **kwargs) -> None:
            raise NotAvailableError(
                f"launcher={type(self).__name__.removesuffix('Launcher').lower()} needs hydra-submitit-launcher "
                f"(not importable here: {_MISSING}); install kvbench's dependencies (pip install -e .) or choose "
                "launcher=basic (one job at a time)"
            )

        def setup(self, *args, **kwargs) -> None:  # pragma: no cover - __init__ refuses first
            raise NotImplementedError

        def launch(self, *args, **kwargs):  # pragma: no cover - __init__ refuses first
            raise NotImplementedError

    class LocalLauncher(_Unavailable):
        """submitit's local executor (unavailable: hydra-submitit-launcher is not installed)."""

    class SlurmLauncher(_Unavailable):
        """submitit's Slurm executor (unavailable: hydra-submitit-launcher is not installed)."""

else:
    from kvbench.sweep.launchers import WaitForAll

    class LocalLauncher(WaitForAll, _LocalLauncher):
        """submitit's local executor: one process per worker on this machine."""

    class SlurmLauncher(WaitForAll, _SlurmLauncher):
        """submitit's Slurm executor: one array job, one array task per worker."""
