"""Qualitative claims checked on a results directory: ``<results>/claims.yaml`` -> ``report/claims.md``.

A CPU miniature cannot reproduce a paper's numbers (other models, other lengths), but it can test the *direction* of
each paper's claims. ``claims.yaml`` states them as data; ``python -m kvbench.report all`` evaluates every claim on
the finished runs and writes, per claim and budget, the numbers with their 95 % confidence intervals, the effect
size, the p-value, the resident KV bytes of what was compared and a verdict: ``held``, ``did not hold`` or
``inconclusive`` (the data cannot tell at the 5 % level).

**The quantity.** A sample's score as a percentage of FullKV: ``r_i = 100 * s_i / F_t``, where ``s_i`` is the
sample's score in the run's ``samples.jsonl`` and ``F_t`` FullKV's mean score on the same task (the same model). A
method's "% of FullKV" on a claim is the mean of ``r_i`` per task, averaged over the claim's tasks with equal weight
(the mean of a task's datasets' means where its records name a ``dataset``, as LongBench and RULER aggregate). For
tasks whose score is the mean of their samples' (needle, passkey, RULER) it equals ``100 * score / FullKV score``;
for PG-19 (perplexity, ``exp`` of the token-mean NLL) a sample is a document and its perplexity, and the mean of the
documents' ratios can differ slightly from the ratio of the aggregates. Because ``F_t`` is a constant per task,
paired differences of ``r_i`` are differences of scores in units of FullKV's.

**Pairing.** The compared runs are joined on the sample id per task: a statistic uses the samples every compared run
has (a failed sample drops out of all), and a task counts only when every compared run and a FullKV run with a
positive score exist. Where several runs match a method and budget (several configurations), the first of
``load_runs``' order is used (the default configuration sorts first); a compared run whose configuration is not the
method's current default is named under the table.

**Statistics** (``kvbench.report.stats``; ``ALPHA`` = 0.05, 10,000 resamples, fixed seed, so the same runs give the
same bytes): every number is given with its 95 % percentile interval from the stratified paired bootstrap over
samples (tasks are strata; all compared runs and FullKV are resampled with the same samples, and a resample's "% of
FullKV" is the ratio of its paired means, ``100 * mean(method) / mean(FullKV)``, so a method equal to FullKV on every
sample gets the interval [100, 100]; a difference's interval is that of the difference of these ratios). The point
estimates are the mean per-sample ratios defined above. Differences are tested with the
exact paired sign-flip (randomisation) test, two-sided: with 10 samples per task a bootstrap test would be too
liberal, and the randomisation test's null ("on every sample the two runs are exchangeable") is the claim's null.
The intervals are descriptive; the verdict follows the test (an interval can exclude 0 where the exact test does not
reach 5 %).

Claim kinds (``kind``) and their verdicts:

* ``compare``: at each budget ``b`` of ``budgets``, ``better`` scores higher than each method of ``than`` (lower
  with ``lower_is_better: true``, e.g. perplexity). Each pair: ``Δ = better - other`` (sign-flipped for
  ``lower_is_better``, so ``Δ > 0`` is the claimed direction) with its sign-flip p-value, Holm-adjusted over the
  pairs of the same budget. A pair **held** when the adjusted ``p < 0.05`` and ``Δ > 0``, **did not hold** when the
  adjusted ``p < 0.05`` and ``Δ < 0``, else **inconclusive**. The claim at ``b`` held when every pair held, did not
  hold when some pair did not hold, else inconclusive. A better method that keeps more resident KV bytes than the
  other says so (``keeps 10.7x the bytes``).
* ``near_full``: at each budget, ``method`` keeps at least ``at_least`` % of FullKV: **held** when the lower end of
  its 95 % interval (paired with FullKV, above) is ``>= at_least``, **did not hold** when the upper end is
  ``< at_least``, else **inconclusive**; the p-value is the bootstrap p of "the % of FullKV is ``at_least``" (twice
  the smaller tail of the resamples), ``Δ = % of FullKV - at_least``. The method's resident KV is given as a share
  of FullKV's.
* ``monotone``: each method of ``methods`` never scores lower at a larger budget of ``budgets``. Per method, each
  step to the next budget is tested (sign-flip, Holm over the method's steps): **did not hold** when a step
  decreases significantly; **held** when none does and the largest budget scores significantly above the smallest
  (sign-flip on that difference: "more budget" must be seen to matter); else **inconclusive**.
* ``fullkv_solves``: FullKV scores at least ``at_least`` on ``tasks``: **held**, else **not testable here** (a
  precondition, not a paper's result: without it no method can be compared on the task).

A method is ``name`` or ``name@label`` where ``label`` is a budget label with ``{b}`` (the budget) and ``{r}``
(``b - 16``, POD's recent window) substituted; a plain name means ``name@{b}``. A plain ``name`` is the first of its
runs in load order (the method's default configuration where it ran); ``name[field=value,...]`` names one
configuration exactly: the method's name plus the fields that differ from its defaults, sorted, as the run's
``method_label`` writes them (``d2o[allocation=paper_literal]``, ``streamingllm@0.7``,
``d2o[allocation=paper_literal]@0.5``). Budgets may be token budgets (``128``) or ratios of the prompt (``0.5``).

Resident KV is a run's ``resident_kv_bytes_mean`` (after prefill, mean over samples), or its
``resident_kv_bytes_final_mean`` where the task reports one (PG-19 streams the text through decoding: its prefill is
one token), averaged over the claim's tasks, in MiB.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from kvbench.report import store
from kvbench.report.stats import ALPHA, Strata, bootstrap, bootstrap_p, holm, interval, sign_flip_p
from kvbench.report.store import resident_kv_bytes

KINDS = ("compare", "near_full", "monotone", "fullkv_solves")
VERDICTS = ("held", "did not hold", "inconclusive", "not testable here", "not run")
#: a better method keeping at least this much more resident KV than the one it is compared with says so
BYTES_NOTE_RATIO = 1.05


def load_claims(path: Path) -> dict[str, Any]:
    spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    for claim in spec.get("claims", []):
        if claim.get("kind") not in KINDS:
            raise ValueError(f"{path}: claim {claim.get('claim')!r} has kind={claim.get('kind')!r}; "
                             f"valid kinds: {', '.join(KINDS)}")
    return spec


Ref = tuple[str, str]  # (method, budget label)


@dataclass
class _Run:
    label: str
    score: float
    kv: float | None
    samples: dict[str, tuple[str, float]]  # id -> (stratum, score)


class Evidence:
    """The per-sample scores and resident KV of one model's runs, by (task, method, budget label).

    ``runs`` is ``store.load_runs``' frame; the records come from a ``records`` column when present (tests), else
    from ``<results_dir>/<path>/samples.jsonl``."""

    def __init__(self, runs: pd.DataFrame, model: str, results_dir: str | Path | None = None):
        self.model = model
        self.runs: dict[tuple[str, str, str], _Run] = {}
        #: by (task, ``name[field=value,...]``, budget): the runs of a non-default configuration, named exactly
        self.configured: dict[tuple[str, str, str], _Run] = {}
        for row in runs[runs["model"] == model].to_dict("records"):
            key = (str(row["task"]), str(row["method"]), str(row["budget"]))
            config = configured_name(str(row["method"]), str(row.get("method_label", row["method"])))
            exact = (key[0], config, key[2])
            if key in self.runs and (config == key[1] or exact in self.configured):
                continue  # several runs of one configuration: the first in load order
            recs = row["records"] if "records" in row else store.records(results_dir or ".", row["path"])
            samples = {}
            for rec in recs:
                score = rec.get("score")
                if isinstance(score, (int, float)) and not isinstance(score, bool) and math.isfinite(score):
                    stratum = str((rec.get("meta") or {}).get("dataset") or "")
                    samples[str(rec["id"])] = (stratum, float(score))
            scores = row.get("scores") if isinstance(row.get("scores"), dict) else {}
            run = _Run(str(row.get("method_label", row["method"])), float(row["score"]), resident_kv_bytes(scores),
                       samples)
            self.runs.setdefault(key, run)  # several configurations: the first in load order (the default sorts first)
            if config != key[1]:
                self.configured.setdefault(exact, run)
        self.full: dict[str, float] = {}
        for (task, method, _), run in self.runs.items():
            if method == "fullkv" and task not in self.full:
                mean = _stratified_mean(run.samples)
                if mean > 0:
                    self.full[task] = mean

    def run(self, task: str, ref: Ref) -> _Run | None:
        """``ref``'s run on ``task``: a ``name[...]`` ref is that configuration's, a plain name the first run."""
        return (self.configured if "[" in ref[0] else self.runs).get((task, *ref))

    def has(self, task: str, ref: Ref) -> bool:
        run = self.run(task, ref)
        return run is not None and bool(run.samples)

    def usable(self, tasks: list[str], refs: list[Ref]) -> list[str]:
        """The tasks where FullKV has a positive score and every ref has a run."""
        return [t for t in tasks if t in self.full and all(self.has(t, r) for r in refs)]

    def strata(self, tasks: list[str], refs: list[Ref]) -> Strata:
        """% of FullKV per sample for every ref, paired on the sample ids, one stratum per (task, dataset)."""
        values, weights = [], []
        for task in tasks:
            runs = [self.run(task, r) for r in refs]
            ids = sorted(set.intersection(*(set(run.samples) for run in runs)))
            by_stratum: dict[str, list[str]] = {}
            for i in ids:
                by_stratum.setdefault(runs[0].samples[i][0], []).append(i)
            for stratum in sorted(by_stratum):
                chosen = by_stratum[stratum]
                values.append([[100.0 * run.samples[i][1] / self.full[task] for i in chosen] for run in runs])
                weights.append(1.0 / (len(tasks) * len(by_stratum)))
        return Strata.of(values, weights)

    def kv(self, tasks: list[str], ref: Ref) -> float | None:
        runs = [self.run(t, ref) for t in tasks]
        values = [run.kv for run in runs if run is not None and run.kv is not None]
        return sum(values) / len(values) if values else None

    def labels(self, tasks: list[str], ref: Ref) -> set[str]:
        return {run.label for run in (self.run(t, ref) for t in tasks) if run is not None}


def configured_name(method: str, label: str) -> str:
    """``d2o[allocation=paper_literal]``: the method's name plus the non-default fields of its ``method_label``
    (whose name part can be a display name: POD's is ``POD-TF``); the plain name for a default configuration."""
    _, bracket, fields = label.partition("[")
    return f"{method}[{fields}" if bracket else method


def _stratified_mean(samples: dict[str, tuple[str, float]]) -> float:
    by: dict[str, list[float]] = {}
    for stratum, score in samples.values():
        by.setdefault(stratum, []).append(score)
    return sum(sum(v) / len(v) for v in by.values()) / len(by) if by else math.nan


def _ref(method: str, budget: int) -> Ref:
    name, _, label = method.partition("@")
    return name, (label or "{b}").format(b=budget, r=budget - 16)


# ---- formatting -------------------------------------------------------------------------------------------------

def _num(x: float, sign: bool = False) -> str:
    text = f"{x:+.1f}" if sign else f"{x:.1f}"
    return "0.0" if float(text) == 0 else text  # no "-0.0" / "+0.0"


def _ci(mean: float, low: float, high: float, sign: bool = False) -> str:
    return f"{_num(mean, sign)} [{_num(low, sign)}, {_num(high, sign)}]"


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _mib(value: float | None) -> str:
    return "?" if value is None else f"{value / 2**20:.1f}"


def _bytes_note(mine: float | None, other: float | None, name: str) -> str:
    if mine is None or other is None or other <= 0 or mine / other < BYTES_NOTE_RATIO:
        return ""
    return f"keeps {mine / other:.1f}x {name}'s bytes"


# ---- evaluation -------------------------------------------------------------------------------------------------

@dataclass
class Comparison:
    """One tested comparison: a row of the detailed table."""

    compared: str
    values: str
    delta: str
    p: str
    n: str
    kv: str
    verdict: str
    note: str = ""
    summary: str = ""  # "vs h2o +70.7 (p <0.001)": the effect and p-value in the verdict table


@dataclass
class Verdict:
    """A claim at one budget (``monotone``: one method): its verdict and the comparisons behind it."""

    budget: str
    verdict: str
    rows: list[Comparison] = field(default_factory=list)
    #: the claim's method ran under a configuration that is not its current default (``d2o[allocation=...]``)
    ran_as: str = ""

    @property
    def notes(self) -> list[str]:
        said = [f"{r.compared.split(' vs ')[0]} {r.note}" if " vs " in r.compared else r.note
                for r in self.rows if r.note]
        return [f"ran as {self.ran_as}", *said] if self.ran_as else said


def _ran_as(evidence: Evidence, tasks: list[str], ref: Ref) -> str:
    """The configurations a plain name's runs used where they are not the method's current default: a run's
    ``method_label`` with fields in brackets under the method's own name (``d2o[allocation=variance_softmax,...]``,
    stored before D2O's default changed). Display names (POD's ``POD-TF[...]``) and exactly named refs: ""."""
    if "[" in ref[0]:
        return ""
    labels = sorted(x for x in evidence.labels(tasks, ref) if x.partition("[")[0] == ref[0] and "[" in x)
    return ", ".join(labels)


def _n(data: Strata, tasks: list[str]) -> str:
    return f"{data.samples} ({len(tasks)} task{'s' * (len(tasks) != 1)})"


def _pair_verdict(delta: float, p: float) -> str:
    if p < ALPHA and delta > 0:
        return "held"
    if p < ALPHA and delta < 0:
        return "did not hold"
    return "inconclusive"


def _combine(verdicts: list[str]) -> str:
    if verdicts and all(v == "held" for v in verdicts):
        return "held"
    return "did not hold" if "did not hold" in verdicts else "inconclusive"


def _differences(data: Strata, a: int, b: int) -> list[np.ndarray]:
    return [values[a] - values[b] for values in data.values]


FULL: Ref = ("fullkv", "full")


def _measure(evidence: Evidence, tasks: list[str], refs: list[Ref]) -> tuple[Strata, np.ndarray, np.ndarray]:
    """The per-sample values of ``refs`` and FullKV (last series), each ref's % of FullKV and its resamples: the
    ratio of the paired means, ``100 * mean(method) / mean(FullKV)`` on the same samples (equal to the mean of the
    per-sample ratios when every FullKV sample is compared)."""
    data = evidence.strata(tasks, [*refs, FULL])
    draws = bootstrap(data)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = 100.0 * data.means()[:-1] / data.means()[-1]
        ratio_draws = 100.0 * draws[:, :-1] / draws[:, -1:]
    return data, ratio, ratio_draws


def evaluate(claim: dict[str, Any], evidence: Evidence, default_tasks: list[str]) -> list[Verdict]:
    """One ``Verdict`` per budget of the claim (``monotone``: per method), each with its comparisons."""
    tasks = list(claim.get("tasks") or default_tasks)
    kind = claim["kind"]
    if kind == "fullkv_solves":
        return _fullkv_solves(claim, evidence, tasks)
    if kind == "monotone":
        return [_monotone(evidence, tasks, method, list(claim["budgets"])) for method in claim["methods"]]
    if kind == "near_full":
        return [_near_full(evidence, tasks, _ref(claim["method"], b), float(claim["at_least"]), b)
                for b in claim["budgets"]]
    return [_compare(evidence, tasks, claim, b) for b in claim["budgets"]]


def _missing(budget: Any) -> Verdict:
    return Verdict(str(budget), "not run", [Comparison("", "runs missing", "", "", "", "", "not run")])


def _compare(evidence: Evidence, tasks: list[str], claim: dict[str, Any], budget: int) -> Verdict:
    better = _ref(claim["better"], budget)
    others = [_ref(m, budget) for m in claim["than"]]
    used = evidence.usable(tasks, [better, *others])
    if not used:
        return _missing(budget)
    data, means, draws = _measure(evidence, used, [better, *others])
    low, high = interval(draws)
    sign = -1.0 if claim.get("lower_is_better") else 1.0
    raw = [sign_flip_p(_differences(data, 0, j), data.weights) for j in range(1, len(others) + 1)]
    adjusted = holm(raw)
    kv_better = evidence.kv(used, better)
    rows = []
    for j, (other, p) in enumerate(zip(others, adjusted), start=1):
        delta = sign * (means[0] - means[j])
        d_low, d_high = interval(sign * (draws[:, 0] - draws[:, j]))
        kv_other = evidence.kv(used, other)
        verdict = _pair_verdict(delta, p)
        rows.append(Comparison(
            f"{better[0]} vs {other[0]}",
            f"{_ci(means[0], low[0], high[0])} vs {_ci(means[j], low[j], high[j])}",
            _ci(delta, d_low, d_high, sign=True), _p(p), _n(data, used), f"{_mib(kv_better)} vs {_mib(kv_other)}",
            verdict, _bytes_note(kv_better, kv_other, other[0]), f"vs {other[0]} {_num(delta, sign=True)} (p {_p(p)})"))
    return Verdict(str(budget), _combine([r.verdict for r in rows]), rows, _ran_as(evidence, used, better))


def _near_full(evidence: Evidence, tasks: list[str], ref: Ref, at_least: float, budget: int) -> Verdict:
    used = evidence.usable(tasks, [ref])
    if not used:
        return _missing(budget)
    data, means, draws = _measure(evidence, used, [ref])
    mean, draws = float(means[0]), draws[:, 0]
    low, high = (float(x) for x in interval(draws))
    verdict = "held" if low >= at_least else "did not hold" if high < at_least else "inconclusive"
    p = bootstrap_p(draws, at_least)
    kv, kv_full = evidence.kv(used, ref), evidence.kv(used, ("fullkv", "full"))
    note = f"keeps {100 * kv / kv_full:.0f} % of FullKV's bytes" if kv is not None and kv_full else ""
    row = Comparison(f"{ref[0]} vs {at_least:g} %", _ci(mean, low, high),
                     _ci(mean - at_least, low - at_least, high - at_least, sign=True), _p(p), _n(data, used),
                     f"{_mib(kv)} vs FullKV {_mib(kv_full)}", verdict, note,
                     f"{_num(mean)} [{_num(low)}, {_num(high)}] vs {at_least:g} (p {_p(p)})")
    return Verdict(str(budget), verdict, [row], _ran_as(evidence, used, ref))


def _monotone(evidence: Evidence, tasks: list[str], method: str, budgets: list[int]) -> Verdict:
    refs = [_ref(method, b) for b in budgets]
    name = method.split("@")[0]
    where = f"{name} {'/'.join(map(str, budgets))}"
    used = evidence.usable(tasks, refs)
    if not used:
        return _missing(where)
    data, means, draws = _measure(evidence, used, refs)
    low, high = interval(draws)
    steps = [(j, means[j + 1] - means[j]) for j in range(len(refs) - 1)]
    step_p = holm([sign_flip_p(_differences(data, j + 1, j), data.weights) for j, _ in steps])
    total = means[-1] - means[0]
    t_low, t_high = interval(draws[:, -1] - draws[:, 0])
    total_p = sign_flip_p(_differences(data, len(refs) - 1, 0), data.weights)
    if any(p < ALPHA and d < 0 for (_, d), p in zip(steps, step_p)):
        verdict = "did not hold"
    elif total_p < ALPHA and total > 0:
        verdict = "held"
    else:
        verdict = "inconclusive"
    values = " -> ".join(_ci(m, lo, hi) for m, lo, hi in zip(means, low, high))
    delta = (f"{_ci(total, t_low, t_high, sign=True)} ({budgets[-1]} vs {budgets[0]}); steps "
             + ", ".join(_num(d, sign=True) for _, d in steps))
    p_text = f"{_p(total_p)}; steps " + ", ".join(_p(p) for p in step_p)
    kv = " -> ".join(_mib(evidence.kv(used, r)) for r in refs)
    worst = min(range(len(steps)), key=lambda j: (steps[j][1], j))
    summary = (f"{budgets[-1]} vs {budgets[0]} {_num(total, sign=True)} (p {_p(total_p)}); worst step "
               f"{_num(steps[worst][1], sign=True)} (p {_p(step_p[worst])})")
    return Verdict(where, verdict, [Comparison(name, values, delta, p_text, _n(data, used), kv, verdict, "",
                                               summary)], _ran_as(evidence, used, refs[0]))


def _fullkv_solves(claim: dict[str, Any], evidence: Evidence, tasks: list[str]) -> list[Verdict]:
    out = []
    for (task, method, budget), run in sorted(evidence.runs.items()):
        if method != "fullkv" or task not in tasks:
            continue
        verdict = "held" if run.score >= float(claim["at_least"]) else "not testable here"
        numbers = f"FullKV {task} = {run.score:.2f} (needs >= {float(claim['at_least']):g})"
        out.append(Verdict(budget, verdict, [Comparison("fullkv", numbers, "", "", f"{len(run.samples)}",
                                                        _mib(run.kv), verdict, "", numbers)]))
    return out or [_missing("")]


# ---- tables -----------------------------------------------------------------------------------------------------

def _tokens(budget: str) -> int | None:
    """A token budget label as tokens; POD's ``window<n_s>+<n_r>`` as n_s + n_r; ratios and ``full``: None."""
    match = re.fullmatch(r"window(\d+)\+(\d+)", budget)
    if match:
        return int(match[1]) + int(match[2])
    return int(budget) if budget.isdigit() else None


def _column(budget: str) -> tuple[int, float] | None:
    """A summary column: token budgets (POD's window as tokens) first, then ratios of the prompt; ``full``: None."""
    tokens = _tokens(budget)
    if tokens is not None:
        return (0, float(tokens))
    try:
        ratio = float(budget)
    except ValueError:
        return None
    return (1, ratio) if 0 < ratio < 1 else None


def _header(column: tuple[int, float]) -> str:
    return str(int(column[1])) if column[0] == 0 else f"{column[1]:g}"


def summary_markdown(evidence: Evidence, tasks: list[str], configured: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Method x budget (token budgets, then ratios of the prompt where any ran): % of FullKV over ``tasks`` with its
    95 % interval and the resident KV (MiB), where the method ran on all of them. ``configured``: exactly named
    configurations (``d2o[allocation=paper_literal]``) that get rows of their own beside their method's."""
    cells: dict[tuple[str, tuple[int, float]], list[tuple[str, str]]] = {}
    # a plain name's cell is its first run's unless that run is a configuration with a row of its own
    named = [key for key, run in evidence.runs.items() if configured_name(key[1], run.label) not in configured]
    named += [key for key in evidence.configured if key[1] in configured]
    for task, method, budget in named:
        column = _column(budget)
        if task in tasks and column is not None and method != "fullkv":
            cells.setdefault((method, column), []).append((task, budget))
    budgets = sorted({b for _, b in cells})
    methods = sorted({m for m, _ in cells})
    used_all = [t for t in tasks if t in evidence.full]
    ratios = " Budgets below 1 are ratios of each prompt." if any(b[0] == 1 for b in budgets) else ""
    lines = [f"Mean % of FullKV over {', '.join(tasks)} [95 % bootstrap interval], and resident KV in MiB (POD: "
             f"window = budget; FullKV keeps {_mib(evidence.kv(used_all, ('fullkv', 'full')))} MiB):{ratios}", "",
             "| method | " + " | ".join(_header(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for method in methods:
        row = []
        for b in budgets:
            found = dict(cells.get((method, b), []))
            if sorted(found) != sorted(used_all) or not used_all or len({*found.values()}) != 1:
                row.append("")
                continue
            ref = (method, next(iter(found.values())))
            _, means, draws = _measure(evidence, used_all, [ref])
            low, high = interval(draws)
            row.append(f"{_ci(float(means[0]), float(low[0]), float(high[0]))} · "
                       f"{_mib(evidence.kv(used_all, ref))}")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return lines + [""]


def claim_methods(claim: dict[str, Any]) -> list[str]:
    """Every method a claim names (``better``, ``method``, ``than``, ``methods``), as written."""
    names = [claim.get("better"), claim.get("method"), *(claim.get("than") or []), *(claim.get("methods") or [])]
    return [str(name) for name in names if name]


def configured_refs(spec: dict[str, Any]) -> list[str]:
    """The exactly named configurations (``name[...]``) a claims file compares, in order of appearance."""
    out: list[str] = []
    for claim in spec.get("claims", []):
        for name in claim_methods(claim):
            base = str(name).partition("@")[0]
            if "[" in base and base not in out:
                out.append(base)
    return out


def evaluate_all(spec: dict[str, Any], evidence: Evidence) -> list[tuple[dict[str, Any], list[Verdict]]]:
    tasks = list(spec.get("tasks") or [])
    return [(claim, evaluate(claim, evidence, tasks)) for claim in spec.get("claims", [])]


def verdicts_markdown(results: list[tuple[dict[str, Any], list[Verdict]]]) -> list[str]:
    """One row per claim and budget: the verdict, each comparison's effect and p-value, the bytes notes."""
    lines = ["| paper | claim | source | budget | effect (p) | verdict |", "|---|---|---|---|---|---|"]
    for claim, verdicts in results:
        for i, v in enumerate(verdicts):
            said = (claim["paper"], claim["claim"], claim.get("source", "")) if i == 0 else ("", "", "")
            effects = "; ".join(r.summary for r in v.rows if r.summary)
            notes = f" ({'; '.join(v.notes)})" if v.notes else ""
            lines.append(f"| {' | '.join(said)} | {v.budget} | {effects} | **{v.verdict}**{notes} |")
    return lines


def comparisons_markdown(results: list[tuple[dict[str, Any], list[Verdict]]]) -> list[str]:
    lines = ["| paper | budget | compared | % of FullKV [95 % CI] | Δ [95 % CI] | p | n | resident KV MiB | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for claim, verdicts in results:
        for v in verdicts:
            for r in v.rows:
                note = f" ({r.note})" if r.note else ""
                lines.append(f"| {claim['paper']} | {v.budget} | {r.compared} | {r.values} | {r.delta} | {r.p} | "
                             f"{r.n} | {r.kv} | {r.verdict}{note} |")
    return lines


def _configurations(spec: dict[str, Any], evidence: Evidence) -> list[str]:
    """Compared runs whose configuration is not the method's current default (``d2o[allocation=...]``)."""
    tasks = list(spec.get("tasks") or [])
    seen: dict[str, set[str]] = {}
    for claim in spec.get("claims", []):
        for name in claim_methods(claim):
            for b in claim.get("budgets") or []:
                ref = _ref(name, b)
                if "[" in ref[0]:  # a configuration named exactly
                    continue
                for label in evidence.labels(list(claim.get("tasks") or tasks), ref):
                    if label != ref[0] and "[" in label:
                        seen.setdefault(ref[0], set()).add(label)
    return [f"`{name}` = " + ", ".join(f"`{x}`" for x in sorted(labels)) for name, labels in sorted(seen.items())]


def claims_markdown(spec: dict[str, Any], evidence: Evidence) -> str:
    """The claims report (Markdown) of a results directory's ``claims.yaml``."""
    tasks = list(spec.get("tasks") or [])
    results = evaluate_all(spec, evidence)
    lines = [
        "# Qualitative claims on this result set", "",
        f"Model `{evidence.model}`; numbers are % of FullKV on the same task, per sample, averaged over the tasks "
        f"where every compared run exists ({', '.join(tasks)} unless a claim says otherwise), with 95 % intervals "
        "from a stratified paired bootstrap over samples (10,000 resamples, fixed seed). p: the exact paired "
        "sign-flip test of the difference (Holm-adjusted over a claim's comparisons at one budget); `near_full`: "
        "the bootstrap interval against the threshold. Verdicts at the 5 % level: **held**, **did not hold**, "
        "**inconclusive** (the data cannot tell); the rules per claim kind are in `kvbench/report/claims.py`. "
        "Generated by `python -m kvbench.report all` from `claims.yaml`.", "",
        *summary_markdown(evidence, tasks, configured_refs(spec)),
        "### Verdicts", "",
        *verdicts_markdown(results), "",
        "### Comparisons", "",
        *comparisons_markdown(results), "",
    ]
    configs = _configurations(spec, evidence)
    if configs:
        lines += ["Compared runs whose method configuration is not the method's current default (run before a default "
                  "changed): " + "; ".join(configs) + ".", ""]
    counts: dict[str, int] = {}
    for _, verdicts in results:
        for v in verdicts:
            counts[v.verdict] = counts.get(v.verdict, 0) + 1
    lines += ["Verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".", ""]
    return "\n".join(lines)


def write_claims(results: Path, runs: pd.DataFrame, out: Path) -> Path | None:
    """``out/claims.md`` when ``results/claims.yaml`` exists."""
    path = results / "claims.yaml"
    if not path.exists():
        return None
    spec = load_claims(path)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "claims.md"
    target.write_text(claims_markdown(spec, Evidence(runs, spec["model"], results)), encoding="utf-8")
    return target


__all__ = ["KINDS", "VERDICTS", "Comparison", "Evidence", "Verdict", "claim_methods", "claims_markdown",
           "comparisons_markdown", "configured_name", "configured_refs", "evaluate", "evaluate_all", "load_claims",
           "resident_kv_bytes", "summary_markdown", "verdicts_markdown", "write_claims"]
