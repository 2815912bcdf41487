"""Figures from a results directory, saved as PNG and PDF (byte-identical for the same inputs).

* ``needle_<model>_<task>``: needle / passkey heatmaps, context length × depth, one panel per method and budget
  (``scores.json`` ``grid``; the papers' Kamradt-style colours, red = miss, green = hit);
* ``budget_<model>_<task>_<tokens|ratio>``: score vs budget, one line per method, FullKV dashed (DynamicKV Table 2,
  D2O Figure 5); each point with its 95 % interval over samples (error bars; FullKV's as a band), from the same
  bootstrap as the claims (``kvbench.report.stats``: 10,000 resamples, fixed seed, a benchmark's datasets as strata),
  in the metric's units (the interval of the samples' mean, scaled by ``score / mean``: exact where the score is the
  mean of the samples', as for needle, passkey, RULER and LongBench);
* ``layers_<model>_<task>_<budget>``: KV entries kept per layer after prefill (mean over samples; a ratio budget plots
  the fraction of the prompt), one line per method (DynamicKV Figure 2, D2O's allocation; records' ``layer_entries``);
* ``layers_by_task_<model>_<method>_<budget>``: the same per LongBench dataset / task, when a method has several
  (DynamicKV Figure 2's task dependence);
* ``variance_<model>_<task>_<budget>``: D2O's per-layer attention variance F_l (Figure 4; ``method_stats``);
* ``ratios_<model>_<method>_<budget>``: KVMerger's per-layer kept ratio, each sample thin, mean thick (Figure 3b/9);
* ``similarity_<model>``: OmniKV's inter-layer attention similarity map and filter ability per layer (Figures 1a, 8),
  from ``<results>/analysis/*similarity*.json`` written by ``python -m kvbench.analysis.layer_similarity``;
* ``nll_<model>_<task>``: PG-19 cumulative mean NLL vs position, one line per method and budget (D2O Figure 6).

PG-19 curve contract: the report takes ``scores.json``'s ``curve`` = ``{"positions": [k...], "cum_nll": [...]}``
(the task's mean over documents) when present; otherwise each sample record's ``meta["nll_curve"]`` = a list of
``[position, cumulative mean NLL]`` pairs, or ``curve`` = ``{"positions", "cum_nll"}``, averaged over the samples
that reach each position.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from kvbench.report import store
from kvbench.report.stats import Strata, bootstrap, interval
from kvbench.report.store import budget_order

# one colour per method, stable across figures
_ORDER = ["fullkv", "streamingllm", "h2o", "snapkv", "pyramidkv", "dynamickv", "d2o", "kvmerger", "omnikv", "POD-TF",
          "local", "cam", "roco", "quest", "infllm", "lminfinite", "pyramidinfer", "sirllm", "lococo", "cla"]
_NEEDLE_COLOURS = ["#F0496E", "#EBB839", "#0CD79F"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "kvbench", "font.size": 9, "axes.titlesize": 9, "figure.dpi": 100})
    return plt


def _index(method_label: str) -> int:
    name = method_label.split("[", 1)[0]
    return _ORDER.index(name) if name in _ORDER else len(_ORDER) + sum(map(ord, method_label))


def colour(method_label: str) -> str:
    """A fixed colour per method (matplotlib's 20-colour qualitative map: every method of ``_ORDER`` its own)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex

    return to_hex(colormaps["tab20"](_index(method_label) % 20))


def marker(method_label: str) -> str:
    """A fixed marker per method, so that lines stay apart in greyscale and where colours are close."""
    return "osD^vP*Xph"[_index(method_label) % 10]


def _layer_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def slug(*parts: str) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9._=+-]+", "-", str(p)).strip("-") for p in parts if p != "")


def save(fig, out: Path, name: str) -> list[Path]:
    """``out/name.png`` and ``out/name.pdf`` without timestamps or version strings (deterministic bytes)."""
    plt = _plt()
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=120, metadata={"Software": None})
    fig.set_layout_engine("none")  # the PDF keeps the layout the PNG computed (constrained layout is costly)
    fig.savefig(paths[1], metadata={"Creator": None, "Producer": None, "CreationDate": None})
    plt.close(fig)
    return paths


