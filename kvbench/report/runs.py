"""Experiment-agnostic tables: whatever is in a results directory, one table per (model, task).

Rows are the method configurations (``h2o[variant=prefill_only]``) × budgets that were run, FullKV first, budgets
in increasing order; columns are the task's score, its "% of FullKV" (when the same model and task has a FullKV
run), the task's parts (LongBench datasets, needle/passkey lengths averaged over depths, 2StageRetr dict sizes), the
number of samples, resident KV after prefill (MiB, mean over samples; and at the end of generation where the task
records it: PG-19 streams its text through decoding), prefill seconds and decode ms/token, and the
job hash (the directory name under ``runs/``). After these (appended, so the columns above keep their places), the
output-length drift:

* ``new tok``: mean generated tokens per sample (``new_tokens`` of the records);
* ``len_vs_full``: mean generated tokens relative to FullKV's **on the same samples** — the records of this run and of
  the group's FullKV run are paired by sample id, samples only one of them has are left out, and the ratio is
  mean(this run's new_tokens) / mean(FullKV's new_tokens) over the pairs; blank without a FullKV run, without a common
  sample or when FullKV generated nothing on them (1.00 for FullKV itself);
* ``decode ms/sample``: the decode time a sample implies, ``decode ms/tok`` × ``new tok``;
* ``decode_vs_full``: the same against FullKV's on the paired samples, (ms/tok × mean new tokens) / (FullKV's
  ms/tok × FullKV's mean new tokens): a method that decodes each token faster but talks longer can lose end to end.

A compressed method that drifts to longer (or shorter) answers changes both its score and its real cost; the score
columns alone hide it. This is what a CPU miniature reports; the paper-layout tables (``tables.py``) need the papers'
models.
"""

from __future__ import annotations

import math
import re

import pandas as pd

from kvbench.report.store import budget_order, sub_scores


def _fmt(value: object, decimals: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (int, float)):
        return f"{value:.{decimals}f}"
    return str(value)


def groups(runs: pd.DataFrame) -> list[tuple[str, str, str]]:
    """The (model, task, protocol) groups present, sorted (``protocol``: see ``store.load_runs``)."""
    if runs.empty:
        return []
    return sorted({(r.model, r.task, r.protocol) for r in runs.itertuples(index=False)})


def group_name(model: str, task: str, protocol: str) -> str:
    """File-name stem of a group: ``tiny-random_needle`` or ``smollm2-135m_needle_chat_template=True``."""
    suffix = f"_{protocol}" if protocol else ""
    return re.sub(r"[^A-Za-z0-9._=+,-]+", "-", f"{model}_{task}{suffix}")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def length_drift(lengths: dict[str, float], full_lengths: dict[str, float] | None) -> float | None:
    """mean(``lengths``) / mean(``full_lengths``) over the sample ids both have (None when there is no FullKV run, no
    common sample, or FullKV generated no token on the common samples)."""
    if not full_lengths:
        return None
    common = [i for i in lengths if i in full_lengths]
    mine, full = _mean([lengths[i] for i in common]), _mean([full_lengths[i] for i in common])
    return mine / full if mine is not None and full else None


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def runs_table(runs: pd.DataFrame, model: str, task: str, protocol: str = "") -> pd.DataFrame:
    """One (model, task, protocol) group as a table of strings (see the module docstring)."""
    sel = runs[(runs["model"] == model) & (runs["task"] == task) & (runs["protocol"] == protocol)].copy()
    sel["_m"] = sel["method"].map(lambda m: 0 if m == "fullkv" else 1)
    sel["_b"] = sel["budget"].map(budget_order)
    sel = sel.sort_values(["_m", "method_label", "_b", "hash"], kind="stable")
    full = sel[sel["method"] == "fullkv"]
    full_score = float(full["score"].iloc[0]) if not full.empty else math.nan
    has_lengths = "new_tokens" in sel.columns
    full_lengths = dict(full["new_tokens"].iloc[0] or {}) if has_lengths and not full.empty else None
    full_ms = _number(full["scores"].iloc[0].get("decode_ms_per_token")) if not full.empty else None
    metric = str(sel["metric"].iloc[0]) if not sel.empty else "score"
    parts: list[str] = []
    for scores in sel["scores"]:
        for key in sub_scores(scores):
            if key not in parts:
                parts.append(key)
    at_end = any("resident_kv_bytes_final_mean" in scores for scores in sel["scores"])
    rows = []
    for run in sel.to_dict("records"):
        scores = run["scores"]
        row = {"method": run["method_label"], "budget": run["budget"], metric: _fmt(run["score"])}
        row["% FullKV"] = _fmt(100 * run["score"] / full_score, 1) if full_score and not math.isnan(full_score) else ""
        subs = sub_scores(scores)
        for key in parts:
            row[key] = _fmt(subs.get(key))
        row["n"] = str(run["n_samples"])
        kv = scores.get("resident_kv_bytes_mean")
        row["KV MiB"] = _fmt(kv / 2**20 if isinstance(kv, (int, float)) else None, 3)
        if at_end:
            end = scores.get("resident_kv_bytes_final_mean")
            row["KV MiB at end"] = _fmt(end / 2**20 if isinstance(end, (int, float)) else None, 3)
        row["prefill s"] = _fmt(scores.get("prefill_seconds_mean"), 3)
        row["decode ms/tok"] = _fmt(scores.get("decode_ms_per_token"), 1)
        row["run"] = run["hash"]
        lengths = dict(run.get("new_tokens") or {}) if has_lengths else {}
        mean_new = _mean(list(lengths.values()))
        ms = _number(scores.get("decode_ms_per_token"))
        drift = length_drift(lengths, full_lengths)
        row["new tok"] = _fmt(mean_new, 1)
        row["len_vs_full"] = _fmt(drift, 2)
        row["decode ms/sample"] = _fmt(ms * mean_new if ms is not None and mean_new is not None else None, 1)
        row["decode_vs_full"] = _fmt(drift * ms / full_ms if drift is not None and ms is not None and full_ms else None,
                                     2)
        rows.append(row)
    columns = ["method", "budget", metric, "% FullKV", *parts, "n", "KV MiB", *(["KV MiB at end"] if at_end else []),
               "prefill s", "decode ms/tok", "run", "new tok", "len_vs_full", "decode ms/sample", "decode_vs_full"]
    return pd.DataFrame(rows, columns=columns)
