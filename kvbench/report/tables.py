"""A paper's table in the paper's layout, with the paper's numbers, kvbench's (``ours``) and the difference.

``build_table(spec, runs)`` returns a ``PaperTable``: rows and columns in the order the paper prints them, one
``Cell`` per (row, column) holding

* ``paper``: the number as printed (a string; None where the paper has no number);
* ``recomputed``: for a derived column (an average, a category mean), the paper's own rule applied to the paper's
  own inputs (its printed cells, or those of its ``sources`` tables), printed with the paper's rounding — with no
  runs at all this is what the report checks the printed averages against;
* ``ours``: the same cell from kvbench's store, aggregated with the paper's rule; None where nothing was run.

``PaperTable.checks`` lists every printed derived number with its recomputation (``ok`` when the printed value is one
the rule allows); ``footnotes`` say where they disagree, which rows kvbench cannot run and why.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pandas as pd

from kvbench.report import names
from kvbench.report.ours import Lookup, Target, is_quality_metric
from kvbench.report.paper import decimals_of, load_cells
from kvbench.report.specs import Derived, TableSpec, get_spec


@dataclass
class Row:
    id: str
    model: str
    label: str
    budget: str
    method: str
    target: Target | None = None
    why: str = ""  # why kvbench has no number for this row


@dataclass
class Column:
    id: str
    header: str
    decimals: int
    derived: Derived | None = None
    retained_of: str | None = None  # "% of FullKV" of this column


@dataclass
class Cell:
    paper: str | None = None
    recomputed: float | None = None
    ours: float | None = None

    @property
    def paper_num(self) -> float | None:
        try:
            return float(self.paper) if self.paper is not None else None
        except ValueError:
            return None

    @property
    def delta(self) -> float | None:
        p = self.paper_num
        return None if p is None or self.ours is None else self.ours - p


@dataclass
class Check:
    """A printed derived number against the paper's own rule applied to the paper's own inputs."""

    row: str
    column: str
    printed: float
    exact: float  # the unrounded recomputation
    allowed: list[float]

    @property
    def ok(self) -> bool:
        return any(abs(self.printed - a) < 1e-9 for a in self.allowed)


@dataclass
class PaperTable:
    spec: TableSpec
    caption: str
    provenance: str
    rows: list[Row]
    columns: list[Column]
    cells: dict[tuple[str, str], Cell]
    checks: list[Check] = field(default_factory=list)
    footnotes: list[str] = field(default_factory=list)
    #: row id -> mean resident KV bytes of the runs behind the row's numbers of ours
    kv: dict[str, float] = field(default_factory=dict)

    @property
    def has_ours(self) -> bool:
        return any(c.ours is not None for c in self.cells.values())

    def cell(self, row: str, column: str) -> Cell:
        return self.cells.get((row, column), Cell())


def _base(column: str) -> str:
    return column.split("@", 1)[0].split(":", 1)[0]


class _SourceIndex:
    """Printed cells of other tables of the same paper, by (model, method, budget label) and row label."""

    def __init__(self, spec: TableSpec, paper_dir: Path | None):
        self.rows: dict[tuple[str, str, str | None], list[tuple[str, dict[str, float]]]] = {}
        for table in spec.sources:
            cells = load_cells(get_spec(spec.paper, table), paper_dir)
            for (model, method, budget, label), group in cells.groupby(
                    ["model", "method", "budget", "clean_label"], sort=False):
                values = {c: v for c, v in zip(group["col"], group["value_num"]) if not math.isnan(v)}
                key = (model, method, names.budget_label(budget))
                self.rows.setdefault(key, []).append((label, values))

    def value(self, model: str, method: str, budget: str, label: str, column: str) -> float | None:
        found = self.rows.get((model, method, names.budget_label(budget)), [])
        labelled = [values for other, values in found if other == label]
        merged: dict[str, float] = {}
        for values in labelled or ([v for _, v in found] if len({o for o, _ in found}) == 1 else []):
            merged.update(values)  # one row may be split over several source tables (OmniKV Tables 4 and 5)
        return merged.get(column)


def _target(spec: TableSpec, first: dict, ours_models: dict[str, str]) -> tuple[Target | None, str]:
    """The kvbench run for a paper row, or None and why not."""
    from kvbench.methods import METHODS

    if not spec.ours:
        return None, spec.ours_reason
    model = ours_models.get(first["model"]) or ours_models.get("*") or names.model_name(first["model_hf"])
    if model is None:
        return None, f"no conf/model for {first['model']} ({first['model_hf'] or 'no HF id'})"
    overrides = spec.methods
    if first["clean_label"] in overrides:
        method = overrides[first["clean_label"]]
    elif first["method"] in overrides:
        method = overrides[first["method"]]
    else:
        method = names.METHODS.get(first["method"])
    if method is None:
        return None, f"no kvbench counterpart of {first['method']} ({first['clean_label']})"
    method = dict(method)
    task_fields = dict(method.pop("task", {}) or {})
    if method["name"] not in METHODS.entries:
        return None, f"method {method['name']!r} is not implemented in kvbench yet"
    budget = "full" if method["name"] == "fullkv" else names.budget_label(first["budget"])
    if method["name"] == "pod" and budget is not None:
        budget = f"window{method.get('n_s', 16)}+{method.get('n_r', 4080)}"
    if budget is None:
        return None, f"budget {first['budget']!r} has no kvbench equivalent"
    return Target(model, method, budget, task_fields), ""


def build_table(spec: TableSpec, runs: pd.DataFrame | None = None, paper_dir: Path | None = None,
                ours_models: dict[str, str] | None = None) -> PaperTable:
    """The table with paper / recomputed / ours cells. ``ours_models`` maps a paper model label (or ``*`` for all)
    to a kvbench model name, e.g. ``{"*": "smollm2-135m"}`` for a CPU miniature in the paper's layout."""
    cells_frame = load_cells(spec, paper_dir)
    sources = _SourceIndex(spec, paper_dir)
    lookup = Lookup(runs if runs is not None else pd.DataFrame(columns=["model", "task", "method", "budget"]))
    caption, provenance = _caption(spec, cells_frame.iloc[0].to_dict(), paper_dir)

    # ---- columns and rows in the paper's order ----
    derived = {d.column: d for d in spec.derived}
    metric_of: dict[str, str] = {}
    columns: list[Column] = []
    for col, group in cells_frame.groupby("col", sort=False):
        metric_of[col] = str(group["metric"].iloc[0])
        decimals = max((decimals_of(v) for v in group["value"]), default=2)
        d = derived.get(col)
        columns.append(Column(col, str(group["header"].iloc[0]), d.decimals if d else decimals, d))
    for name in spec.retained:
        base = next((c for c in columns if c.id == name), None)
        if base is not None:
            columns.append(Column(f"{name} %full", f"{base.header} % of FullKV", 1, retained_of=name))
    rows: list[Row] = []
    by_row: dict[str, list[dict]] = {}
    for record in cells_frame.to_dict("records"):
        by_row.setdefault(record["row"], []).append(record)
    for row_id, group in by_row.items():
        head = group[0]
        label = head["label"]
        if head["method"] == "POD" and any(m in head["model"] for m in names.POD_ADAPTED_MODELS):
            label = f"{label} ({names.POD_POST_TRAINING}; ours: POD-TF)"
        target, why = _target(spec, head, ours_models or {})
        rows.append(Row(row_id, head["model"], label, head["budget"], head["method"], target, why))
    printed_cols = [c.id for c in columns if c.derived is None and c.retained_of is None]

    def inputs_of(d: Derived) -> tuple[str, ...]:
        if d.of == "all":
            return tuple(c for c in printed_cols if is_quality_metric(metric_of.get(c)) and c not in derived)
        return tuple(d.of)

    # ---- the paper's own numbers, printed and recomputed ----
    printed: dict[tuple[str, str], str] = {}
    oom: dict[tuple[str, str], str] = {}  # POD Table 3: out of memory in the paper's run
    for row in rows:
        for r in by_row[row.id]:
            if isinstance(r["value"], str):
                printed[(row.id, r["col"])] = r["value"]
            elif isinstance(r["notes"], str) and r["notes"].startswith("OOM"):
                oom[(row.id, r["col"])] = "OOM"

    def paper_value(row: Row, col: str, head: dict) -> float | None:
        text = printed.get((row.id, col))
        if text is not None:
            try:
                return float(text)
            except ValueError:
                return None
        found = sources.value(head["model"], head["method"], head["budget"], head["clean_label"], col)
        if found is not None:
            return found
        d = derived.get(col)
        if d is not None:
            values = [paper_value(row, c, head) for c in inputs_of(d)]
            if values and all(v is not None for v in values):
                return d.apply(values)  # type: ignore[arg-type]
        return None

    cells: dict[tuple[str, str], Cell] = {}
    checks: list[Check] = []
    for row in rows:
        head = by_row[row.id][0]
        for col in columns:
            if col.retained_of:
                continue
            cell = Cell(paper=printed.get((row.id, col.id), oom.get((row.id, col.id))))
            if col.derived is not None:
                values = [paper_value(row, c, head) for c in inputs_of(col.derived)]
                if values and all(v is not None for v in values):
                    exact = sum(values) / len(values)  # type: ignore[arg-type]
                    cell.recomputed = col.derived.apply(values)  # type: ignore[arg-type]
                    if cell.paper_num is not None:
                        checks.append(Check(row.id, col.id, cell.paper_num, exact, col.derived.candidates(exact)))
            cells[(row.id, col.id)] = cell

    # ---- ours ----
    def ours_value(target: Target, col: str) -> float | None:
        d = derived.get(col)
        if d is not None:
            values = [ours_value(target, c) for c in inputs_of(d)]
            return d.apply(values) if values and all(v is not None for v in values) else None  # type: ignore
        if col in spec.columns and spec.columns[col] is None:
            return None
        if col in metric_of and not is_quality_metric(metric_of[col]):
            return None
        return lookup.get(target, _base(col))[0]

    if spec.kind == "quality":
        for row in rows:
            if row.target is None:
                continue
            for col in columns:
                if not col.retained_of:
                    cells[(row.id, col.id)].ours = ours_value(row.target, col.id)

    # ---- % of FullKV ----
    for col in (c for c in columns if c.retained_of):
        for row in rows:
            head = by_row[row.id][0]
            cell = Cell()
            full_row = next((r for r in rows if r.model == row.model and r.method == "FullKV"), None)
            full_paper = (paper_value(full_row, col.retained_of, by_row[full_row.id][0]) if full_row else
                          sources.value(head["model"], "FullKV", "full", "", col.retained_of))
            mine = cells[(row.id, col.retained_of)].paper_num
            if full_paper and mine is not None:
                cell.paper = f"{100 * mine / full_paper:.1f}"
            if row.target is not None:
                ours = cells[(row.id, col.retained_of)].ours
                full_target = Target(row.target.model, {"name": "fullkv"}, "full")
                full_ours = ours_value(full_target, col.retained_of)
                if ours is not None and full_ours:
                    cell.ours = round(100 * ours / full_ours, 1)
            cells[(row.id, col.id)] = cell

    table = PaperTable(spec, caption, provenance, rows, columns, cells, checks)
    for row in rows:
        kv = lookup.resident_kv(row.target) if row.target is not None else None
        if kv is not None:
            table.kv[row.id] = kv
    if spec.delta_row:
        _delta_checks(table, spec.delta_row)
    if spec.degradation:
        _degradation_checks(table, spec.degradation, paper_dir)
    table.footnotes = _footnotes(table, lookup)
    return table


