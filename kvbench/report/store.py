"""The run store as pandas: one row per job directory, and each job's sub-scores in long form.

A job directory (``kvbench.store``) is ``<results>/runs/<model>/<task>/<method>/<budget>/<hash12>/`` with
``config.yaml`` (``key``: what the hash covers), ``meta.json``, ``samples.jsonl`` and ``scores.json`` (written last:
a job without it is unfinished and skipped here). ``load_runs`` reads ``config.yaml`` and ``scores.json``, and
``meta.json`` and ``samples.jsonl`` to leave out runs that never compressed (``kvbench.store.compression``: the
transformers 5.24 rename ran every method as FullKV under its name) with one warning line each on stderr, unless
``include_uncompressed``; ``records`` and ``meta`` read a run's files on demand (figures).

Columns of ``load_runs``: ``model, task, variant`` (LongBench's ``longbench``/``longbench_e``), ``protocol`` (the task
fields that differ between this model's runs of the task, e.g. ``chat_template=True`` for ``needle_chat`` beside
``needle``; empty when all agree), ``method, method_cfg`` (the method's fields as in the key),
``method_label`` (``h2o[variant=prefill_only]``: the name plus fields that differ from the method's defaults; POD is
``POD-TF``, kvbench's training-free POD),
``budget, metric, score, n_samples, limit, hash, path`` (relative to the results directory), ``task_cfg`` (the
task protocol of the key), ``scores`` (the parsed ``scores.json``), ``new_tokens`` ({sample id: generated tokens}
from ``samples.jsonl``: what the runs tables pair with FullKV's for the output-length drift) and ``question``
(``with_context`` or ``after_compression``: where the job fed the question; a run with the latter carries
``question=after_compression`` in its ``protocol`` too). Rows are sorted by
model, task, method label, budget and hash, so every reader sees the same order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from kvbench.store import canonical_json, load_yaml
from kvbench.store.compression import uncompressed_reason

RUN_COLUMNS = ["model", "task", "variant", "protocol", "method", "method_label", "budget", "metric", "score",
               "n_samples", "limit", "hash", "path", "method_cfg", "task_cfg", "scores", "new_tokens", "question"]


def job_dirs(results_dir: str | Path) -> list[Path]:
    """Finished job directories (``scores.json`` present) under ``<results_dir>/runs``, sorted."""
    root = Path(results_dir) / "runs"
    return sorted(p.parent for p in root.glob("*/*/*/*/*/scores.json"))


@lru_cache(maxsize=64)
def method_key_omitted(name: str) -> dict[str, Any]:
    """``Method.key_omitted`` of a registered method (``adakv-snapkv``: adakv's); empty when unknown."""
    from kvbench.methods.catalog import METHODS, parse_method_name

    wrapper, inner = parse_method_name(name)
    try:
        return dict(METHODS.get_class(wrapper or inner).key_omitted)
    except Exception:  # a pending or unknown method
        return {}


def method_defaults(name: str) -> dict[str, Any] | None:
    """The default fields of a registered method (None when kvbench does not implement it), as a default instance
    holds them: a field whose default ``None`` means "by variant" (DynamicKV's ``schedule``, D2O's ``beta``) is
    compared with what it resolves to, as a run's key records the resolved value."""
    from kvbench.methods.catalog import METHODS, parse_method_name

    wrapper, inner = parse_method_name(name)  # adakv-snapkv: ("adakv", "snapkv")
    try:
        cls = METHODS.get_class(wrapper or inner)
    except Exception:  # a pending or unknown method: no defaults to compare with
        return None
    try:
        instance = cls(scorer=inner) if wrapper else cls()
    except Exception:  # a method without defaults for every field: the declared ones
        instance = None
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        if instance is not None:
            out[f.name] = getattr(instance, f.name)
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def non_default_fields(method_cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of a run's method that differ from the method's defaults (all fields when unknown)."""
    name = method_cfg.get("name", "")
    defaults = method_defaults(name)
    fields = {k: v for k, v in method_cfg.items() if k != "name"}
    if defaults is None:
        return fields
    fields = {**method_key_omitted(name), **fields}  # a key without such a field ran with its omitted value
    out: dict[str, Any] = {}
    for k, v in fields.items():
        if k == "composed":  # derived from a nested method's name (ThinK's ``think+snapkv``): said by that field
            continue
        if isinstance(v, dict) and "name" in v:  # a nested method (ThinK's ``inner``): its own non-default fields
            default = defaults.get(k)
            if not (isinstance(default, dict) and default.get("name") == v["name"]):
                out[f"{k}.name"] = v["name"]
            out.update({f"{k}.{f}": x for f, x in non_default_fields(v).items()})
        elif k not in defaults or not _same(v, defaults[k]):
            out[k] = v
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def method_label(method_cfg: dict[str, Any]) -> str:
    """``h2o`` or ``h2o[variant=prefill_only]``: the method name plus its non-default fields, sorted."""
    from kvbench.report.names import OUR_LABELS

    extra = non_default_fields(method_cfg)
    name = str(method_cfg.get("name", "?"))
    name = OUR_LABELS.get(name, name)
    return name if not extra else name + "[" + ",".join(f"{k}={_fmt(v)}" for k, v in sorted(extra.items())) + "]"


def read_run(path: Path, results_dir: Path) -> dict[str, Any] | None:
    """One finished job as a dict of ``RUN_COLUMNS``; None when its files are unreadable."""
    try:
        scores = json.loads((path / "scores.json").read_text())
        config = load_yaml((path / "config.yaml").read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    key = config.get("key") or {}
    method_cfg = dict(key.get("method") or {"name": scores.get("method", "?")})
    task_cfg = dict(key.get("task") or {})
    return {
        "model": str(scores.get("model") or (key.get("model") or {}).get("name", "?")),
        "task": str(scores.get("task") or task_cfg.get("task", "?")),
        "variant": str(task_cfg.get("variant") or ""),
        "protocol": "",
        "method": str(method_cfg.get("name", "?")),
        "method_label": method_label(method_cfg),
        "budget": str(scores.get("budget") or key.get("budget", "?")),
        "metric": str(scores.get("metric", "")),
        "score": float(scores["score"]) if isinstance(scores.get("score"), (int, float)) else math.nan,
        "n_samples": int(scores.get("n_samples", scores.get("n", 0)) or 0),
        "limit": scores.get("limit"),
        "hash": path.name,
        "path": path.relative_to(results_dir).as_posix(),
        "method_cfg": method_cfg,
        "task_cfg": task_cfg,
        "scores": scores,
        "new_tokens": {},  # filled by load_runs for the runs it keeps
        # where the question went (the key names it only when not the default, with_context); turns > 1 imply
        # after_compression
        "question": "after_compression" if int(key.get("turns", 1) or 1) > 1 else str(key.get("question")
                                                                                     or "with_context"),
    }


def budget_order(label: str) -> tuple[int, float, str]:
    """Sort key: ratios, then token budgets, by value; ``full`` last; anything else by name."""
    if label == "full":
        return (3, 0.0, label)
    try:
        value = float(label)
    except ValueError:
        return (2, 0.0, label)
    return (0 if value < 1 else 1, value, label)


def load_runs(results_dir: str | Path, include_uncompressed: bool = False) -> pd.DataFrame:
    """Every finished job under ``results_dir`` (empty frame with ``RUN_COLUMNS`` when there is none). A run whose
    records show its method never compressed is FullKV under the method's name: it is left out, with a warning line
    on stderr naming why, unless ``include_uncompressed``."""
    root = Path(results_dir)
    rows = [r for r in (read_run(p, root) for p in job_dirs(root)) if r is not None]
    if not include_uncompressed:
        rows = [r for r in rows if not skip_uncompressed(root, r["path"])]
    for row in rows:
        row["new_tokens"] = new_tokens_by_id(root, row["path"])
    frame = pd.DataFrame(rows, columns=RUN_COLUMNS)
    if frame.empty:
        return frame
    frame["protocol"] = _protocols(frame)
    frame["_b"] = frame["budget"].map(budget_order)
    frame = frame.sort_values(["model", "task", "protocol", "method_label", "_b", "hash"], kind="stable")
    return frame.drop(columns="_b").reset_index(drop=True)


def skip_uncompressed(results_dir: Path, path: str) -> bool:
    """Whether the run at ``path`` ran uncompressed (``uncompressed_reason``); if so, says why on stderr. Unreadable
    records or meta show nothing either way (``python -m kvbench.store verify`` reports them)."""
    try:
        reason = uncompressed_reason(meta(results_dir, path), records(results_dir, path))
    except (OSError, ValueError):
        return False
    if reason is not None:
        print(f"warning: skipping {path}: {reason} (--include-uncompressed keeps it)", file=sys.stderr)
    return reason is not None


def _protocols(frame: pd.DataFrame) -> pd.Series:
    """Per run, ``key=value`` of the task fields that vary among the runs of the same model and task, then
    ``question=after_compression`` for a run that fed its question after compression (such a run is compared with the
    FullKV of its own question mode, never with the default's)."""
    out = pd.Series("", index=frame.index)
    for _, group in frame.groupby(["model", "task"], sort=False):
        configs = {i: {k: canonical_json(v) for k, v in cfg.items() if k != "fields"}
                   for i, cfg in zip(group.index, group["task_cfg"])}
        keys = sorted({k for c in configs.values() for k in c})
        varying = [k for k in keys if len({c.get(k) for c in configs.values()}) > 1]
        for i in configs:
            parts = [f"{k}={_fmt(frame.at[i, 'task_cfg'].get(k))}" for k in varying]
            if frame.at[i, "question"] != "with_context":
                parts.append(f"question={frame.at[i, 'question']}")
            out[i] = ",".join(parts)
    return out


def sub_scores(scores: dict[str, Any]) -> dict[str, float]:
    """A run's per-part scores: ``datasets`` (LongBench, InfiniteBench), the needle/passkey ``grid`` averaged per
    length (``len=1000``), 2StageRetr's ``by_dict_len`` (``dict=8``)."""
    out: dict[str, float] = {}
    for name, value in (scores.get("datasets") or {}).items():
        out[str(name)] = float(value)
    for length, cells in sorted((scores.get("grid") or {}).items(), key=lambda kv: float(kv[0])):
        values = [float(v) for v in cells.values()]
        if values:
            out[f"len={length}"] = sum(values) / len(values)
    for size, value in sorted((scores.get("by_dict_len") or {}).items(), key=lambda kv: float(kv[0])):
        out[f"dict={size}"] = float(value)
    return out


def resident_kv_bytes(scores: dict[str, Any]) -> float | None:
    """A run's resident KV bytes (mean over samples): at the end of generation where the task reports it (PG-19
    streams its text through decoding, its prefill is one token), else after prefill; None when not recorded."""
    for key in ("resident_kv_bytes_final_mean", "resident_kv_bytes_mean"):
        value = scores.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def records(results_dir: str | Path, path: str) -> list[dict[str, Any]]:
    """The complete sample records of one job (``path`` as in ``load_runs``), a torn last line dropped."""
    file = Path(results_dir) / path / "samples.jsonl"
    if not file.exists():
        return []
    data = file.read_bytes()
    good = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in good.splitlines() if line.strip()]


def new_tokens_by_id(results_dir: str | Path, path: str) -> dict[str, float]:
    """{sample id: ``new_tokens``} of one job's records (records without an id or a numeric ``new_tokens`` are left
    out; an unreadable file gives {})."""
    try:
        recs = records(results_dir, path)
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for rec in recs:
        value = rec.get("new_tokens")
        if "id" in rec and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[str(rec["id"])] = float(value)
    return out


def meta(results_dir: str | Path, path: str) -> dict[str, Any]:
    file = Path(results_dir) / path / "meta.json"
    return json.loads(file.read_text()) if file.exists() else {}


def cfg_matches(cfg: dict[str, Any], required: dict[str, Any]) -> bool:
    """True when every required field has the required value (floats compared with a tolerance)."""
    return all(k in cfg and _same(cfg[k], v) for k, v in required.items())


__all__ = ["RUN_COLUMNS", "budget_order", "canonical_json", "cfg_matches", "job_dirs", "load_runs", "meta",
           "method_label", "new_tokens_by_id", "non_default_fields", "records", "resident_kv_bytes",
           "skip_uncompressed", "sub_scores"]