def _grid(scores: dict) -> tuple[list[str], list[str], list[list[float]]]:
    grid = scores.get("grid") or {}
    lengths = sorted(grid, key=float)
    depths = sorted({d for cells in grid.values() for d in cells}, key=float)
    values = [[float(grid[length].get(d, math.nan)) for length in lengths] for d in depths]
    return lengths, depths, values


def needle_heatmaps(runs: pd.DataFrame, out: Path) -> list[Path]:
    """One figure per (model, task, protocol): a heatmap per run (method @ budget). Where every run of the figure
    has the same grid, only the outer panels carry tick labels (a figure of 50 runs drew 50 sets of tick labels, most
    of its drawing time; the axes are not shared, which costs more than it saves); a long method label wraps to its
    panel's width."""
    plt = _plt()
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("needle", _NEEDLE_COLOURS)
    paths = []
    with_grid = runs[runs["scores"].map(lambda s: bool(s.get("grid")))]
    for (model, task, protocol), group in with_grid.groupby(["model", "task", "protocol"], sort=True):
        group = _sorted(group)
        vmax = 10.0 if str(group["metric"].iloc[0]).endswith("x10") else 100.0
        cols = min(4, len(group))
        rows = math.ceil(len(group) / cols)
        grids = [_grid(run["scores"]) for run in group.to_dict("records")]
        shared = len({(tuple(lengths), tuple(depths)) for lengths, depths, _ in grids}) == 1
        fig, axes = plt.subplots(rows, cols, figsize=(3.0 * cols + 1.2, 2.5 * rows + 0.6), squeeze=False,
                                 layout="constrained")
        image = None
        for index, (ax, run, (lengths, depths, values)) in enumerate(zip(axes.flat, group.to_dict("records"),
                                                                           grids)):
            image = ax.imshow(values, cmap=cmap, vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
            ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{float(d):g}" for d in depths], fontsize=7)
            title = f"{run['method_label']} @ {run['budget']}: {run['score']:.2f}"
            ax.set_title(textwrap.fill(title, 36, break_long_words=True, break_on_hyphens=False), fontsize=8)
            if index % cols == 0:
                ax.set_ylabel("depth (%)")
            if index + cols >= len(group):
                ax.set_xlabel("context length (tokens)")
            elif shared:  # a panel with another below it
                ax.tick_params(labelbottom=False)
            if shared and index % cols:
                ax.tick_params(labelleft=False)
        for ax in list(axes.flat)[len(group):]:
            ax.axis("off")
        fig.colorbar(image, ax=axes, label=str(group["metric"].iloc[0]), shrink=0.6)
        fig.suptitle(f"{task}{f' ({protocol})' if protocol else ''}: {model}")
        paths += save(fig, out, slug("needle", model, task, protocol))
    return paths


def _sorted(group: pd.DataFrame) -> pd.DataFrame:
    return group.assign(_m=group["method"].map(lambda m: 0 if m == "fullkv" else 1),
                        _b=group["budget"].map(budget_order)).sort_values(["_m", "method_label", "_b", "hash"])


def _budget_value(budget: str) -> float | None:
    """A budget label as a number: tokens or a ratio; POD's ``window<n_s>+<n_r>`` is its n_s + n_r tokens."""
    match = re.fullmatch(r"window(\d+)\+(\d+)", str(budget))
    if match:
        return float(int(match[1]) + int(match[2]))
    try:
        return float(budget)
    except ValueError:
        return None


def _kind(budget: str) -> str | None:
    value = _budget_value(budget)
    if value is None:
        return None
    return "ratio" if value < 1 else "tokens"


def score_interval(records: list[dict], score: float) -> tuple[float, float] | None:
    """The 95 % bootstrap interval of a run's score over its samples (a benchmark's datasets as strata, as its
    score averages them), in the score's units; None without per-sample scores."""
    by: dict[str, list[float]] = {}
    for record in records:
        value = record.get("score")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            by.setdefault(str((record.get("meta") or {}).get("dataset") or ""), []).append(float(value))
    if not by or not math.isfinite(score):
        return None
    data = Strata.of([[values] for _, values in sorted(by.items())])
    mean = float(data.means()[0])
    scale = score / mean if mean else 1.0
    low, high = interval(bootstrap(data))
    return float(low[0]) * scale, float(high[0]) * scale


def budget_curves(runs: pd.DataFrame, out: Path, results_dir: Path | None = None) -> list[Path]:
    """Score vs budget per (model, task, protocol); with ``results_dir``, every point's 95 % interval over samples."""
    plt = _plt()
    paths = []

    def bars(rows: pd.DataFrame) -> list[tuple[float, float]] | None:
        if results_dir is None:
            return None
        found = [score_interval(store.records(results_dir, r["path"]), float(r["score"]))
                 for r in rows.to_dict("records")]
        return [f if f is not None else (math.nan, math.nan) for f in found]

    for (model, task, protocol), group in runs.groupby(["model", "task", "protocol"], sort=True):
        full = group[group["method"] == "fullkv"]
        for kind in ("tokens", "ratio"):
            part = group[group["budget"].map(_kind) == kind]
            if part["budget"].nunique() < 2:
                continue
            fig, ax = plt.subplots(figsize=(6.4, 3.4))
            part = part.assign(_curve=part["method_label"].map(_curve_label))
            for label, lines in part.groupby("_curve", sort=True):
                lines = lines.assign(_x=lines["budget"].map(_budget_value)).sort_values(["_x", "hash"])
                lines = lines.drop_duplicates("_x")
                found = bars(lines)
                yerr = None
                if found is not None:
                    yerr = [[max(0.0, y - lo) for y, (lo, _) in zip(lines["score"], found)],
                            [max(0.0, hi - y) for y, (_, hi) in zip(lines["score"], found)]]
                ax.errorbar(lines["_x"], lines["score"], yerr=yerr, marker=marker(label), label=_short(label),
                            color=colour(label), capsize=2.5, elinewidth=0.8)
            if not full.empty:
                ax.axhline(float(full["score"].iloc[0]), ls="--", color=colour("fullkv"), label="fullkv")
                band = bars(full.iloc[:1])
                if band is not None and all(map(math.isfinite, band[0])):
                    ax.axhspan(band[0][0], band[0][1], color=colour("fullkv"), alpha=0.12, lw=0)
            if kind == "tokens":
                ax.set_xscale("log", base=2)
                ax.set_xlabel("KV budget (tokens per layer)")
            else:
                ax.set_xlabel("KV budget (fraction of the prompt)")
            ci = "\n(bars: 95 % interval over samples)" if results_dir is not None else ""
            ax.set_ylabel(f"{group['metric'].iloc[0]}{ci}")
            ax.set_title(f"{task}{f' ({protocol})' if protocol else ''}: {model}")
            ax.legend(fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5))
            ax.grid(alpha=0.3)
            fig.tight_layout()
            paths += save(fig, out, slug("budget", model, task, protocol, kind))
    return paths