@lru_cache(maxsize=4)
def _captions(index: str) -> dict[tuple[str, str], str]:
    import csv

    if not Path(index).exists():
        return {}
    with open(index, newline="", encoding="utf-8") as fh:
        return {(e["paper"], e["table"]): re.sub(r"<[^>]+>|\*\*?", "", e["caption"]).strip()
                for e in csv.DictReader(fh)}


def _caption(spec: TableSpec, first: dict, paper_dir: Path | None) -> tuple[str, str]:
    from kvbench.report.paper import default_paper_dir

    caption = _captions(str((paper_dir or default_paper_dir()) / "tables.csv")).get((spec.paper, spec.table), "")
    line = first.get("caption_line", "")
    where = f"{first.get('source_text', '')}" + (f" line {line}" if isinstance(line, str) and line else "")
    return caption, f"results/paper/{spec.file} (from {where})"


def _delta_checks(table: PaperTable, rule: dict) -> None:
    """D2O Table 17's "↑" row: D2O minus the best compressed baseline of the same model, per column."""
    for row in (r for r in table.rows if r.method == rule["method"]):
        same = [r for r in table.rows if r.model == row.model]
        minuend = next(r for r in same if r.method == rule["minuend"])
        others = [r for r in same if r.method not in rule["exclude"] and r.method != rule["method"]]
        for col in table.columns:
            cell = table.cell(row.id, col.id)
            mine = table.cell(minuend.id, col.id).paper_num
            rivals = [table.cell(r.id, col.id).paper_num for r in others]
            rivals = [v for v in rivals if v is not None]
            if cell.paper_num is None or mine is None or not rivals:
                continue
            exact = mine - max(rivals)
            cell.recomputed = round(exact, col.decimals)
            table.checks.append(Check(row.id, col.id, cell.paper_num, exact, [round(exact, col.decimals)]))


