"""Seeded cases shared by the kvpress fixture generator (``generate.py``, run in the kvpress side environment) and
the parity tests: plain numpy (the legacy ``RandomState`` stream never changes across numpy versions).

ThinK: one attention layer's post-RoPE queries ``(B, Hq, n, D)`` and keys ``(B, Hkv, n, D)``, float32. Channel
magnitudes are uneven, as in real keys and queries (the paper's Figure 2): each (head, channel) gets its own scale.
"""

from __future__ import annotations

import hashlib

import numpy as np

#: (batch, query heads, KV heads, head dim, prompt n, window, key_channel_compression_ratio)
THINK_SHAPES = [
    (1, 4, 4, 16, 48, 32, 0.5),   # MHA
    (2, 8, 2, 16, 64, 32, 0.5),   # GQA 4:1, two rows
    (1, 4, 1, 32, 40, 8, 0.25),   # MQA, short window
    (1, 6, 3, 64, 80, 32, 0.5),   # GQA 2:1, SmolLM2's head_dim
    (1, 4, 2, 16, 20, 32, 0.75),  # prompt shorter than the window
    (2, 4, 2, 64, 100, 32, 0.3),  # int(64 * 0.3) = 19 channels pruned
]


def think_case(index: int, seed: int) -> dict:
    b, hq, hkv, d, n, w, ratio = THINK_SHAPES[index]
    return {"index": index, "seed": seed, "batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "n": n,
            "window": w, "ratio": ratio}


def think_inputs(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """(queries (B, Hq, n, D), keys (B, Hkv, n, D)) float32."""
    rng = np.random.RandomState(case["seed"])
    b, hq, hkv, d, n = case["batch"], case["q_heads"], case["kv_heads"], case["head_dim"], case["n"]
    q_scale = rng.uniform(0.2, 3.0, (1, hq, 1, d)).astype(np.float32)
    k_scale = rng.uniform(0.2, 3.0, (1, hkv, 1, d)).astype(np.float32)
    queries = rng.standard_normal((b, hq, n, d)).astype(np.float32) * q_scale
    keys = rng.standard_normal((b, hkv, n, d)).astype(np.float32) * k_scale
    return queries, keys


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
