"""Renderers: a ``PaperTable`` or a plain DataFrame as Markdown, LaTeX (booktabs) and CSV.

The layout is the paper's: its rows in its order, its columns in its order. Where kvbench has numbers for the
table, every column becomes three: the paper's value as printed, ours (same decimals) and Δ = ours − paper, and each
row names the kvbench run configuration and its resident KV (MiB, mean over the runs behind the row); without any,
the paper's table is printed alone. A printed value that the paper's own rule does not reproduce carries a
``*`` and a footnote. Output depends only on the inputs (no dates, no absolute paths), so reruns are byte-identical.
"""

from __future__ import annotations

import csv
import io
import math

import pandas as pd

from kvbench.report.tables import Column, PaperTable


def _num(value: float | None, decimals: int, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    text = f"{value:+.{decimals}f}" if sign else f"{value:.{decimals}f}"
    return f"{0:.{decimals}f}" if float(text) == 0 else text  # no "-0.00" / "+0.00"


def _aggregation(table: PaperTable) -> str:
    parts = []
    for d in table.spec.derived:
        of = "every score column" if d.of == "all" else ", ".join(d.of)
        rounding = {"round": "rounded", "truncate": "truncated", "round_or_truncate": "rounded or truncated"}
        digits = f"{d.decimals} decimal{'s' if d.decimals != 1 else ''}"
        parts.append(f"{d.column} = mean of {of} ({rounding[d.rounding]} to {digits})")
    if table.spec.delta_row:
        rule = table.spec.delta_row
        parts.append(f"{rule['method']} = {rule['minuend']} minus the best of the other compressed methods")
    if table.spec.degradation:
        rule = table.spec.degradation
        parts.append(f"degradation = mean over {', '.join(rule['columns'])} of (dense - method) / dense, %, from "
                     f"{table.spec.paper} {rule['source']}")
    return "; ".join(parts)


def to_frame(table: PaperTable, with_ours: bool | None = None) -> pd.DataFrame:
    """The table as strings, one column per printed column (or per paper/ours/Δ triple)."""
    with_ours = table.has_ours if with_ours is None else with_ours
    failed = {(c.row, c.column) for c in table.checks if not c.ok}
    out: dict[str, list[str]] = {"Model": [], "Method": [], "Budget": []}
    if with_ours:
        out["kvbench"] = []
        out["kvbench KV MiB"] = []
    headers = _headers(table.columns)
    for col in table.columns:
        out[headers[col.id]] = []
        if with_ours:
            out[f"{headers[col.id]} ours"] = []
            out[f"{headers[col.id]} Δ"] = []
    for row in table.rows:
        out["Model"].append(row.model)
        out["Method"].append(row.label)
        out["Budget"].append(row.budget)
        if with_ours:
            out["kvbench"].append(row.target.label if row.target else "")
            kv = table.kv.get(row.id)
            out["kvbench KV MiB"].append(_num(kv / 2**20, 1) if kv is not None else "")
        for col in table.columns:
            cell = table.cell(row.id, col.id)
            mark = "*" if (row.id, col.id) in failed else ""
            out[headers[col.id]].append((cell.paper or "") + mark)
            if with_ours:
                decimals = col.decimals
                out[f"{headers[col.id]} ours"].append(_num(cell.ours, decimals))
                out[f"{headers[col.id]} Δ"].append(_num(cell.delta, decimals, sign=True))
    return pd.DataFrame(out)


def _headers(columns: list[Column]) -> dict[str, str]:
    """Unique display headers (a paper may print the same label twice, e.g. "Avg." for two benchmarks)."""
    seen: dict[str, int] = {}
    out = {}
    for col in columns:
        label = col.header or col.id
        seen[label] = seen.get(label, 0) + 1
        out[col.id] = label if seen[label] == 1 else f"{label} ({col.id})"
    return out


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def frame_to_markdown(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(_md_escape(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    body = ["| " + " | ".join(_md_escape(v) for v in row) + " |" for row in frame.astype(str).itertuples(index=False)]
    return "\n".join([header, rule, *body]) + "\n"


def to_markdown(table: PaperTable) -> str:
    lines = [f"### {table.spec.title}: {table.caption}".rstrip(": "), ""]
    lines.append(f"Source: `{table.provenance}`.")
    agg = _aggregation(table)
    if agg:
        lines.append(f"Aggregation (the paper's): {agg}.")
    lines.append("")
    lines.append(frame_to_markdown(to_frame(table)))
    if table.footnotes:
        lines += [f"* {note}" for note in table.footnotes]
        lines.append("")
    return "\n".join(lines)


def to_csv(table: PaperTable) -> str:
    return frame_to_csv(to_frame(table))


def frame_to_csv(frame: pd.DataFrame) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(list(frame.columns))
    writer.writerows(frame.astype(str).itertuples(index=False))
    return buf.getvalue()


_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
          "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "Δ": r"$\Delta$", "≥": r"$\geq$",
          "↑": r"$\uparrow$", "σ": r"$\sigma$", "β": r"$\beta$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in str(text))


def frame_to_latex(frame: pd.DataFrame, caption: str = "", label: str = "", groups: list[tuple[str, int]] | None
                   = None) -> str:
    """A booktabs ``table`` environment; ``groups`` adds a first header row of (label, span) column groups."""
    spec = "lll" + "r" * (len(frame.columns) - 3) if len(frame.columns) >= 3 else "l" * len(frame.columns)
    lines = ["\\begin{table}[t]", "\\centering", "\\small", f"\\begin{{tabular}}{{{spec}}}", "\\toprule"]
    if groups:
        cells = [f"\\multicolumn{{{span}}}{{c}}{{{latex_escape(name)}}}" if span > 1 else latex_escape(name)
                 for name, span in groups]
        lines.append(" & ".join(cells) + " \\\\")
    lines.append(" & ".join(latex_escape(c) for c in frame.columns) + " \\\\")
    lines.append("\\midrule")
    for row in frame.astype(str).itertuples(index=False):
        lines.append(" & ".join(latex_escape(v) for v in row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    if caption:
        lines.append(f"\\caption{{{latex_escape(caption)}}}")
    if label:
        lines.append(f"\\label{{{label}}}")
    lines.append("\\end{table}")
    return "\n".join(lines) + "\n"


def to_latex(table: PaperTable) -> str:
    frame = to_frame(table)
    groups = None
    if table.has_ours:
        headers = _headers(table.columns)
        fixed = 5  # Model, Method, Budget, kvbench, kvbench KV MiB
        groups = [("", fixed)] + [(headers[c.id], 3) for c in table.columns]
        frame = frame.copy()
        frame.columns = list(frame.columns[:fixed]) + ["paper", "ours", "Δ"] * len(table.columns)
    caption = f"{table.spec.title}: {table.caption}"
    if table.footnotes:
        caption += " " + " ".join(table.footnotes)
    return frame_to_latex(frame, caption, f"tab:{table.spec.id}", groups)
