"""Golden fixture from the authors' R-KV code (Zefan-Cai/R-KV d15c976), for tests/test_parity_rkv_official.py.

Runs in a side environment (Python 3.11, torch 2.13.0 CPU, numpy 2.2.2: the code's requirements.txt asks
numpy>=2.2.2), never in kvbench's: see scripts/parity/README.md. The selection is ``R1KV.update_kv``
(``rkv/compression/r1_kv.py``) with ``cal_similarity`` and ``compute_attention_scores`` (``rkv/utils.py``), both files
imported from the checkout given on the command line and run unchanged. They import torch alone; transformers is
not installed and not needed. The package ``__init__`` files are not run: at d15c976 ``rkv/compression/__init__.py``
imports ``.rkv`` and ``.simkv``, which the commit does not contain (``import rkv`` fails there), so the generator
builds the two packages as empty modules and gives ``rkv.compression`` the two names its ``__init__``'s first line
imports from ``..utils`` (what ``r1_kv.py``'s ``from . import cal_similarity, compute_attention_scores`` reads).

``update_kv(key_states, query_states, value_states)`` is called as ``rkv/modeling.py`` calls it: the layer's whole
cache ``(1, Hkv, n, D)`` and the cached queries, the last ``window_size`` ones ``(1, Hq, w, D)`` (the prompt's last
queries at prefill; the query buffer while decoding, when the cache holds budget + 128 entries: the ``n = budget +
128`` cases). Inputs are the seeded post-RoPE tensors of ``tests/parity_inputs.py`` (``stream`` with no decode
steps), float32, batch 1 (the authors' scripts run ``eval_batch_size 1``).

Recorded per case and layer: the positions each KV head keeps (read back by matching the returned key rows to the
seeded keys; the returned values are checked to be the same positions' values), and, for layer 0, the code's own
``final_score`` ``(Hkv, n - w)`` (captured from the ``topk`` call it ranks with). A case is kept only when every
head's selection has a margin: the lowest kept score exceeds the highest evicted one by more than ``MARGIN``
(relative); otherwise the next seed is used and the skipped seed listed.

    python scripts/parity/rkv/generate.py --official /path/to/R-KV --out tests/fixtures/parity/rkv_official.json
"""

from __future__ import annotations

import importlib.util
import platform
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "parity"))
from parity_inputs import digest, layer_scale, stream, to_mask  # noqa: E402
from stubs import generator_args, run_with_margin, write_fixture  # noqa: E402

COMMIT = "d15c9767e67c2bd9807128fecc35223fa2484a69"
TORCH, NUMPY = "2.13.0", "2.2.2"
LAYERS = 2
MARGIN = 1e-5
#: name, seed, query heads, kv heads, head dim, cache entries n, budget, R1KV's settings (besides budget)
CASES = [
    ("mha_n64_b24", 1, 4, 4, 16, 64, 24, {}),
    ("mha_n200_b64", 2, 4, 4, 32, 200, 64, {}),
    ("gqa_n100_b32", 3, 8, 2, 32, 100, 32, {}),
    ("gqa_n256_b128_decode", 4, 8, 2, 32, 256, 128, {}),  # the decode-time compression: budget + 128 buffered
    ("gqa4_n300_b96", 5, 8, 4, 16, 300, 96, {}),
    ("mqa_n80_b16", 6, 4, 1, 16, 80, 16, {}),
    ("gqa_n120_b40_w16_k5", 7, 8, 2, 16, 120, 40, {"window_size": 16, "kernel_size": 5}),
    ("mha_n90_b30_lambda0.1", 8, 4, 4, 16, 90, 30, {"mix_lambda": 0.1}),  # the README's lambda
    ("gqa_n110_b36_first", 9, 8, 2, 16, 110, 36, {"retain_direction": "first"}),
    ("mha_n40_b40", 10, 4, 4, 16, 40, 40, {}),  # a cache of exactly the budget: compressed, nothing leaves
    ("gqa_n30_b40", 11, 8, 2, 16, 30, 40, {}),  # a cache under the budget: left whole
    ("gqa_n256_b128_sim", 12, 8, 2, 8, 256, 128, {}),  # head dim 8: many pairs above the 0.5 threshold
]
DEFAULTS = {"window_size": 8, "kernel_size": 7, "mix_lambda": 0.07, "retain_direction": "last"}
DIVIDE = 128  # run_math.py:154, divide_length
#: the code's decode schedule: name, seed, query heads, kv heads, head dim, prompt n, decode steps, budget
DECODE_CASES = [
    ("decode_gqa_n300_b128", 21, 8, 2, 32, 300, 520, 128),  # compressions at the prompt and at 384, 512, 640, 768
    ("decode_mha_n150_b64", 22, 4, 4, 16, 150, 400, 64),
    ("decode_mqa_n100_b96", 23, 4, 1, 16, 100, 300, 96),
    ("decode_gqa_n60_b96", 24, 8, 2, 16, 60, 460, 96),  # the prompt fits: the first compression at 128
]


