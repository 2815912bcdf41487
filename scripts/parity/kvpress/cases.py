"""Seeded cases of the kvpress parity fixtures (scripts/parity/kvpress/generate.py, run next to kvpress 0.5.5) and
their test (tests/test_parity_kvpress.py): plain numpy, no kvbench, kvpress or transformers import.

A case is one attention layer's prompt: pre-RoPE queries ``(n, Hq, D)`` (kvpress computes its query statistics and
window queries from the layer's hidden states through ``q_proj``; the generator makes ``q_proj`` the identity, so
the hidden states are these queries), post-RoPE keys and values ``(n, Hkv, D)`` (what the cache holds). The default
RoPE (theta 10000) is applied to the queries at positions ``0 .. n-1`` by kvpress (TOVA's window attention) and by
the test (kvbench's engine hands methods post-RoPE queries).
"""

from __future__ import annotations

import hashlib

import numpy as np

ROPE_THETA = 10000.0
#: (query heads, KV heads, head_dim): MHA and GQA 4:1
SHAPES = [(4, 4, 16), (8, 2, 32)]
LENGTHS = [40, 100, 257]
RATIOS = [0.5, 0.75]
#: (fixture name, press description) as the generator builds them
PRESSES = [
    "knorm", "keydiff", "keydiff_block16", "keydiff_block128", "tova", "expected_attention",
    "adakv_knorm", "adakv_expected_attention", "chunkkv_knorm", "chunkkv_expected_attention",
]


def cases() -> list[dict]:
    out = []
    seed = 0
    for hq, hkv, d in SHAPES:
        for n in LENGTHS:
            for ratio in RATIOS:
                out.append({"seed": seed, "hq": hq, "hkv": hkv, "d": d, "n": n, "ratio": ratio})
                seed += 1
    return out


def inputs(case: dict) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(7919 + case["seed"])
    n, hq, hkv, d = case["n"], case["hq"], case["hkv"], case["d"]
    queries = rng.standard_normal((n, hq, d)).astype(np.float32)
    # keys with a per-head mean direction and spread norms, so that norms, cosines and expected logits all vary
    keys = (rng.standard_normal((n, hkv, d)) * rng.uniform(0.5, 1.5, (n, hkv, 1))
            + rng.standard_normal((1, hkv, d))).astype(np.float32)
    values = rng.standard_normal((n, hkv, d)).astype(np.float32)
    return {"queries": queries, "keys": keys, "values": values}


def n_kept(n: int, ratio: float) -> int:
    """kvpress's ``compute_n_kept``."""
    return max(1, int(n * (1 - ratio)))


def digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in ("queries", "keys", "values"):
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()
