"""Qualitative claims checked on a results directory: ``<results>/claims.yaml`` -> ``report/claims.md``.

A CPU miniature cannot reproduce a paper's numbers (other models, other lengths), but it can test the *direction* of
each paper's claims. ``claims.yaml`` states them as data; ``python -m kvbench.report all`` evaluates every claim on
the finished runs and writes a table saying, with the numbers, whether it held. The quantity compared is a run's
score as a percentage of the FullKV run of the same model, task and protocol ("% FullKV"), per task and averaged over
the claim's tasks (tasks only count where every compared run exists).

Claim kinds (``kind``):

* ``compare``: at each budget ``b`` of ``budgets``, ``better`` scores at least as high as each method of ``than``
  (at most as high with ``lower_is_better: true``, e.g. perplexity).
* ``near_full``: at each budget, ``method`` keeps at least ``at_least`` % of FullKV.
* ``monotone``: each method of ``methods`` never scores lower at a larger budget of ``budgets``.
* ``fullkv_solves``: FullKV scores at least ``at_least`` on ``tasks`` (else the paper's claim is untestable here).

A method is ``name`` or ``name@label`` where ``label`` is a budget label with ``{b}`` (the budget) and ``{r}``
(``b - 16``, POD's recent window) substituted; a plain name means ``name@{b}``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

KINDS = ("compare", "near_full", "monotone", "fullkv_solves")


def load_claims(path: Path) -> dict[str, Any]:
    spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    for claim in spec.get("claims", []):
        if claim.get("kind") not in KINDS:
            raise ValueError(f"{path}: claim {claim.get('claim')!r} has kind={claim.get('kind')!r}; "
                             f"valid kinds: {', '.join(KINDS)}")
    return spec


def pct_fullkv(runs: pd.DataFrame, model: str) -> dict[tuple[str, str, str], float]:
    """``{(task, method, budget): % of the FullKV score}`` for one model (tasks with a FullKV score > 0)."""
    sel = runs[runs["model"] == model]
    out: dict[tuple[str, str, str], float] = {}
    for (task, _), group in sel.groupby(["task", "protocol"], sort=True):
        full = group[group["method"] == "fullkv"]["score"]
        if full.empty or not float(full.iloc[0]) > 0:
            continue
        for run in group.itertuples(index=False):
            out[(task, run.method, str(run.budget))] = 100.0 * float(run.score) / float(full.iloc[0])
    return out


def _ref(method: str, budget: int) -> tuple[str, str]:
    name, _, label = method.partition("@")
    return name, (label or "{b}").format(b=budget, r=budget - 16)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _values(table: dict, tasks: list[str], refs: list[tuple[str, str]]) -> dict[str, list[float]]:
    """Per task with every ref present: the refs' % FullKV, in order."""
    return {t: [table[(t, m, b)] for m, b in refs] for t in tasks if all((t, m, b) in table for m, b in refs)}


def evaluate(claim: dict[str, Any], runs: pd.DataFrame, model: str, default_tasks: list[str]) -> list[dict[str, Any]]:
    """One row per (claim, budget): the numbers, the per-task count and the verdict."""
    tasks = list(claim.get("tasks") or default_tasks)
    kind = claim["kind"]
    rows: list[dict[str, Any]] = []
    if kind == "fullkv_solves":
        sel = runs[(runs["model"] == model) & (runs["method"] == "fullkv") & runs["task"].isin(tasks)]
        for run in sel.itertuples(index=False):
            held = float(run.score) >= float(claim["at_least"])
            rows.append({"budget": "full", "numbers": f"FullKV {run.task} = {float(run.score):.2f}",
                         "tasks": "1/1" if held else "0/1", "verdict": "held" if held else "not testable here"})
        return rows or [{"budget": "", "numbers": "no FullKV run", "tasks": "", "verdict": "not run"}]
    table = pct_fullkv(runs, model)
    if kind == "monotone":
        budgets = list(claim["budgets"])
        for method in claim["methods"]:
            per_task = _values(table, tasks, [_ref(method, b) for b in budgets])
            ok = {t: all(a <= c + 1e-9 for a, c in zip(v, v[1:])) for t, v in per_task.items()}
            means = [_mean([v[i] for v in per_task.values()]) for i in range(len(budgets))]
            rows.append(_row(f"{method.split('@')[0]} {'/'.join(map(str, budgets))}",
                             " -> ".join(f"{m:.1f}" for m in means), ok,
                             all(a <= c + 1e-9 for a, c in zip(means, means[1:]))))
        return rows
    for budget in claim["budgets"]:
        if kind == "near_full":
            ref = _ref(claim["method"], budget)
            per_task = _values(table, tasks, [ref])
            ok = {t: v[0] >= claim["at_least"] for t, v in per_task.items()}
            mean = _mean([v[0] for v in per_task.values()])
            rows.append(_row(budget, f"{ref[0]} {mean:.1f} % (>= {claim['at_least']})", ok,
                             mean >= claim["at_least"]))
            continue
        better = _ref(claim["better"], budget)
        others = [_ref(m, budget) for m in claim["than"]]
        sign = -1.0 if claim.get("lower_is_better") else 1.0
        per_task = _values(table, tasks, [better, *others])
        ok = {t: all(sign * (v[0] - o) >= -1e-9 for o in v[1:]) for t, v in per_task.items()}
        means = [_mean([v[i] for v in per_task.values()]) for i in range(1 + len(others))]
        numbers = f"{better[0]} {means[0]:.1f} vs " + ", ".join(f"{m} {x:.1f}" for (m, _), x in zip(others, means[1:]))
        rows.append(_row(budget, numbers, ok, all(sign * (means[0] - x) >= -1e-9 for x in means[1:])))
    return rows


