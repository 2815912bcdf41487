"""The OmniKV parity cases: shapes, seeds and the seeded inputs, shared by ``generate.py`` (run in the side
environment next to the official code) and ``tests/test_parity_omnikv.py`` (run by CI without it).

Inputs come from numpy's legacy ``RandomState``, whose stream is frozen (NEP 19): a seed gives the same float32
tensors under any numpy and torch, so the fixtures store seeds and shapes, not tensors. Each case is a prompt of
``n`` tokens followed by ``steps`` decode steps at one filter layer:

* ``queries`` ``(Hq, n + steps, D)``: pre-RoPE queries of every position (what ``q_proj`` gives). The official code
  receives them as its layer's hidden states (identity ``q_proj``) and rotates them itself; kvbench receives them
  rotated at their own positions (``rotate``), as the engine hands them to a method;
* ``keys`` ``(Hkv, n, D)``: the prompt's cached (post-RoPE) keys; ``new_keys`` ``(Hkv, steps, D)``: the keys the
  decode steps append (no selector reads them: selection is over prompt tokens only).
"""

from __future__ import annotations

import numpy as np

SELECTORS = ("last", "softmax_before_last", "uniform", "exp")
ROPE_THETA = 10000.0
#: (heads, kv_heads, head_dim, n, k, window, steps): MHA, GQA 2:1 and 4:1, MQA; windows below, at and above the
#: number of steps (the window's prompt rows run out), and k below the window (the official code then keeps
#: max(1, k - window prompt rows) + those rows)
SHAPES = (
    (4, 4, 16, 48, 12, 6, 4),
    (8, 2, 16, 64, 16, 16, 5),
    (4, 1, 8, 33, 5, 4, 3),
    (6, 3, 32, 80, 20, 8, 10),
    (2, 1, 16, 40, 3, 6, 4),
    (8, 4, 8, 56, 28, 16, 18),
)
CASES_PER_SELECTOR = 12


def inputs(case: dict) -> dict[str, np.ndarray]:
    """The case's float32 arrays (see the module docstring)."""
    rng = np.random.RandomState(case["seed"])
    hq, hkv, d, n, steps = case["heads"], case["kv_heads"], case["head_dim"], case["n"], case["steps"]
    queries = rng.standard_normal((hq, n + steps, d)).astype(np.float32)
    keys = rng.standard_normal((hkv, n, d)).astype(np.float32)
    new_keys = rng.standard_normal((hkv, steps, d)).astype(np.float32)
    return {"queries": queries, "keys": keys, "new_keys": new_keys}


def checksum(arrays: dict[str, np.ndarray]) -> float:
    """A float64 sum of every input, stored with each case: a test notices when the inputs drift."""
    return float(sum(np.abs(a.astype(np.float64)).sum() for a in arrays.values()))


def case_spec(selector: str, index: int, seed: int) -> dict:
    """The ``index``-th case of ``selector`` (shapes cycle through SHAPES) with ``seed``."""
    hq, hkv, d, n, k, w, steps = SHAPES[index % len(SHAPES)]
    return {"seed": seed, "heads": hq, "kv_heads": hkv, "head_dim": d, "n": n, "k": k, "window": w,
            "steps": steps, "rope_theta": ROPE_THETA}


def first_seed(selector: str, index: int) -> int:
    """The seed a case starts from; the generator moves past seeds whose selections are not robust."""
    return 1000 * (SELECTORS.index(selector) + 1) + 10 * index
