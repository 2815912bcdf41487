"""Expand a bench config into cells, measure the missing ones, store them, and judge the targets.

A bench config (``conf/bench/<name>.yaml``) is data: ``grids`` (each: ``metrics`` among prefill / memory / decode /
kernels (what one decode step runs, ``measure.decode_kernels``; needs decode) / prefill_kernels (where a
prefill's time goes, ``measure.prefill_kernels``; needs prefill) /
max_batch, ``methods``, ``budgets`` (FullKV's are ignored), ``context_lengths``, ``batch_sizes``, optional
``new_tokens`` and ``repeats`` (else the bench's), ``method_overrides``, ``memory_limit_gb`` for max_batch, and
``paired: true`` to time each method's prefill alternately with FullKV's, and ``peers``: plain transformers rows
timed at the grid's context lengths and batch sizes, ``transformers_dynamic`` / ``transformers_static_compiled``,
``bench.peer.py``) and ``targets`` (each: ``metric``, ``context_length``, ``methods`` (a peer's name too), optional
``batch_sizes``, and ``max_ratio`` / ``min_ratio`` against ``baseline`` (default FullKV; any method or peer row) at the
same context length and batch size, or ``equals_budget``, or ``max_budget_ratio``: the value at most that many times
the budget's bytes (``resident_kv_bytes_decode_max``, a decode's peak: against the budget at the prompt + the
generated tokens), or ``max_budget_plus_tokens``: the value at most the budget's bytes plus that many tokens' (a
decode compression's interval, whatever the budget), or ``max_floor_ratio``: decode ms per step at most that many
times the cell's floor, or ``max_value`` / ``min_value``: the value itself at most / at least that (the captured
decode's ``decode_eager_equal_tokens``: leading tokens equal to the host-driven path's; ``decode_eager_forced_gap``:
how far below the host-driven path's choice its tokens are, fed to it)). A prefill target on a
paired cell uses the median of the per-pair ratios.

``floor: {copy_mib, warmup, repeats}`` (bench level) measures the device's copy bandwidth once per run
(``floor.json``) and gives every decode row its floor: ``(weight bytes + resident KV bytes) / bandwidth``.
``peer_compile`` (bench level) passes options to the static peer's ``transformers.CompileConfig``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import platform
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.bench.peer import check_peer
from kvbench.budget import Budget, check_budget, parse_budget
from kvbench.config import CONF_DIR
from kvbench.errors import ConfigError, KVBenchError, NotAvailableError

log = logging.getLogger("kvbench.bench")
METRICS = ("prefill", "memory", "decode", "max_batch", "throughput", "kernels", "prefill_kernels")
FIELDS = ("model", "device", "dtype", "threads", "method", "budget", "context_length", "batch_size")


def method_config(name: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``conf/method/<name>.yaml`` with ``overrides`` merged in (nested mappings key by key, as Hydra's overrides:
    ``{decode_compression: {interval: 128}}`` keeps the yaml's other ``decode_compression`` keys)."""
    path = CONF_DIR / "method" / f"{name}.yaml"
    if not path.exists():
        options = sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml"))
        raise ConfigError(f"bench: unknown method {name!r}; valid methods: {', '.join(options)}")
    cfg = OmegaConf.load(path)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides))
    return OmegaConf.to_container(cfg)


def method_entry(bench: DictConfig, index: int, entry: Any) -> tuple[str, str, dict[str, Any] | None]:
    """A grid's ``methods`` item: a method's name (its config as it is), or a named variant
    ``{name: snapkv_dc128, method: snapkv, overrides: {decode_compression: {interval: 128}}}`` (rows and targets
    call it by ``name``): ``(row name, method config name, its overrides)``."""
    if isinstance(entry, str):
        return entry, entry, None
    if isinstance(entry, dict) and set(entry) <= {"name", "method", "overrides"} and \
            isinstance(entry.get("name"), str) and isinstance(entry.get("method"), str):
        return entry["name"], entry["method"], entry.get("overrides")
    raise ConfigError(f"bench {bench.name!r} grid {index}: methods item {entry!r} must be a method's name or a "
                      f"mapping {{name, method, overrides}}")