def _row(budget: Any, numbers: str, ok: dict[str, bool], mean_held: bool) -> dict[str, Any]:
    if not ok:
        return {"budget": budget, "numbers": "runs missing", "tasks": "", "verdict": "not run"}
    return {"budget": budget, "numbers": numbers, "tasks": f"{sum(ok.values())}/{len(ok)}",
            "verdict": "held" if mean_held else "did not hold"}


def _tokens(budget: str) -> int | None:
    """A token budget label as tokens; POD's ``window<n_s>+<n_r>`` as n_s + n_r; ratios and ``full``: None."""
    match = re.fullmatch(r"window(\d+)\+(\d+)", budget)
    if match:
        return int(match[1]) + int(match[2])
    return int(budget) if budget.isdigit() else None


def summary_markdown(runs: pd.DataFrame, model: str, tasks: list[str]) -> list[str]:
    """Method x token budget: % of FullKV averaged over ``tasks`` (only where the method ran on all of them)."""
    table = pct_fullkv(runs, model)
    cells: dict[tuple[str, int], list[float]] = {}
    for (task, method, budget), value in table.items():
        tokens = _tokens(budget)
        if task in tasks and tokens is not None and method != "fullkv":
            cells.setdefault((method, tokens), []).append(value)
    budgets = sorted({b for _, b in cells})
    methods = sorted({m for m, _ in cells})
    lines = [f"Mean % of FullKV over {', '.join(tasks)} (POD: window = budget):", "",
             "| method | " + " | ".join(str(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for method in methods:
        values = [cells.get((method, b), []) for b in budgets]
        lines.append(f"| {method} | " + " | ".join(f"{_mean(v):.1f}" if len(v) == len(tasks) else "" for v in values)
                     + " |")
    return lines + [""]


def claims_markdown(spec: dict[str, Any], runs: pd.DataFrame) -> str:
    """The claims table (Markdown) of a results directory's ``claims.yaml``."""
    model = spec["model"]
    tasks = list(spec.get("tasks") or [])
    lines = [
        "# Qualitative claims on this result set", "",
        f"Model `{model}`; numbers are % of FullKV on the same task, averaged over the tasks where every compared run "
        f"exists ({', '.join(tasks)} unless a claim says otherwise). `tasks`: on how many tasks the claim held "
        "alone. Generated by `python -m kvbench.report all` from `claims.yaml`.", "",
        *summary_markdown(runs, model, tasks),
        "| paper | claim | source | budget | numbers | tasks | verdict |", "|---|---|---|---|---|---|---|",
    ]
    counts: dict[str, int] = {}
    for claim in spec.get("claims", []):
        for i, row in enumerate(evaluate(claim, runs, model, tasks)):
            counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
            said = (claim["paper"], claim["claim"], claim.get("source", "")) if i == 0 else ("", "", "")
            lines.append(f"| {' | '.join(said)} | {row['budget']} | {row['numbers']} | {row['tasks']} | "
                         f"**{row['verdict']}** |")
    lines += ["", "Rows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".", ""]
    return "\n".join(lines)


def write_claims(results: Path, runs: pd.DataFrame, out: Path) -> Path | None:
    """``out/claims.md`` when ``results/claims.yaml`` exists."""
    path = results / "claims.yaml"
    if not path.exists():
        return None
    out.mkdir(parents=True, exist_ok=True)
    target = out / "claims.md"
    target.write_text(claims_markdown(load_claims(path), runs), encoding="utf-8")
    return target


__all__ = ["KINDS", "claims_markdown", "evaluate", "load_claims", "pct_fullkv", "summary_markdown", "write_claims"]
