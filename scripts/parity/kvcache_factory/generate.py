"""Golden fixtures from KVCache-Factory's ``pyramidkv/pyramidkv_utils.py``: the prompt tokens its SnapKV, PyramidKV,
H2O, StreamingLLM and CAM clusters keep, and PyramidKV's per-layer capacities, at three pinned commits.

Runs in a side environment (transformers 4.44.2, the reference's pin), next to checkouts of Zefan-Cai/KVCache-Factory
at the commits of ``cases.COMMITS``, never inside kvbench's environment; the reference file is imported from each
checkout, never copied here.

    python scripts/parity/kvcache_factory/generate.py \\
        --checkout 57e1c26=/work/side/kvf-57e1c26 --checkout 7ee6be0=/work/side/kvf-7ee6be0 \\
        --checkout c97f9d7=/work/side/kvf-c97f9d7

For every reading of ``cases.READINGS`` and every case (shape, n, C, seed) it builds the reference's cluster with the
LongBench script's settings and calls its ``update_kv(key, query, value, mask, groups)`` directly on the case's
post-RoPE tensors, in each GQA mode the commit has: K/V repeated to the query heads with the reference's own
``repeat_kv`` first (the model code's default, and in 2024 its only mode: one kept set per query head), and, at
c97f9d7, unrepeated K/V (``kv_head``: the group averaged inside, ``gqa_score_agg="mean"``). The kept token indices are
read back by matching the returned key rows to the input rows (the clusters copy key rows; CAM changes only values).

A case is kept only when the reference run in float64 keeps what it keeps in float32 (no near-tie between distinct
scores at the top-k boundary: an exact comparison with another float32 computation is meaningful); otherwise the next
seed is tried and the skipped seed is written down. Exact ties (max-pooling copies one value to its neighbours) are
the same in both runs and stay: those are what the parity test is about.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402  (scripts/parity/kvcache_factory/cases.py, shared with the tests)

PINNED_TRANSFORMERS = "4.44.2"


def load_reference(checkout: Path, commit: str):
    """The reference module of ``checkout`` (which must be at ``commit``), imported from its file."""
    head = subprocess.check_output(["git", "-C", str(checkout), "rev-parse", "HEAD"], text=True).strip()
    if not head.startswith(commit):
        sys.exit(f"{checkout} is at {head}, not the pinned {commit}")
    path = checkout / "pyramidkv" / "pyramidkv_utils.py"
    spec = importlib.util.spec_from_file_location(f"pyramidkv_utils_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return head, module


def build_cluster(mod, cluster: str, settings: dict, budget: int, window: int, layer_idx: int = 0,
                  num_layers: int = C.NUM_LAYERS):
    common = {"window_size": window, "max_capacity_prompt": budget, "kernel_size": settings.get("kernel", 7),
              "pooling": settings.get("pooling", "maxpool")}
    if cluster == "snapkv":
        return mod.SnapKVCluster(**common)
    if cluster == "pyramidkv":
        return mod.PyramidKVCluster(num_hidden_layers=num_layers, layer_idx=layer_idx, beta=settings["beta"], **common)
    if cluster == "h2o":
        return mod.H2OKVCluster(**common)
    if cluster == "streamingllm":
        return mod.StreamingLLMKVCluster(**common)
    if cluster == "cam":
        return mod.CAMKVCluster(start_budget_ratio=settings["start_budget_ratio"], **common)
    raise ValueError(cluster)


def kept_indices(key_in, key_out) -> list[list[int]]:
    """Per head, the input rows the cluster returned (their token indices)."""
    out = []
    for h in range(key_out.shape[1]):
        rows = {key_in[0, h, i].numpy().tobytes(): i for i in range(key_in.shape[2])}
        out.append(sorted(rows[key_out[0, h, j].numpy().tobytes()] for j in range(key_out.shape[2])))
    return out


def run_reference(mod, reading: str, case: dict, mode: str, dtype, layer_idx: int = 0) -> list[list[int]]:
    import torch

    cluster_name, settings = C.READINGS[reading]
    arrays = C.inputs(case)
    queries = torch.from_numpy(arrays["queries"]).to(dtype)[None]  # (1, Hq, n, D)
    keys = torch.from_numpy(arrays["keys"]).to(dtype)[None]  # (1, Hkv, n, D)
    groups = case["heads"] // case["kv_heads"]
    if mode == "query_head":
        keys = mod.repeat_kv(keys, groups)  # the model code's repeat_kv before update_kv
    values = torch.zeros_like(keys)
    window = C.window_of(reading, case["budget"])
    cluster = build_cluster(mod, cluster_name, settings, case["budget"], window, layer_idx)
    torch.manual_seed(0)  # CAM's Bernoulli merges (they change values only)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the clusters build their masks with torch.full(..., finfo(dtype).min)
    try:
        with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            key_out, _ = cluster.update_kv(keys.clone(), queries, values, None, groups)
    finally:
        torch.set_default_dtype(default)
    return kept_indices(keys, key_out)


def capacities(mod, n: int, budget: int, layers: int) -> list[int]:
    """PyramidKV's past-token capacity of every layer (what it keeps minus the window of 8), from its own code."""
    import torch

    settings = C.READINGS["pyramidkv_w8"][1]
    g = torch.Generator().manual_seed(n + budget)
    q, k = torch.randn(1, 1, n, 4, generator=g), torch.randn(1, 1, n, 4, generator=g)
    out = []
    for layer in range(layers):
        cluster = build_cluster(mod, "pyramidkv", settings, budget, 8, layer_idx=layer, num_layers=layers)
        with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            key_out, _ = cluster.update_kv(k.clone(), q, torch.zeros_like(k), None, 1)
        out.append(key_out.shape[2] - 8)
    return out


