"""The papers' tables with kvbench's numbers beside them: a thin wrapper of ``python -m kvbench.report tables``.

    python scripts/make_tables.py --results results/cpu_miniature  # every table, Markdown on stdout
    python scripts/make_tables.py --results results/cpu_miniature --out /tmp/tables --tables DynamicKV:1 D2O:21
    python scripts/make_tables.py --paper-only                     # the papers' tables alone (no runs needed)
"""

import sys

from kvbench.report.cli import main

if __name__ == "__main__":
    sys.exit(main(["tables", *sys.argv[1:]]))