def expand(bench: DictConfig, only: Any = None) -> list[dict[str, Any]]:
    """Cells of every grid (or of the grids whose indices are in ``only``), validated without loading anything
    (unknown metric/method, bad budget, bad grid index: ConfigError)."""
    cells, seen = [], {}  # (method, budget, length, batch) -> its cell
    count = len(bench.grids)
    if only is not None:
        only = list(only) if isinstance(only, (list, tuple)) or OmegaConf.is_list(only) else [only]
        bad = [i for i in only if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
        if bad or not only:
            raise ConfigError(f"only_grids={only!r}: bench {bench.name!r} has grids 0..{count - 1}; "
                              f"give indices in that range, e.g. only_grids=[0] (default: all)")
    for index, grid in enumerate(bench.grids):
        if only is not None and index not in only:
            continue
        grid = OmegaConf.to_container(grid)
        bad = [m for m in grid.get("metrics", []) if m not in METRICS]
        if bad or not grid.get("metrics"):
            raise ConfigError(f"bench {bench.name!r} grid {index}: metrics {grid.get('metrics')!r} must be a "
                              f"non-empty list of {', '.join(METRICS)}")
        if "max_batch" in grid["metrics"] and not grid.get("memory_limit_gb"):
            raise ConfigError(f"bench {bench.name!r} grid {index}: max_batch needs memory_limit_gb")
        if "prefill_kernels" in grid["metrics"] and "prefill" not in grid["metrics"]:
            raise ConfigError(f"bench {bench.name!r} grid {index}: prefill_kernels profiles a prefill after the timed "
                              f"ones (warm); add prefill to the grid's metrics")
        if "kernels" in grid["metrics"] and "decode" not in grid["metrics"]:
            raise ConfigError(f"bench {bench.name!r} grid {index}: kernels profiles the decode step after the timed "
                              f"decode (its graphs warm); add decode to the grid's metrics")
        peers = [check_peer(p) for p in grid.get("peers") or []]
        if peers and "decode" not in grid["metrics"]:
            raise ConfigError(f"bench {bench.name!r} grid {index}: peers {peers} time decode only; add decode to the "
                              f"grid's metrics")
        for entry in grid.get("methods") or []:
            method, base, variant = method_entry(bench, index, entry)
            overrides = (grid.get("method_overrides") or {}).get(method)
            if variant:
                overrides = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(overrides or {}),
                                                                   OmegaConf.create(variant)))
            for raw_budget in grid["budgets"]:
                budget = parse_budget(raw_budget, base)  # the job plan's parse: FullKV's is full
                for length in grid["context_lengths"]:
                    for batch in grid.get("batch_sizes", [1]):
                        _check_shape(bench, index, length, batch)
                        key = (method, budget.label(), length, batch)
                        if key in seen:  # one cell, measured once: an earlier grid's cell takes this grid's metrics too
                            cell = seen[key]
                            cell["metrics"] = [*cell["metrics"], *(m for m in grid["metrics"]
                                                                   if m not in cell["metrics"])]
                            continue
                        seen[key] = {"method": method, "config": base, "budget": budget,
                                      "context_length": length, "batch_size": batch, "metrics": grid["metrics"],
                                      "overrides": overrides,
                                      "memory_limit_gb": grid.get("memory_limit_gb"),
                                      "paired": bool(grid.get("paired", False)) and base != "fullkv",
                                      "new_tokens": grid.get("new_tokens", bench.new_tokens),
                                      "repeats": grid.get("repeats", bench.repeats)}
                        cells.append(seen[key])
        for peer in peers:  # plain transformers generate on the same prompts: decode only, no budget
            for length in grid["context_lengths"]:
                for batch in grid.get("batch_sizes", [1]):
                    _check_shape(bench, index, length, batch)
                    key = (peer, "full", length, batch)
                    if key not in seen:
                        seen[key] = {"method": peer, "peer": True, "budget": Budget.full(),
                                      "context_length": length, "batch_size": batch, "metrics": ["decode"],
                                      "overrides": None, "memory_limit_gb": None, "paired": False,
                                      "new_tokens": grid.get("new_tokens", bench.new_tokens),
                                      "repeats": grid.get("repeats", bench.repeats)}
                        cells.append(seen[key])
    return cells


def _check_shape(bench: DictConfig, index: int, length: Any, batch: Any) -> None:
    if not isinstance(length, int) or length < 1 or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"bench {bench.name!r} grid {index}: context length {length!r} and batch size {batch!r} "
                          f"must be positive integers")


