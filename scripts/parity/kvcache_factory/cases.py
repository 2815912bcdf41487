"""The KVCache-Factory parity cases: commits, readings, shapes, seeds and the seeded inputs, shared by ``generate.py``
(run in a side environment next to checkouts of Zefan-Cai/KVCache-Factory) and ``tests/test_parity_kvfactory.py``
(run by CI without them).

Inputs come from numpy's legacy ``RandomState``, whose stream is frozen (NEP 19): a seed gives the same float32
tensors under any numpy and torch, so the fixtures store seeds and shapes, not tensors. A case is one prompt of ``n``
tokens at one layer: ``queries`` ``(Hq, n, D)`` and ``keys`` ``(Hkv, n, D)``, both post-RoPE (what the reference's
``update_kv`` and kvbench's ``prefill`` receive). Values play no part in which tokens are kept.
"""

from __future__ import annotations

import hashlib

import numpy as np

#: the pinned commits (short ids, dates of the commits) and what changed at each for these baselines
COMMITS = {
    "57e1c26": "2024-06-25",  # PyramidKV steps // L; H2O scores the last window's queries; no CAM
    "7ee6be0": "2024-12-03",  # steps // (L - 1) (5a1f543); H2O all queries, only the w x w block masked (98e8228)
    "c97f9d7": "2026-07-02",  # H2O causal (9f9aa2e); optional kv_head granularity (ad51c4e, c97f9d7)
}
HEAD_DIM = 64  # a power of 4: x * D**-0.5 (kvbench, the model's scale) equals x / sqrt(D) (the reference) exactly
SHAPES = {"mha": (4, 4), "gqa": (8, 2)}  # (query heads, KV heads)
LENGTHS = (300, 1000, 2047)
BUDGETS = (64, 128, 512)  # KV size C (tokens per layer, window included), KVCache-Factory's max_capacity_prompt
SEEDS_PER_CELL = 2
NUM_LAYERS = 32  # PyramidKV: its schedule's L (Llama-3-8B, Mistral-7B)
PYRAMID_LAYERS = (0, 16, 31)  # the layers whose kept sets are compared (capacities: every layer)
CAPACITY_GRID = [(n, c, layers) for layers in (32, 28) for n in LENGTHS for c in BUDGETS]  # 28: Qwen2-7B

#: reading id -> (cluster, settings). The reference is run with these; the test maps each (reading, commit) to the
#: kvbench method that names that code
READINGS = {
    "snapkv_w8": ("snapkv", {"window": 8, "kernel": 7, "pooling": "maxpool"}),
    "snapkv_w32": ("snapkv", {"window": 32, "kernel": 7, "pooling": "maxpool"}),
    "pyramidkv_w8": ("pyramidkv", {"window": 8, "kernel": 7, "pooling": "maxpool", "beta": 20}),
    "h2o_w8": ("h2o", {"window": 8}),
    "h2o_w32": ("h2o", {"window": 32}),
    "streamingllm_w32": ("streamingllm", {"window": 32}),
    "streamingllm_c4": ("streamingllm", {"window": "C-4"}),  # the script's window since 2024-07-10
    "cam_w8": ("cam", {"window": 8, "start_budget_ratio": 0.1}),
}
#: CAMKVCluster first appears in e33367f (2024-11-04)
AVAILABLE = {"cam": ("7ee6be0", "c97f9d7")}


def modes(commit: str, shape: str) -> list[str]:
    """The reference's GQA modes to run: K/V repeated to the query heads before ``update_kv`` (every commit; the
    default), and unrepeated K/V with the group averaged inside (``kv_head``, c97f9d7 only). MHA has one mode."""
    if shape == "mha":
        return ["query_head"]
    return ["query_head", "kv_head"] if commit == "c97f9d7" else ["query_head"]


def cells() -> list[dict]:
    """Every (shape, n, C) cell with its first seed; the generator moves past seeds whose result is not robust."""
    out = []
    for s_idx, shape in enumerate(SHAPES):
        for n_idx, n in enumerate(LENGTHS):
            for c_idx, c in enumerate(BUDGETS):
                for rep in range(SEEDS_PER_CELL):
                    seed = 10_000 * (s_idx + 1) + 1_000 * n_idx + 100 * c_idx + 10 * rep
                    out.append({"shape": shape, "heads": SHAPES[shape][0], "kv_heads": SHAPES[shape][1],
                                "head_dim": HEAD_DIM, "n": n, "budget": c, "seed": seed})
    return out


def inputs(case: dict) -> dict[str, np.ndarray]:
    """The case's float32 arrays (see the module docstring)."""
    rng = np.random.RandomState(case["seed"])
    hq, hkv, d, n = case["heads"], case["kv_heads"], case["head_dim"], case["n"]
    queries = rng.standard_normal((hq, n, d)).astype(np.float32)
    keys = rng.standard_normal((hkv, n, d)).astype(np.float32)
    return {"queries": queries, "keys": keys}


def checksum(arrays: dict[str, np.ndarray]) -> float:
    """A float64 sum of every input, stored with each case: a test notices when the inputs drift."""
    return float(sum(np.abs(a.astype(np.float64)).sum() for a in arrays.values()))


def digests(kept: list[list[int]]) -> list[str]:
    """Short, exact fingerprints of the kept sets, one per head (sha256 of the sorted token indices, 48 bits): the
    fixtures stay small, and a mismatch still names the heads that differ."""
    return [hashlib.sha256(",".join(str(i) for i in sorted(head)).encode()).hexdigest()[:12] for head in kept]


def window_of(reading: str, budget: int) -> int:
    """The reading's window at KV size ``budget`` (StreamingLLM's script since 2024-07-10 keeps C - 4)."""
    window = READINGS[reading][1]["window"]
    return budget - 4 if window == "C-4" else int(window)