def generate(mod, commit: str) -> tuple[list[dict], dict]:
    import torch

    out, skipped = [], {}
    for reading, (cluster, _) in C.READINGS.items():
        if commit not in C.AVAILABLE.get(cluster, C.COMMITS):
            continue
        layers = C.PYRAMID_LAYERS if cluster == "pyramidkv" else (None,)
        for cell in C.cells():
            for mode in C.modes(commit, cell["shape"]):
                for layer in layers:
                    case = dict(cell)
                    while True:
                        args = (mod, reading, case, mode)
                        single = run_reference(*args, torch.float32, layer or 0)
                        double = run_reference(*args, torch.float64, layer or 0)
                        if single == double:
                            break
                        skipped.setdefault(f"{reading}/{mode}", []).append(case["seed"])
                        case = {**case, "seed": case["seed"] + 1}
                    record = {"reading": reading, "mode": mode, **case, "checksum": C.checksum(C.inputs(case)),
                              "kept": C.digests(single), "counts": sorted({len(h) for h in single})}
                    if layer is not None:
                        record["layer"] = layer
                    out.append(record)
        print(f"  {commit} {reading}: {sum(r['reading'] == reading for r in out)} cases", flush=True)
    return out, skipped


def write(path: Path, header: dict, cases: list[dict]) -> None:
    """Header fields indented, one case per line (small diffs when regenerated)."""
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()] + ['  "cases": [']
    lines += [f"    {json.dumps(c)}{',' if i < len(cases) - 1 else ''}" for i, c in enumerate(cases)]
    path.write_text("\n".join(lines + ["  ]", "}"]) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", required=True, metavar="COMMIT=PATH",
                        help="a checkout of Zefan-Cai/KVCache-Factory at one of the pinned commits (repeat)")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "parity")
    args = parser.parse_args(argv)
    import numpy
    import torch
    import transformers

    if transformers.__version__ != PINNED_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__}: the reference pins {PINNED_TRANSFORMERS}")
    checkouts = dict(item.split("=", 1) for item in args.checkout)
    unknown = set(checkouts) - set(C.COMMITS)
    if unknown:
        sys.exit(f"not a pinned commit: {', '.join(sorted(unknown))} (pinned: {', '.join(C.COMMITS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    for commit, path in checkouts.items():
        head, mod = load_reference(Path(path).resolve(), commit)
        cases, skipped = generate(mod, commit)
        header = {
            "about": "tokens KVCache-Factory's clusters keep (per-head sha256 digests of the sorted indices) and "
                     "PyramidKV's per-layer capacities (see scripts/parity/README.md); inputs: "
                     "scripts/parity/kvcache_factory/cases.py inputs(case)",
            "reference": {"repository": "Zefan-Cai/KVCache-Factory", "file": "pyramidkv/pyramidkv_utils.py",
                          "commit": head, "date": C.COMMITS[commit], "transformers": transformers.__version__,
                          "torch": torch.__version__, "numpy": numpy.__version__},
            "generator": "scripts/parity/kvcache_factory/generate.py",
            "skipped_seeds": skipped,
            "capacities": [{"n": n, "budget": c, "layers": layers, "window": 8, "beta": 20,
                            "past": capacities(mod, n, c, layers)} for n, c, layers in C.CAPACITY_GRID],
        }
        path = args.out / f"kvfactory_{commit}.json"
        write(path, header, cases)
        print(f"{path}: {len(cases)} cases, skipped seeds {skipped}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