def _base_row(cell: dict[str, Any], context: dict[str, Any], peer_context: dict[str, Any]) -> dict[str, Any]:
    """A cell's row before it is measured: what identifies it in the store (``_cell_key``)."""
    peer = bool(cell.get("peer"))
    return {**(peer_context if peer else context), "method": cell["method"],
            "budget": "full" if peer else cell["budget"].label(), "context_length": cell["context_length"],
            "batch_size": cell["batch_size"]}


def _cell_key(row: dict[str, Any]) -> tuple:
    return (*(row[f] for f in FIELDS), bool(row.get("compile", False)))


class BenchStopped(Exception):
    """A bench ended by SIGTERM (a session step's ``timeout``): what it had measured is stored and judged."""


def run_bench(cfg: DictConfig) -> None:
    try:
        _run(cfg)
    except KVBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except BenchStopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)


class _Signalled(Exception):
    pass


@contextlib.contextmanager
def _stop_on_sigterm():
    """While the cells are measured, SIGTERM (``timeout``, a scheduler's time limit) interrupts the cell under way
    instead of killing the process, so that the cells already stored are judged and written (targets.md / .json,
    cells.csv) before it exits: a bench cut by a GPU session's step budget still reports what it measured."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Signalled(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _read_store(store: Path, repair: bool = False) -> list[dict[str, Any]]:
    """The stored cells. A line cut short by a killed run is left out with one warning (its cell is measured again)
    and, with ``repair``, dropped from the file (rewritten whole, then renamed), so that new cells start a line."""
    rows, bad = [], False
    if store.exists():
        for number, line in enumerate(store.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                bad = True
                log.warning("%s line %d is not a whole cell (a run killed while writing it); measured again", store,
                            number)
    if bad and repair:
        tmp = store.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(store)
    return rows


def _run(cfg: DictConfig) -> list[dict[str, Any]]:
    import torch

    from kvbench.bench.measure import max_batch, measure_cell, samples_per_minute
    from kvbench.bench.peer import measure_peer
    from kvbench.bench.probe import probe_in_subprocess, request
    from kvbench.methods import build_method
    from kvbench.models import load_model, spec_from_config

    bench = cfg.bench
    cells = expand(bench, cfg.get("only_grids"))
    spec = spec_from_config(cfg.model)
    methods = {}
    for cell in cells:  # every method builds and validates before the model loads
        if cell.get("peer"):
            continue
        key = (cell["method"], cell["budget"].label())
        try:
            methods[key] = build_method(method_config(cell["config"], cell["overrides"]), cell["budget"])
            methods[key].fetch_assets()  # a named file (TriAttention's statistics) before the model loads
        except NotAvailableError as exc:
            log.warning("skipping %s: %s", cell["method"], exc)
            continue
        # the job plan's check on the cell's own prompt (a ratio resolves on its length), as the session would refuse
        check_budget(cell["budget"], methods[key], cell["context_length"],
                     f"for a prompt of {cell['context_length']} tokens")
    floor = _Floor(bench.get("floor"))
    fullkv = (build_method(method_config("fullkv", None), Budget.full()), Budget.full())
    torch.manual_seed(cfg.seed)
    loaded = load_model(spec)
    device = str(loaded.device)
    out_dir = Path(cfg.paths.results_dir) / "bench" / spec.name / bench.name / device.split(":")[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "cells.jsonl"
    rows = _read_store(store, repair=True)
    context = {"model": spec.name, "device": device, "dtype": spec.dtype, "threads": torch.get_num_threads()}
    compile_decode = bool(bench.get("compile", False))
    if compile_decode:  # the captured decode (engine.decode=graph); left out of rows measured without it
        context["compile"] = True
    # a peer row is plain transformers: kvbench's decode path (compile) does not apply to it
    peer_context = {k: v for k, v in context.items() if k != "compile"}
    if cfg.rerun:  # measure this run's cells again; the store keeps every other cell (e.g. grids not in only_grids)
        again = {_cell_key(_base_row(c, context, peer_context)) for c in cells}
        rows = [r for r in rows if _cell_key(r) not in again]
        tmp = store.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(store)
    done = {_cell_key(r) for r in rows}
    # CPU peaks are RSS high-water marks: a fresh process per measurement (kvbench.bench.probe), never this one's
    isolate = device.startswith("cpu")
    floor.bind(loaded, out_dir)
    # the peers run after every kvbench cell: the static peer's compile (CUDA graph pools, dynamo caches) stays out of
    # kvbench's numbers
    ordered = [c for c in cells if not c.get("peer")] + [c for c in cells if c.get("peer")]
    stopped, started = None, time.perf_counter()
    with _stop_on_sigterm(), store.open("a") as f:
        try:
            for cell in ordered:
                row, measuring = _base_row(cell, context, peer_context), time.perf_counter()
                if cell.get("peer"):
                    if _cell_key(row) in done:
                        continue
                    log.info("measuring peer %s, %d tokens, batch %d", row["method"], row["context_length"],
                             row["batch_size"])
                    row.update(measure_peer(loaded, cell["method"], cell["context_length"], cell["batch_size"],
                                            cell["new_tokens"], bench.warmup, cell["repeats"],
                                            OmegaConf.to_container(bench.peer_compile) if bench.get("peer_compile")
                                            else None).as_dict())
                    # the peer's cache is dense: the prompt's K and V, as FullKV's after prefill
                    row["kv_bytes_per_token"] = loaded.num_layers * loaded.num_kv_heads * loaded.kv_bytes_per_token()
                    row.update(floor.fields(budget_bytes(loaded, Budget.full(), cell["context_length"],
                                                         cell["batch_size"]), row.get("decode_ms_per_token")))
                    row["cell_seconds"] = round(time.perf_counter() - measuring, 2)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    rows.append(row)
                    continue
                method = methods.get((cell["method"], cell["budget"].label()))
                if method is None:
                    continue
                if _cell_key(row) in done:
                    continue
                log.info("measuring %s@%s, %d tokens, batch %d", row["method"], row["budget"], row["context_length"],
                         row["batch_size"])
                metrics = [m for m in cell["metrics"] if not (isolate and m == "memory")]
                result = measure_cell(loaded, method, cell["budget"], cell["context_length"], cell["batch_size"],
                                      metrics, cell["new_tokens"], bench.warmup, cell["repeats"],
                                      baseline=fullkv if cell["paired"] else None,
                                      warmup_new_tokens=bench.get("decode_warmup_tokens"), compile=compile_decode)
                row.update(result.as_dict())
                method_cfg = method_config(cell["config"], cell["overrides"])
                if cell["config"] != cell["method"]:  # a named variant: what it is, in its row
                    row.update(method_config_name=cell["config"], method_overrides=cell["overrides"])
                if isolate and "memory" in cell["metrics"]:
                    got = probe_in_subprocess(request(spec, method_cfg, row["budget"], cell["context_length"],
                                                      cell["batch_size"], "prefill", seed=cfg.seed))
                    row["prefill_peak_bytes"] = got["peak_bytes"]
                    row["resident_kv_bytes"] = row.get("resident_kv_bytes") or got["resident_kv_bytes"]
                    row["memory_probe"] = "fresh process"
                if "max_batch" in cell["metrics"]:
                    limit = int(cell["memory_limit_gb"] * 2**30)
                    probe = None
                    if isolate:
                        def probe(batch, cell=cell, method_cfg=method_cfg, label=row["budget"]):
                            return probe_in_subprocess(request(spec, method_cfg, label, cell["context_length"], batch,
                                                               "generate", cell["new_tokens"], cfg.seed))["peak_bytes"]
                    row["max_batch"] = max_batch(loaded, method, cell["budget"], cell["context_length"], limit,
                                                 cell["new_tokens"], probe=probe)
                    row["memory_limit_gb"] = cell["memory_limit_gb"]
                if "throughput" in cell["metrics"]:  # a whole job's samples per minute, at this batch and the largest
                    row["samples_per_minute"] = samples_per_minute(
                        loaded, method, cell["budget"], cell["context_length"], cell["batch_size"], cell["new_tokens"],
                        bench.warmup, cell["repeats"], compile=compile_decode)
                    largest = row.get("max_batch")
                    if largest and largest != cell["batch_size"]:
                        row["samples_per_minute_at_max_batch"] = samples_per_minute(
                            loaded, method, cell["budget"], cell["context_length"], largest, cell["new_tokens"],
                            bench.warmup, cell["repeats"], compile=compile_decode)
                    elif largest:
                        row["samples_per_minute_at_max_batch"] = row["samples_per_minute"]
                row["kv_bytes_per_token"] = loaded.num_layers * loaded.num_kv_heads * loaded.kv_bytes_per_token()
                row["budget_kv_bytes"] = budget_bytes(loaded, cell["budget"], cell["context_length"],
                                                      cell["batch_size"])
                if row.get("resident_kv_bytes_decode_max") is not None:  # the budget once the generation is cached
                    row["budget_kv_bytes_decode"] = budget_bytes(loaded, cell["budget"],
                                                                 cell["context_length"] + cell["new_tokens"],
                                                                 cell["batch_size"])
                if "decode" in cell["metrics"]:
                    row.update(floor.fields(row.get("resident_kv_bytes"), row.get("decode_ms_per_token")))
                row["cell_seconds"] = round(time.perf_counter() - measuring, 2)  # warm-ups and compiles included
                f.write(json.dumps(row) + "\n")
                f.flush()
                rows.append(row)
        except _Signalled as exc:  # the cell under way is lost; every stored one is judged below
            stopped = exc.args[0]
    rows = _read_store(store)  # everything stored (a row written as the signal came is in the file, maybe not in rows)
    if stopped:
        stored = {_cell_key(r) for r in rows}
        left = [c for c in ordered if _cell_key(_base_row(c, context, peer_context)) not in stored]
        log.warning("%s after %.0f s: %d of %d cells not measured (%s); judging the stored ones", stopped,
                    time.perf_counter() - started, len(left), len(ordered),
                    ", ".join(f"{c['method']}@{c['context_length']}x{c['batch_size']}" for c in left))
    rows = [r for r in rows if r["device"] == device and r["threads"] == context["threads"]]
    _write_csv(rows, out_dir / "cells.csv")
    verdicts = judge(rows, OmegaConf.to_container(bench.targets) if "targets" in bench else [], loaded)
    import transformers

    from kvbench.config import git_sha

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "git_sha": git_sha()}
    if device.startswith("cuda"):  # which card (an H100 and an H200 differ by their bandwidth: the floor)
        versions["device_name"] = torch.cuda.get_device_name(0)
    (out_dir / "targets.json").write_text(json.dumps({"context": {**context, **versions},
                                                      "floor": floor.measured(),
                                                      "targets": verdicts}, indent=1) + "\n")
    table = targets_markdown(verdicts)
    (out_dir / "targets.md").write_text(table + "\n")
    from kvbench.bench.plots import plot_bench

    plot_bench(rows, verdicts, out_dir, f"{spec.name} on {device.split(':')[0]} ({context['threads']} threads), "
               f"bench {bench.name}")
    print(f"\n{spec.name} on {device} ({context['threads']} threads), bench {bench.name}\n{table}\nresults: {out_dir}")
    if stopped:
        raise BenchStopped(f"{stopped}: the cells stored before it are judged in {out_dir}; the same command resumes")
    return rows


class _Floor:
    """The bench's floor (``floor: {copy_mib, warmup, repeats}``): the copy bandwidth measured once, when the run's
    first decode row needs it, written to ``floor.json``; each decode row then gets its floor fields (``peer.py``)."""

    def __init__(self, options: Any):
        """Validates ``options`` (before the model loads); ``bind`` names the model and the folder."""
        if options is not None and not OmegaConf.is_dict(options) and not isinstance(options, dict):
            raise ConfigError(f"bench: floor={options!r} must be a mapping (copy_mib, warmup, repeats) or null")
        self.options = None if options is None else dict(OmegaConf.to_container(options) if OmegaConf.is_config(
            options) else options)
        self.loaded, self.path, self.result = None, None, None
        if self.options is not None:
            bad = sorted(set(self.options) - {"copy_mib", "warmup", "repeats"})
            if bad:
                raise ConfigError(f"bench: floor has unknown keys {bad}; valid: copy_mib, warmup, repeats")

    def bind(self, loaded, out_dir: Path) -> _Floor:
        self.loaded, self.path = loaded, out_dir / "floor.json"
        return self

    def fields(self, kv_bytes: int | None, decode_ms: float | None) -> dict[str, Any]:
        from kvbench.bench.peer import copy_bandwidth, floor_fields, weight_bytes

        if self.options is None or kv_bytes is None:
            return {}
        if self.result is None:
            log.info("measuring the copy bandwidth of %s (the floor)", self.loaded.device)
            self.result = {**copy_bandwidth(self.loaded.device, **self.options),
                           "weight_bytes": weight_bytes(self.loaded.model)}
            self.path.write_text(json.dumps(self.result, indent=1) + "\n")
        out = floor_fields(self.result["weight_bytes"], kv_bytes, self.result["copy_bandwidth_bytes_per_s"])
        if decode_ms is not None:
            out["floor_ratio"] = round(decode_ms / out["floor_ms_per_token"], 3)
        return out

    def measured(self) -> dict[str, Any] | None:
        """This run's measurement, else the last one stored (a resumed run that measured nothing)."""
        if self.result is None and self.options is not None and self.path.exists():
            return json.loads(self.path.read_text())
        return self.result


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()})


