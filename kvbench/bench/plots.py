"""Plots of a bench's cells (PNG + PDF next to ``cells.csv``; needs the ``[report]`` extra's matplotlib).

* ``targets``: one panel per ratio target, each method's ratio to FullKV as a bar beside the bound (dashed); a missed
  target's bar is hatched. Resident-bytes targets are equalities and stay in ``targets.md``.
* ``<metric>_vs_context``: prefill s, decode ms/token, decode tokens/s, peak and resident bytes against the context
  length, one line per method@budget (and batch size), where a metric was measured at two or more lengths
  (D2O Table 12, OmniKV Figure 4).
* ``max_batch``: the largest batch per method@budget and context length (D2O Table 5, POD Table 2).
* ``resident_over_decode``: resident KV entries per layer against the decode step, one line per method@budget (and
  batch size), a panel per context length, from each decode row's ``resident_kv_curve`` (long generations: a
  saw-tooth under decode-time compression, a rising line for FullKV).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from kvbench.report.figures import _plt, colour, marker, save

CURVES = {"prefill_seconds": "prefill (s)", "decode_ms_per_token": "decode (ms / token)",
          "decode_tokens_per_s": "decode (tokens / s)", "prefill_peak_bytes": "prefill peak (MiB)",
          "resident_kv_bytes": "resident KV (MiB)"}


def plot_bench(rows: list[dict[str, Any]], verdicts: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    """Every plot the cells support; returns the written paths (none when matplotlib is missing)."""
    try:
        _plt()
    except ImportError:
        return []
    paths = targets_plot(verdicts, out, title)
    paths += context_curves(rows, out, title)
    paths += max_batch_plot(rows, out, title)
    paths += resident_curves(rows, out, title)
    return paths


def targets_plot(verdicts: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for v in verdicts:
        if v.get("ratio") is not None:
            groups[v["target"]].append(v)
    if not groups:
        return []
    plt = _plt()
    fig, axes = plt.subplots(len(groups), 1, figsize=(6.4, 0.9 + sum(0.32 * len(g) + 0.5 for g in groups.values())),
                             gridspec_kw={"height_ratios": [len(g) for g in groups.values()]}, squeeze=False)
    for ax, (name, group) in zip(axes[:, 0], groups.items()):
        labels = [f"{v['method']}@{v['budget']}" + (f" x{v['batch_size']}" if v["batch_size"] != 1 else "")
                  for v in group]
        ratios = [v["ratio"] for v in group]
        bars = ax.barh(range(len(group)), ratios, color=[colour(v["method"]) for v in group])
        for bar, v in zip(bars, group):
            if v["ok"] is False:
                bar.set_hatch("//")
                bar.set_edgecolor("black")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v['ratio']:.2f}", va="center",
                    fontsize=7)
        bound = float(group[0]["bound"].split()[1])  # "<= 1.1", ">= 1.8", "<= 1.05 x budget"
        ax.axvline(bound, color="black", linestyle="--", linewidth=1)
        ax.axvline(1.0, color="grey", linewidth=0.6)
        ax.set_yticks(range(len(group)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, max(ratios + [bound]) * 1.18)
        ax.set_title(f"{name} (bound {group[0]['bound']}, x FullKV" + (", paired)" if group[0].get("paired") else ")"))
    fig.suptitle(title)
    fig.tight_layout()
    return save(fig, out, "targets")


def _series(rows: list[dict[str, Any]], metric: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.get(metric) is not None:
            label = f"{r['method']}@{r['budget']}" + (f" x{r['batch_size']}" if r["batch_size"] != 1 else "")
            series[label].append((r["context_length"], r[metric]))
    return {k: sorted(v) for k, v in series.items() if len({x for x, _ in v}) >= 2}


def context_curves(rows: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    plt = _plt()
    paths = []
    for metric, axis in CURVES.items():
        series = _series(rows, metric)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5.2, 3.4))
        scale = 2**20 if "bytes" in metric else 1
        for label, points in series.items():
            method = label.split("@", 1)[0]
            ax.plot([x for x, _ in points], [y / scale for _, y in points], marker=marker(method), label=label,
                    color=colour(method), linestyle="--" if method == "fullkv" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(axis)
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths += save(fig, out, f"{metric}_vs_context")
    return paths


def max_batch_plot(rows: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    cells = [r for r in rows if r.get("max_batch") is not None]
    if not cells:
        return []
    plt = _plt()
    lengths = sorted({r["context_length"] for r in cells})
    labels = list(dict.fromkeys(f"{r['method']}@{r['budget']}" for r in cells))
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        method = label.split("@", 1)[0]
        values = {r["context_length"]: r["max_batch"] for r in cells if f"{r['method']}@{r['budget']}" == label}
        ax.bar([j + i * width for j in range(len(lengths))], [values.get(n, 0) for n in lengths], width,
               label=label, color=colour(method))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"largest batch within {cells[0].get('memory_limit_gb')} GB")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, out, "max_batch")


def resident_curves(rows: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    cells = [r for r in rows if r.get("resident_kv_curve") and len(r["resident_kv_curve"]) >= 2]
    if not cells:
        return []
    plt = _plt()
    lengths = sorted({r["context_length"] for r in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 3.4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for r in (r for r in cells if r["context_length"] == length):
            label = f"{r['method']}@{r['budget']}" + (f" x{r['batch_size']}" if r["batch_size"] != 1 else "")
            steps, entries = zip(*r["resident_kv_curve"])
            ax.plot(steps, entries, label=label, color=colour(r["method"]),
                    linestyle="--" if r["method"] == "fullkv" else "-", linewidth=1)
        ax.set_xlabel("decode step")
        ax.set_ylabel("resident KV (entries per layer)")
        ax.set_title(f"{title}, {length}-token prompt", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, out, "resident_over_decode")