def _curve_label(label: str) -> str:
    """The line a run belongs to on a score-vs-budget plot: POD's window (n_r) is its budget, not a setting."""
    if not label.startswith("POD-TF[") or "n_r=" not in label:
        return label
    name, _, rest = label.partition("[")
    kept = [kv for kv in rest.rstrip("]").split(",") if not kv.startswith("n_r=")]
    return f"{name}[{','.join(kept)}]" if kept else name


def _short(label: str) -> str:
    """A legend label without long hyperparameter values (file paths, hashes): ``POD-TF[n_r=48]``."""
    if "[" not in label:
        return label
    name, _, rest = label.partition("[")
    kept = [kv for kv in rest.rstrip("]").split(",") if len(kv) <= 24 and "/" not in kv and "#" not in kv]
    return f"{name}[{','.join(kept)}]" if kept else name


def _mean_lists(lists: Iterable[list[float]]) -> list[float]:
    lists = [x for x in lists if x]
    if not lists:
        return []
    width = min(len(x) for x in lists)
    return [sum(x[i] for x in lists) / len(lists) for i in range(width)]


def _layer_profile(records: list[dict], ratio: bool) -> list[float]:
    rows = []
    for r in records:
        entries = [float(x) for x in r.get("layer_entries") or []]
        if ratio and r.get("prompt_tokens"):
            entries = [x / float(r["prompt_tokens"]) for x in entries]
        rows.append(entries)
    return _mean_lists(rows)