def budget_bytes(loaded, budget: Budget, length: int, batch: int) -> int:
    """K+V bytes a ``length``-token prompt leaves in the cache at ``budget`` after prefill, layer by layer as the model
    attends (``engine.architecture``, the default ``sliding_layers=auto``): a compressed layer keeps the budget's
    tokens, a sliding layer the method leaves to its window keeps at most ``window - 1`` (Gemma-3: 15 sliding layers
    at 511 beside 3 global ones at the budget); every layer full reads as ``layers x budget tokens``."""
    from kvbench.engine.architecture import layer_specs, resolve_policy

    specs = layer_specs(loaded.model)
    windowed = resolve_policy("auto", specs) == "window"
    tokens = budget.tokens_for(length)
    if not specs:  # attention outside the interface (an adapter's modules): every layer full
        return batch * loaded.num_layers * tokens * loaded.num_kv_heads * loaded.kv_bytes_per_token()
    entries = sum(min(length, spec.window - 1) if spec.sliding and windowed
                  else (min(tokens, spec.window - 1) if spec.sliding else tokens) for spec in specs.values())
    return batch * entries * loaded.num_kv_heads * loaded.kv_bytes_per_token()


def judge(rows: list[dict[str, Any]], targets: list[dict[str, Any]], loaded) -> list[dict[str, Any]]:
    """Each target per method and batch size: the measured ratio to FullKV (or the bytes vs the budget's bytes)."""
    verdicts = []
    for target in targets:
        metric, length = target["metric"], target["context_length"]
        if "max_floor_ratio" in target and metric not in ("decode_ms_per_token", "decode_tokens_per_s"):
            raise ConfigError(f"bench target {target['name']!r}: max_floor_ratio bounds decode time against the "
                              f"floor; metric must be decode_ms_per_token or decode_tokens_per_s, not {metric!r}")
        batches = target.get("batch_sizes")
        for method in target["methods"]:
            matching = [r for r in rows if r["method"] == method and r["context_length"] == length
                        and (batches is None or r["batch_size"] in batches)]
            for batch in [b for b in batches or [None] if not any(b in (None, r["batch_size"]) for r in matching)]:
                # a target's cell that no row holds (a bench stopped early, a method skipped): said, not left out
                verdicts.append({"target": target["name"], "metric": metric, "method": method, "budget": "-",
                                 "context_length": length, "batch_size": batch, "value": None, "ratio": None,
                                 "bound": "-", "ok": None, "note": "not measured"})
            for row in matching:
                verdict = {"target": target["name"], "metric": metric, "method": method, "budget": row["budget"],
                           "context_length": length, "batch_size": row["batch_size"], "value": row.get(metric)}
                if "max_floor_ratio" in target:  # decode time per step / the cell's floor (the same whichever metric)
                    bound, floor_ms = target["max_floor_ratio"], row.get("floor_ms_per_token")
                    verdict.update(baseline="floor", baseline_value=floor_ms, bound=f"<= {bound} x floor")
                    if floor_ms is None or row.get("decode_ms_per_token") is None:
                        verdict.update(ratio=None, ok=None, note="no floor measured for this cell (bench.floor)"
                                       if floor_ms is None else "no measurement of this metric")
                    else:
                        ratio = row["decode_ms_per_token"] / floor_ms
                        verdict.update(ratio=round(ratio, 3), ok=ratio <= bound)
                elif "max_value" in target:  # an absolute bound (FullKV's ms/token against the weight-streaming floor)
                    value = row.get(metric)
                    verdict.update(bound=f"<= {target['max_value']}",
                                   ok=None if value is None else value <= target["max_value"])
                elif "min_value" in target:  # an absolute floor (the captured decode's tokens equal to the eager's)
                    value = row.get(metric)
                    verdict.update(bound=f">= {target['min_value']}",
                                   ok=None if value is None else value >= target["min_value"])
                elif target.get("equals_budget") or "max_budget_ratio" in target or \
                        "max_budget_plus_tokens" in target:
                    # the decode peak against the budget at the tokens seen by the generation's end (a budget above
                    # the prompt binds only once the generation has filled it); everything else after prefill
                    expected = row.get("budget_kv_bytes_decode" if metric == "resident_kv_bytes_decode_max"
                                       else "budget_kv_bytes")
                    if expected is None:  # a row measured before layer types were read: every layer is full
                        budget = parse_budget(row["budget"])
                        expected = row["batch_size"] * budget.tokens_for(length) * row["kv_bytes_per_token"]
                    verdict.update(expected=expected, ok=row.get(metric) == expected)
                    if "max_budget_ratio" in target and row.get(metric) is not None:  # at most the bound x budget's
                        ratio = row[metric] / expected
                        verdict.update(ratio=round(ratio, 3), bound=f"<= {target['max_budget_ratio']} x budget",
                                       ok=ratio <= target["max_budget_ratio"])
                    if "max_budget_plus_tokens" in target and row.get(metric) is not None:  # + an interval's
                        extra = target["max_budget_plus_tokens"]
                        bound = expected + row["batch_size"] * extra * row["kv_bytes_per_token"]
                        verdict.update(ratio=round(row[metric] / expected, 3), ok=row[metric] <= bound,
                                       bound=f"<= {bound / expected:.3f} x budget (+{extra} tokens)")
                else:
                    # a ratio to FullKV, to another method (SnapKV) or to a peer (transformers_static_compiled)
                    reference = target.get("baseline", "fullkv")
                    base = next((r for r in rows if r["method"] == reference and r["context_length"] == length
                                 and r["batch_size"] == row["batch_size"] and r.get(metric) is not None), None)
                    bound = target.get("max_ratio", target.get("min_ratio"))
                    bound_text = ("<= " if "max_ratio" in target else ">= ") + str(bound)
                    verdict.update(baseline=reference)
                    if (metric == "prefill_seconds" and row.get("prefill_ratio_paired") is not None
                            and reference == "fullkv"):
                        ratio, value = row["prefill_ratio_paired"], row["prefill_baseline_seconds"]
                        verdict.update(paired=True)
                    elif base is None or row.get(metric) is None or not base[metric]:
                        verdict.update(ratio=None, ok=None, bound=bound_text, note="no measurement of this metric")
                        verdicts.append(verdict)
                        continue
                    else:
                        ratio, value = row[metric] / base[metric], base[metric]
                    ok = ratio <= bound if "max_ratio" in target else ratio >= bound
                    verdict.update(baseline_value=value, ratio=round(ratio, 3), bound=bound_text, ok=ok)
                    if reference == "fullkv":
                        verdict.update(fullkv=value)
                verdicts.append(verdict)
    return verdicts


