"""Sweeps: every paper table as one command, dispatched through Hydra's launchers, skipping what is finished.

    python -m kvbench.run -m +experiment=dynamickv_table1 plan=true          # list the jobs and their state
    python -m kvbench.run -m +experiment=dynamickv_table1 launcher=slurm     # submit what is not finished

``hydra/sweeper: kvbench`` (hydra_plugins/kvbench_sweep, run by ``sweeper.run_sweep``) expands the sweep with
Hydra's override grammar and composition (``plan``), drops jobs that are finished, groups the rest by model into
worker chunks and hands the chunks to the configured Hydra launcher (basic, or hydra-submitit-launcher's local /
Slurm executors through the thin subclasses in hydra_plugins/kvbench_sweep). Each launched job is a ``worker``
that loads its model once and runs its jobs in sequence, recording each failure in the store (``failed.json``)
without stopping the others.
"""
