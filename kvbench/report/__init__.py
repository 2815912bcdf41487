"""Tables, figures and notebooks from the run store, in the papers' layouts (issue #6).

Modules, one concern each:

* ``names``: the papers' names for models, methods, budgets and tasks -> kvbench's;
* ``specs`` + ``tables.yaml``: per paper table, its aggregation rule and row mapping, as data;
* ``paper``: ``results/paper/*.csv`` (the papers' printed numbers, with provenance) as DataFrames;
* ``store``: the run store (``<results>/runs/...``) as a DataFrame, records and meta on demand;
* ``ours``: which run answers a paper cell;
* ``tables``: a paper table with paper / recomputed / ours / Δ cells; ``runs``: experiment-agnostic run tables;
* ``render``: Markdown, LaTeX and CSV; ``figures``: PNG/PDF figures; ``similarity``: OmniKV's layer similarity;
* ``stats``: paired bootstrap intervals and the sign-flip test; ``claims``: a result set's ``claims.yaml`` verdicts;
* ``readme`` + ``readme.yaml``: the READMEs' generated blocks (methods, tasks, the CPU miniature's verdicts);
* ``cli``: ``python -m kvbench.report`` (``tables``, ``figures``, ``all``, ``check``, ``similarity``, ``readme``).

In a notebook::

    from kvbench.report import load_runs, build_table, get_spec
    runs = load_runs("results")
    table = build_table(get_spec("DynamicKV", "Table 1"), runs)
"""

from __future__ import annotations

from kvbench.report.specs import get_spec, load_specs
from kvbench.report.store import load_runs
from kvbench.report.tables import build_table

__all__ = ["build_table", "get_spec", "load_runs", "load_specs"]
