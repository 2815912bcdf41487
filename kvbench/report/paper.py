"""The papers' numbers (``results/paper/*.csv``) as pandas DataFrames keyed by row and column, as printed.

Each CSV row is one printed cell: ``paper, table, model, model_hf, method, method_label, budget, budget_type, task,
task_label, category, context_length, metric, value, notes`` plus provenance (``source_text``, ``caption_line``,
``page``). ``value`` stays the printed string (its decimals are the paper's); ``value_num`` is its float, NaN where
the text has no number. ``load_cells`` adds:

* ``col``: the column id (``narrativeqa``, ``Single-Doc QA`` for a category cell, ``avg``; ``@<context>`` when the
  table has several context lengths, ``:<metric>`` when one task has several metrics);
* ``header``: the paper's column label (``NrtvQA``, ``50k``, ``Avg.``);
* ``row``: the row id ``model | method label | budget`` and ``label``: the method label shown (the paper's method
  id, or its cleaned row label where one method has several rows, e.g. ablations).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import pandas as pd

from kvbench.config import project_root
from kvbench.errors import DataError
from kvbench.report.names import clean_label
from kvbench.report.specs import TableSpec

_CATEGORY_TASKS = ("category_avg",)


def default_paper_dir() -> Path:
    return Path(project_root()) / "results" / "paper"


@lru_cache(maxsize=64)
def _read(path: str) -> pd.DataFrame:
    if not Path(path).exists():
        raise DataError(f"paper table {path} is missing; regenerate results/paper/ with scripts/import_paper_tables.py")
    return pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])


def load_raw(spec: TableSpec, paper_dir: Path | None = None) -> pd.DataFrame:
    """The table's CSV rows as printed (strings), minus the rows the spec excludes."""
    frame = _read(str((paper_dir or default_paper_dir()) / spec.file)).copy()
    if spec.exclude_labels:
        frame = frame[~frame["method_label"].isin(spec.exclude_labels)]
    return frame.reset_index(drop=True)


def decimals_of(value: str | float | None) -> int:
    if not isinstance(value, str) or "." not in value:
        return 0
    return len(value.split(".", 1)[1])


def _col_ids(frame: pd.DataFrame) -> pd.Series:
    base = frame["category"].where(frame["task"].isin(_CATEGORY_TASKS), frame["task"]).fillna("")
    contexts = frame["context_length"].dropna().unique()
    with_context = len(contexts) > 1
    col = base.copy()
    if with_context:
        col = col.where(frame["context_length"].isna(), base + "@" + frame["context_length"].fillna(""))
    metrics_per_col = frame.assign(_c=col).groupby("_c")["metric"].nunique()
    several = col.map(metrics_per_col).fillna(0) > 1
    return col.where(~several, col + ":" + frame["metric"].fillna(""))


def _headers(frame: pd.DataFrame) -> pd.Series:
    label = frame["task_label"].fillna(frame["task"]).fillna("")
    label = label.where(~frame["task"].isin(_CATEGORY_TASKS), frame["task_label"].fillna(frame["category"]))
    ids = frame["col"]
    ctx = ids.str.contains("@", regex=False)
    label = label.where(~ctx, label + " " + frame["context_length"].fillna(""))
    met = ids.str.contains(":", regex=False)
    return label.where(~met, label + " (" + frame["metric"].fillna("") + ")")


def load_cells(spec: TableSpec, paper_dir: Path | None = None) -> pd.DataFrame:
    """The table's cells with column ids, row ids and numeric values (paper order kept; cached: do not modify)."""
    return _cells(spec.file, spec.exclude_labels, str(paper_dir or default_paper_dir()))


@lru_cache(maxsize=128)
def _cells(file: str, exclude_labels: tuple[str, ...], paper_dir: str) -> pd.DataFrame:
    frame = _read(str(Path(paper_dir) / file)).copy()
    if exclude_labels:
        frame = frame[~frame["method_label"].isin(exclude_labels)].reset_index(drop=True)
    frame["value_num"] = pd.to_numeric(frame["value"], errors="coerce")
    frame["col"] = _col_ids(frame)
    frame["header"] = _headers(frame)
    frame["clean_label"] = frame["method_label"].map(clean_label)
    for key in ("model", "method", "budget"):
        frame[key] = frame[key].fillna("")
    labels_per_group = frame.groupby(["model", "method", "budget"])["clean_label"].transform("nunique")
    frame["label"] = frame["method"].where(labels_per_group <= 1, frame["clean_label"])
    frame.loc[frame["label"] == "", "label"] = frame["clean_label"]
    frame["row"] = frame["model"] + " | " + frame["label"] + (" | " + frame["budget"]).where(frame["budget"] != "", "")
    return frame


def pivot(cells: pd.DataFrame) -> tuple[list[str], list[str], dict[tuple[str, str], pd.Series]]:
    """Row ids and column ids in the paper's order, and ``{(row, col): cell}``."""
    rows = list(dict.fromkeys(cells["row"]))
    cols = list(dict.fromkeys(cells["col"]))
    index = {(r.row, r.col): r for r in cells.itertuples(index=False)}
    return rows, cols, index


def as_float(value: object) -> float:
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
    return out
