"""Query-aware vs query-agnostic: the same jobs with ``question=with_context`` and ``question=after_compression``
side by side.

``with_context`` compresses the prompt with the question inside it (what the papers do; a scorer such as SnapKV sees
the question in its observation window); ``after_compression`` compresses the context alone, then feeds the question
and the chat-template tail uncompressed, then decodes (kvpress's leaderboard's main rows). ``load_runs`` gives every
run its ``question``; this module pairs the runs of the two modes that agree on everything else (model, task protocol,
method configuration, budget) and lays them out:

* ``question_table``: one row per (task, method, budget) with each mode's score, its % of the FullKV of the **same**
  mode (FullKV's two runs see the same tokens, so they should agree: a check printed beside them), the resident KV
  after compression (MiB, mean over samples; under ``after_compression`` the question's tokens join the cache after
  this point, uncompressed) and the sample counts;
* ``question_summary``: per method and budget, the mean % of FullKV over the tasks that have both modes, and the
  change.

The runs may come from more than one results directory (the CPU miniature's ``with_context`` runs are committed under
``results/cpu_miniature``, its ``after_compression`` column under ``results/cpu_miniature_query_agnostic``): pass the
concatenated frames. ``python -m kvbench.report readme`` writes the tables into the two query-agnostic READMEs.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from kvbench.report.store import budget_order, canonical_json, resident_kv_bytes

MODES = ("with_context", "after_compression")
SHORT = {"with_context": "with ctx", "after_compression": "after compr."}


def _protocol_key(task_cfg: dict[str, Any]) -> str:
    return canonical_json({k: v for k, v in task_cfg.items() if k != "fields"})


def _fmt(value: float | None, decimals: int = 2, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:+.{decimals}f}" if sign else f"{value:.{decimals}f}"


def pairs(runs: pd.DataFrame, tasks: list[str] | None = None, budgets: list[str] | None = None,
          methods: list[str] | None = None) -> list[dict[str, Any]]:
    """One dict per (model, task protocol, method configuration, budget) with its run per question mode (absent
    when a mode was not run) and the FullKV run of each mode on the same task protocol. ``tasks`` (``needle_chat``,
    ``passkey``, ``ruler niah_multikey_1``), ``budgets`` and ``methods`` (names) restrict the rows (FullKV is always
    looked up). Sorted by task, FullKV first, then method label and budget."""
    if runs.empty:
        return []
    frame = runs.copy()
    if "question" not in frame.columns:
        frame["question"] = "with_context"
    frame["_p"] = frame["task_cfg"].map(_protocol_key)
    full: dict[tuple[str, str, str], dict[str, Any]] = {}
    cells: dict[tuple[str, str, str, str, str], dict[str, Any]] = {}
    for run in frame.to_dict("records"):
        if run["question"] not in MODES:
            continue
        if run["method"] == "fullkv":
            full.setdefault((run["model"], run["_p"], run["question"]), run)
        if tasks is not None and _task_name(run) not in tasks:
            continue
        if budgets is not None and run["method"] != "fullkv" and run["budget"] not in budgets:
            continue
        if methods is not None and run["method"] not in methods:
            continue
        key = (run["model"], run["_p"], run["method_label"], run["budget"], run["task"])
        cell = cells.setdefault(key, {"model": run["model"], "task": _task_name(run), "method": run["method"],
                                      "method_label": run["method_label"], "budget": run["budget"],
                                      "_p": run["_p"], "runs": {}})
        cell["runs"].setdefault(run["question"], run)
    out = []
    for cell in cells.values():
        cell["full"] = {m: full.get((cell["model"], cell["_p"], m)) for m in MODES}
        out.append(cell)
    out.sort(key=lambda c: (c["model"], c["task"], c["_p"], c["method"] != "fullkv", c["method_label"],
                            budget_order(c["budget"])))
    return out


def _task_name(run: dict[str, Any]) -> str:
    """``needle_chat`` for the needle run inside the chat template (the config's name), else the task's name."""
    cfg = run.get("task_cfg") or {}
    if run["task"] == "needle" and cfg.get("chat_template"):
        return "needle_chat"
    if run["task"] == "ruler" and cfg.get("tasks"):
        return "ruler " + "+".join(cfg["tasks"])
    return str(run["task"])


def _pct(run: dict[str, Any] | None, full: dict[str, Any] | None) -> float | None:
    if run is None or full is None or not full["score"] or math.isnan(full["score"]):
        return None
    return 100.0 * run["score"] / full["score"]


def _mib(run: dict[str, Any] | None) -> float | None:
    value = resident_kv_bytes(run["scores"]) if run is not None else None
    return value / 2**20 if value is not None else None


def question_table(runs: pd.DataFrame, tasks: list[str] | None = None, budgets: list[str] | None = None,
                   methods: list[str] | None = None) -> pd.DataFrame:
    """The side-by-side table (see the module docstring) as strings."""
    rows = []
    for cell in pairs(runs, tasks, budgets, methods):
        wc, ac = (cell["runs"].get(m) for m in MODES)
        row = {"task": cell["task"], "method": cell["method_label"], "budget": cell["budget"]}
        for mode, run in (("with_context", wc), ("after_compression", ac)):
            row[f"score {SHORT[mode]}"] = _fmt(run["score"] if run is not None else None)
        row["Δ score"] = _fmt(ac["score"] - wc["score"] if wc is not None and ac is not None else None, 2, sign=True)
        for mode, run in (("with_context", wc), ("after_compression", ac)):
            row[f"% FullKV {SHORT[mode]}"] = _fmt(_pct(run, cell["full"][mode]), 1)
        for mode, run in (("with_context", wc), ("after_compression", ac)):
            row[f"KV MiB {SHORT[mode]}"] = _fmt(_mib(run), 3)
        row["n"] = " / ".join(str(r["n_samples"]) if r is not None else "—" for r in (wc, ac))
        rows.append(row)
    columns = ["task", "method", "budget", "score with ctx", "score after compr.", "Δ score", "% FullKV with ctx",
               "% FullKV after compr.", "KV MiB with ctx", "KV MiB after compr.", "n"]
    return pd.DataFrame(rows, columns=columns)


def question_summary(runs: pd.DataFrame, tasks: list[str] | None = None, budgets: list[str] | None = None,
                     methods: list[str] | None = None) -> pd.DataFrame:
    """Per method and budget: the mean % of its own mode's FullKV over the tasks where both modes ran, and the
    change (``after_compression`` − ``with_context``, in points of % FullKV)."""
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for cell in pairs(runs, tasks, budgets, methods):
        if cell["method"] == "fullkv":
            continue
        wc, ac = (_pct(cell["runs"].get(m), cell["full"][m]) for m in MODES)
        entry = by.setdefault((cell["method_label"], cell["budget"]), {"wc": [], "ac": [], "tasks": []})
        if wc is not None and ac is not None:
            entry["wc"].append(wc)
            entry["ac"].append(ac)
            entry["tasks"].append(cell["task"])
    rows = []
    for (label, budget), entry in sorted(by.items(), key=lambda kv: (kv[0][0], budget_order(kv[0][1]))):
        n = len(entry["tasks"])
        wc = sum(entry["wc"]) / n if n else None
        ac = sum(entry["ac"]) / n if n else None
        rows.append({"method": label, "budget": budget, "% FullKV with ctx": _fmt(wc, 1),
                     "% FullKV after compr.": _fmt(ac, 1),
                     "Δ points": _fmt(ac - wc if wc is not None and ac is not None else None, 1, sign=True),
                     "tasks": str(n)})
    return pd.DataFrame(rows, columns=["method", "budget", "% FullKV with ctx", "% FullKV after compr.", "Δ points",
                                       "tasks"])


def markdown(frame: pd.DataFrame) -> str:
    """A frame of strings as a GitHub Markdown table."""
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["MODES", "markdown", "pairs", "question_summary", "question_table"]