def _degradation_checks(table: PaperTable, rule: dict, paper_dir: Path | None) -> None:
    """POD Table 4's degradation: mean over ``columns`` of (dense - method) / dense, in %, from ``source``."""
    source = build_table(get_spec(table.spec.paper, rule["source"]), None, paper_dir)
    by_method: dict[str, Row] = {}
    for r in source.rows:
        by_method.setdefault(r.method, r)
    dense = by_method[rule["dense"]]
    col_id = next(c.id for c in table.columns if "degradation" in c.id)
    for row in table.rows:
        other = by_method.get(row.method)
        cell = table.cell(row.id, col_id)
        if other is None or cell.paper_num is None:
            continue
        drops = []
        for col in rule["columns"]:
            full, mine = source.cell(dense.id, col).paper_num, source.cell(other.id, col).paper_num
            if full and mine is not None:
                drops.append(100 * (full - mine) / full)
        if len(drops) == len(rule["columns"]):
            exact = sum(drops) / len(drops)
            cell.recomputed = round(exact, rule["decimals"])
            allowed = Derived(col_id, ("x",), "round", rule["decimals"]).candidates(exact)
            table.checks.append(Check(row.id, col_id, cell.paper_num, exact, allowed))


def _footnotes(table: PaperTable, lookup: Lookup) -> list[str]:
    notes = []
    if table.spec.notes:
        notes.append(table.spec.notes.strip())
    for check in table.checks:
        if not check.ok:
            notes.append(f"{check.row}, {check.column}: printed {check.printed:g}, the paper's rule on its own "
                         f"cells gives {check.exact:.4f} (see results/paper/NOTES.md)")
    if table.spec.kind == "efficiency":
        notes.append("Efficiency table: kvbench measures these with `python -m kvbench.bench`; paper numbers only.")
    elif table.spec.kind == "reference":
        notes.append("Reference table (model/data facts): paper numbers only.")
    else:
        why: dict[str, list[str]] = {}
        for row in table.rows:
            if row.target is None and row.why:
                why.setdefault(row.why, []).append(row.label)
        for reason, labels in why.items():
            shown = sorted(set(labels))
            notes.append(f"ours blank for {', '.join(shown[:6])}{' …' if len(shown) > 6 else ''}: {reason}")
    notes += [f"several runs for {a}" for a in sorted(set(lookup.ambiguous))]
    return notes
