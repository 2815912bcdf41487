"""kvbench's Hydra plugins: the sweeper (kvbench_sweeper) and launchers that wait for every job (kvbench_launchers)."""
