"""``python -m kvbench.bench [bench=<name>] [model=<name>]``: measure, store, compare with targets.

Cells (method x budget x context length x batch size, per grid of ``conf/bench/<name>.yaml``) are appended to
``<results_dir>/bench/<model>/<bench>/<device>/cells.jsonl`` as they finish (a rerun resumes; ``rerun=true``
measures again), then written as ``cells.csv`` with ``targets.md`` / ``targets.json`` (each target's ratio to FullKV,
to a peer row of plain transformers or to the cell's floor, beside its bound; ``README.md``).
"""

from __future__ import annotations

import sys


def main() -> None:
    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.errors import ConfigError, KVBenchError
    from kvbench.overrides import precheck_overrides

    register_resolvers()
    try:
        for arg in sys.argv[1:]:
            if arg.startswith("bench="):
                options = sorted(p.stem for p in (CONF_DIR / "bench").glob("*.yaml"))
                if arg.partition("=")[2] not in options:
                    raise ConfigError(f"unknown bench {arg.partition('=')[2]!r}; valid benches: {', '.join(options)}")
        precheck_overrides([a for a in sys.argv[1:] if not a.startswith("bench=")], config_name="bench")
    except KVBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    import hydra

    from kvbench.bench.run import run_bench

    hydra.main(config_path=str(CONF_DIR), config_name="bench", version_base="1.3")(run_bench)()


if __name__ == "__main__":
    main()