def layer_allocations(runs: pd.DataFrame, results_dir: Path, out: Path) -> list[Path]:
    plt = _plt()
    paths = []
    compressed = runs[runs["method"] != "fullkv"]
    for (model, task, protocol, budget), group in compressed.groupby(["model", "task", "protocol", "budget"],
                                                                       sort=True):
        ratio = _kind(budget) == "ratio"
        profiles = {}
        for run in _sorted(group).to_dict("records"):
            profile = _layer_profile(store.records(results_dir, run["path"]), ratio)
            if profile:
                profiles.setdefault(run["method_label"], profile)
        if not profiles:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for label, profile in profiles.items():
            ax.plot(range(len(profile)), profile, marker=".", label=label, color=colour(label))
        _layer_axis(ax)
        ax.set_ylabel("fraction of the prompt kept" if ratio else "KV entries kept (mean over heads)")
        ax.set_title(f"per-layer cache after prefill, {task}{f' ({protocol})' if protocol else ''} @ {budget}: "
                     f"{model}")
        ax.legend(fontsize=7, frameon=False)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths += save(fig, out, slug("layers", model, task, protocol, budget))
    # by task / dataset, for each layer-adaptive method configuration
    for (model, label, budget), group in compressed.groupby(["model", "method_label", "budget"], sort=True):
        ratio = _kind(budget) == "ratio"
        by_part: dict[str, list[list[float]]] = {}
        for run in group.sort_values(["task", "hash"]).to_dict("records"):
            for r in store.records(results_dir, run["path"]):
                part = (r.get("meta") or {}).get("dataset") or run["task"]
                by_part.setdefault(str(part), []).append(_layer_profile([r], ratio))
        profiles = {part: _mean_lists(rows) for part, rows in sorted(by_part.items())}
        profiles = {k: v for k, v in profiles.items() if v}
        adaptive = any(max(v) - min(v) > 1e-9 for v in profiles.values())
        if len(profiles) < 2 or not adaptive:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for part, profile in profiles.items():
            ax.plot(range(len(profile)), profile, marker=".", label=part)
        _layer_axis(ax)
        ax.set_ylabel("fraction of the prompt kept" if ratio else "KV entries kept (mean over heads)")
        ax.set_title(f"{label} @ {budget} per task: {model}")
        ax.legend(fontsize=7, frameon=False, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths += save(fig, out, slug("layers_by_task", model, label, budget))
    return paths


def method_stat_figures(runs: pd.DataFrame, results_dir: Path, out: Path) -> list[Path]:
    """D2O's layer variance (mean over samples, per method configuration) and per-sample layer ratios."""
    plt = _plt()
    paths = []
    for (model, task, budget), group in runs.groupby(["model", "task", "budget"], sort=True):
        curves = {}
        for run in _sorted(group).to_dict("records"):
            recs = store.records(results_dir, run["path"])
            rows = [(r.get("method_stats") or {}).get("layer_variance") for r in recs]
            curve = _mean_lists([x for x in rows if x])
            if curve:
                curves.setdefault(run["method_label"], curve)
        if curves:
            fig, ax = plt.subplots(figsize=(5.5, 3.4))
            for label, curve in curves.items():
                ax.plot(range(len(curve)), curve, marker=".", label=label, color=colour(label))
            _layer_axis(ax)
            ax.set_ylabel("variance of attention column sums F_l")
            ax.set_title(f"D2O layer variance, {task} @ {budget}: {model}")
            ax.legend(fontsize=7, frameon=False)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            paths += save(fig, out, slug("variance", model, task, budget))
    for (model, label, budget), group in runs.groupby(["model", "method_label", "budget"], sort=True):
        samples = []
        for run in group.sort_values(["task", "hash"]).to_dict("records"):
            for r in store.records(results_dir, run["path"]):
                ratios = (r.get("method_stats") or {}).get("layer_ratio")
                if ratios:
                    samples.append([float(x) for x in ratios])
        if not samples:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for ratios in samples:
            ax.plot(range(len(ratios)), ratios, color=colour(label), alpha=0.25, lw=0.8)
        mean = _mean_lists(samples)
        ax.plot(range(len(mean)), mean, color=colour(label), lw=2, label=f"mean of {len(samples)} samples")
        _layer_axis(ax)
        ax.set_ylabel("kept fraction of the prompt")
        ax.set_title(f"{label} @ {budget} per-layer ratio: {model}")
        ax.legend(fontsize=7, frameon=False)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths += save(fig, out, slug("ratios", model, label, budget))
    return paths


def similarity_maps(results_dir: Path, out: Path) -> list[Path]:
    from kvbench.report.similarity import filter_ability

    plt = _plt()
    paths = []
    for file in sorted((results_dir / "analysis").glob("*similarity*.json")):
        data = json.loads(file.read_text())
        sim = data["similarity"]
        num_layers = len(sim)
        masked = [[sim[i][j] if j >= i else math.nan for j in range(num_layers)] for i in range(num_layers)]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        image = left.imshow(masked, cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        left.set_xlabel("layer j (attends)")
        left.set_ylabel("layer i (selects top-k)")
        left.set_title(f"attention mass of layer j on layer i's top-{data['top_k']}")
        fig.colorbar(image, ax=left, shrink=0.85)
        for n in (2, 4, 8):
            ability = filter_ability(sim, n)
            ax_x = [i for i, v in enumerate(ability) if v is not None]
            right.plot(ax_x, [ability[i] for i in ax_x], marker=".", label=f"next {n} layers")
        _layer_axis(right)
        right.set_ylabel("mean similarity to the following layers")
        right.set_title("filter ability")
        right.legend(fontsize=7, frameon=False)
        right.grid(alpha=0.3)
        fig.suptitle(f"OmniKV inter-layer attention similarity: {data['model']} ({data['samples']} texts x "
                     f"{data['tokens']} tokens, last {data['q']} queries)")
        fig.tight_layout()
        paths += save(fig, out, slug("similarity", data["model"]))
    return paths


def _record_curve(record: dict) -> list[tuple[int, float]]:
    pairs = (record.get("meta") or {}).get("nll_curve")
    if pairs:
        return [(int(p), float(v)) for p, v in pairs]
    curve = record.get("curve") or {}
    return [(int(p), float(v)) for p, v in zip(curve.get("positions", []), curve.get("cum_nll", []))]


def nll_curve(scores: dict, records: list[dict]) -> list[tuple[int, float]]:
    """The PG-19 curve of one run (see the module docstring for the contract)."""
    curve = scores.get("curve") or {}
    if curve.get("positions"):
        return [(int(p), float(v)) for p, v in zip(curve["positions"], curve["cum_nll"])]
    by_position: dict[int, list[float]] = {}
    for record in records:
        for position, value in _record_curve(record):
            by_position.setdefault(position, []).append(value)
    return [(p, sum(v) / len(v)) for p, v in sorted(by_position.items())]


def nll_curves(runs: pd.DataFrame, results_dir: Path, out: Path) -> list[Path]:
    plt = _plt()
    paths = []
    for (model, task), group in runs.groupby(["model", "task"], sort=True):
        curves = {}
        for run in _sorted(group).to_dict("records"):
            has_curve = bool((run["scores"].get("curve") or {}).get("positions"))
            recs = [] if has_curve else store.records(results_dir, run["path"])
            curve = nll_curve(run["scores"], recs)
            if curve:
                curves[f"{run['method_label']} @ {run['budget']}"] = (run["method_label"], curve)
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for name, (label, curve) in curves.items():
            ax.plot([p for p, _ in curve], [v for _, v in curve], label=name, color=colour(label))
        ax.set_xlabel("position (tokens)")
        ax.set_ylabel("cumulative mean NLL")
        ax.set_title(f"{task}: {model}")
        ax.legend(fontsize=7, frameon=False)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths += save(fig, out, slug("nll", model, task))
    return paths


def make_figures(results_dir: str | Path, out: str | Path, runs: pd.DataFrame | None = None) -> list[Path]:
    """Every figure the results support, written to ``out``; returns the files written (sorted)."""
    results_dir, out = Path(results_dir), Path(out)
    runs = store.load_runs(results_dir) if runs is None else runs
    paths: list[Path] = []
    if not runs.empty:
        paths += needle_heatmaps(runs, out)
        paths += budget_curves(runs, out, results_dir)
        paths += layer_allocations(runs, results_dir, out)
        paths += method_stat_figures(runs, results_dir, out)
        paths += nll_curves(runs, results_dir, out)
    paths += similarity_maps(results_dir, out)
    return sorted(paths)