def load_official(path: Path):
    """``rkv.compression.r1_kv`` of the checkout, its files run unchanged (the module docstring: why not ``import
    rkv``)."""
    for name, folder in (("rkv", path / "rkv"), ("rkv.compression", path / "rkv" / "compression")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package

    def load(name, file):
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    utils = load("rkv.utils", path / "rkv" / "utils.py")
    sys.modules["rkv.compression"].cal_similarity = utils.cal_similarity
    sys.modules["rkv.compression"].compute_attention_scores = utils.compute_attention_scores
    return load("rkv.compression.r1_kv", path / "rkv" / "compression" / "r1_kv.py")


def positions_of(states: torch.Tensor, rows: list[dict]) -> list[list[int]]:
    """Original positions of the returned rows ``(1, H, m, D)``, per head, in the code's order."""
    return [[rows[h][r.numpy().tobytes()] for r in states[0, h]] for h in range(states.shape[1])]


def run_case(r1_kv, case) -> dict | None:
    name, seed, hq, hkv, d, n, budget, settings = case
    config = {**DEFAULTS, **settings}
    w = config["window_size"]
    streams = [stream(seed, li, n, 0, hq, hkv, d, layer_scale(li, LAYERS)) for li in range(LAYERS)]
    per_layer, margins = [], []
    for li, (q, k, v) in enumerate(streams):
        q, k, v = (torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in (q, k, v))
        key_rows = [{k[0, h, t].numpy().tobytes(): t for t in range(n)} for h in range(hkv)]
        value_rows = [{v[0, h, t].numpy().tobytes(): t for t in range(n)} for h in range(hkv)]
        cluster = r1_kv.R1KV(budget=budget, **config)
        ranked = []
        real_topk = torch.Tensor.topk

        def topk(self, *args, _ranked=ranked, _topk=real_topk, **kwargs):
            _ranked.append(self.detach().clone())
            return _topk(self, *args, **kwargs)

        torch.Tensor.topk = topk
        try:
            with torch.no_grad():
                keys, values = cluster.update_kv(k.clone(), q[:, :, n - w :].clone(), v.clone())
        finally:
            torch.Tensor.topk = real_topk
        kept = positions_of(keys, key_rows)
        assert kept == positions_of(values, value_rows), "keys and values gathered with one index"
        layer = {"kept": [to_mask(p, n) for p in kept], "order_sorted": all(p == sorted(p) for p in kept)}
        if ranked:
            (scores,) = ranked
            scores = scores[0]  # (Hkv, n - w)
            for h in range(hkv):
                chosen = [p for p in kept[h] if p < n - w]
                out = [p for p in range(n - w) if p not in set(chosen)]
                if out:
                    low, high = float(scores[h, chosen].min()), float(scores[h, out].max())
                    margins.append((low - high) / max(abs(low), 1e-30))
            if li == 0:
                layer["final_score"] = [[float(f"{x:.9g}") for x in row] for row in scores.tolist()]
        per_layer.append(layer)
    if margins and min(margins) <= MARGIN:
        return None
    return {"name": name, "seed": seed, "hq": hq, "hkv": hkv, "d": d, "n": n, "budget": budget, "layers": LAYERS,
            "settings": config, "input_sha": digest(*[a for s in streams for a in s]),
            "min_margin": float(f"{min(margins):.3g}") if margins else None, "per_layer": per_layer}


def decode_layer(r1_kv, q, k, v, n: int, budget: int) -> tuple[list[list[str]], list[float]]:
    """One layer through the schedule of ``run_decode_case``: the kept positions per KV head after each compression
    that ran ``topk`` (as masks), and each head's margin there."""
    w, total, hkv = DEFAULTS["window_size"], k.shape[2], k.shape[1]
    key_rows = [{k[0, h, t].numpy().tobytes(): t for t in range(total)} for h in range(hkv)]
    cluster = r1_kv.R1KV(budget=budget, **DEFAULTS)
    ranked, kept, margins = [], [], []
    real_topk = torch.Tensor.topk

    def topk(self, *args, **kwargs):
        ranked.append(self.detach().clone())
        return real_topk(self, *args, **kwargs)

    def compress(keys, values, queries):
        before = len(ranked)
        old = positions_of(keys, key_rows)
        with torch.no_grad():
            keys, values = cluster.update_kv(keys, queries, values)
        if len(ranked) > before:  # topk ran: a compression
            after = positions_of(keys, key_rows)
            kept.append([to_mask(p, total) for p in after])
            scores = ranked[-1][0]
            for h in range(hkv):
                chosen = set(after[h][: budget - w])
                past = old[h][: len(old[h]) - w]
                ins = [i for i, p in enumerate(past) if p in chosen]
                outs = [i for i, p in enumerate(past) if p not in chosen]
                if outs:
                    low, high = float(scores[h, ins].min()), float(scores[h, outs].max())
                    margins.append((low - high) / max(abs(low), 1e-30))
        return keys, values

    torch.Tensor.topk = topk
    try:
        keys, values = compress(k[:, :, :n].clone(), v[:, :, :n].clone(), q[:, :, n - w : n].clone())
        for t in range(n, total):
            keys = torch.cat([keys, k[:, :, t : t + 1]], 2)
            values = torch.cat([values, v[:, :, t : t + 1]], 2)
            if t % DIVIDE == 0:
                keys, values = compress(keys, values, q[:, :, t - w + 1 : t + 1].clone())
    finally:
        torch.Tensor.topk = real_topk
    return kept, margins


def run_decode_case(r1_kv, case) -> dict | None:
    """``rkv/modeling.py``'s schedule with the code's own cache: the prompt through ``update_kv`` with its last
    ``window_size`` queries, then one token per step appended (``past_key_value.update``) and, whenever the token's
    position is a multiple of ``DIVIDE`` (``CausalLM_forward``: the count of tokens seen when the previous forward
    ended), the whole cache, in the code's stored order, through ``update_kv`` with the query cache (the last
    ``window_size`` queries, this step's included). Recorded per layer: the positions every KV head keeps after each
    compression that ran ``topk``."""
    name, seed, hq, hkv, d, n, steps, budget = case
    streams = [stream(seed, li, n, steps, hq, hkv, d, layer_scale(li, LAYERS)) for li in range(LAYERS)]
    per_layer, margins = [], []
    for arrays in streams:
        q, k, v = (torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in arrays)
        kept, layer_margins = decode_layer(r1_kv, q, k, v, n, budget)
        per_layer.append({"kept": kept})
        margins += layer_margins
    if margins and min(margins) <= MARGIN:
        return None
    return {"name": name, "seed": seed, "hq": hq, "hkv": hkv, "d": d, "n": n, "steps": steps, "budget": budget,
            "layers": LAYERS, "settings": dict(DEFAULTS), "divide_length": DIVIDE,
            "input_sha": digest(*[a for s in streams for a in s]), "min_margin": float(f"{min(margins):.3g}"),
            "per_layer": per_layer}


def main():
    args = generator_args(__doc__, f"Zefan-Cai/R-KV at {COMMIT[:7]}", ROOT / "tests/fixtures/parity/rkv_official.json")
    assert torch.__version__.split("+")[0] == TORCH, torch.__version__
    assert np.__version__ == NUMPY, np.__version__
    torch.set_num_threads(1)
    r1_kv = load_official(Path(args.official))
    cases, skipped = run_with_margin(lambda case: run_case(r1_kv, case), CASES, lambda out: out is not None)
    decode, skipped_decode = run_with_margin(lambda case: run_decode_case(r1_kv, case), DECODE_CASES,
                                             lambda out: out is not None)
    for out in cases + decode:
        print(out["name"], "margin", out["min_margin"])
    environment = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                   "transformers": None}
    write_fixture(args.out, {
        "what": "golden fixture from the authors' R-KV code; see scripts/parity/README.md",
        "official": {"repo": "Zefan-Cai/R-KV", "commit": COMMIT, "date": "2025-06-13",
                     "files": ["rkv/compression/r1_kv.py", "rkv/utils.py"]},
        "environment": environment, "tolerance": {"scores_atol": 1e-7, "scores_rtol": 1e-5, "margin": MARGIN},
        "skipped_seeds": skipped, "cases": cases, "decode_skipped_seeds": skipped_decode, "decode_cases": decode})


if __name__ == "__main__":
    main()