def targets_markdown(verdicts: list[dict[str, Any]]) -> str:
    lines = ["| target | method | batch | value | against (FullKV, a peer, the floor or the budget's bytes) | "
             "ratio | bound | ok |", "|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        value = v["value"]
        value = f"{value:,.4g}" if isinstance(value, float) else (f"{value:,}" if isinstance(value, int) else "-")
        base = v.get("baseline_value", v.get("fullkv", v.get("expected")))
        base = "-" if base is None else (f"{base:,.4g}" if isinstance(base, float) else f"{base:,}")
        if v.get("baseline") not in (None, "fullkv"):
            base = f"{v['baseline']} {base}"
        ok = "not measured" if v.get("note") == "not measured" else {True: "yes", False: "**NO**", None: "n/a"}[v["ok"]]
        ratio = "-" if v.get("ratio") is None else str(v["ratio"]) + (" (paired)" if v.get("paired") else "")
        method = v["method"] if v["budget"] == "-" else f"{v['method']}@{v['budget']}"
        batch = "-" if v["batch_size"] is None else v["batch_size"]
        lines.append(f"| {v['target']} | {method} | {batch} | {value} | {base} | "
                     f"{ratio} | {v.get('bound', '= budget')} | {ok} |")
    if any(v.get("paired") for v in verdicts):
        lines.append("\n(paired): the method's prefill and FullKV's were timed alternately in the same cell; the "
                     "ratio is the median of the per-pair ratios and the \"against\" column that cell's FullKV median.")
    return "\n".join(lines)
