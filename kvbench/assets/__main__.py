"""``python -m kvbench.assets [NAME ...]`` fetches the offline assets into the cache (``kvbench.assets.main``);
``python -m kvbench.assets bundle DIR`` writes everything a node without a package index needs (``kvbench.bundle``,
which builds on ``kvbench.assets``: the command line sits above both, so neither imports the other's caller)."""

from __future__ import annotations

import sys

from kvbench import assets


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bundle"]:
        from kvbench.bundle import main as bundle_main

        sys.exit(bundle_main(argv))
    assets.main(argv)


if __name__ == "__main__":
    main()
