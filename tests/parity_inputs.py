"""Seeded inputs shared by the parity fixture generators (scripts/parity/*/generate.py, run in a side environment with
the official code's pinned transformers) and the parity tests: plain numpy (the legacy ``RandomState`` stream never
changes across numpy versions), no kvbench or transformers import.

A "stream" is what one attention layer sees over a prompt of ``n`` tokens and ``steps`` generated tokens: post-RoPE
queries ``(T, Hq, D)``, keys and values ``(T, Hkv, D)`` with ``T = n + steps``, float32. Layer ``l`` scales its
queries by ``scale`` so that layers differ in how peaked their attention is (the allocations then differ), and the
first token's keys get a shared offset ``sink`` so that it draws attention as a real model's first token does.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def stream(seed: int, layer: int, n: int, steps: int, hq: int, hkv: int, d: int, scale: float, sink: float = 0.0):
    """(queries, keys, values) as float32 numpy arrays of shapes (T, Hq, D), (T, Hkv, D), (T, Hkv, D)."""
    rng = np.random.RandomState(seed * 1000 + layer)
    t = n + steps
    q = rng.standard_normal((t, hq, d)).astype(np.float32) * np.float32(scale)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    if sink:
        direction = rng.standard_normal((hkv, d)).astype(np.float32)
        k[0] += np.float32(sink) * direction
        group = hq // hkv
        q += np.float32(sink / np.sqrt(d)) * np.repeat(direction, group, axis=0)[None]
    return q, k, v


def layer_scale(layer: int, num_layers: int) -> float:
    """Query scale of layer ``layer``: spread over [0.3, 2.7] in a scrambled order."""
    return 0.3 + 2.4 * ((layer * 7) % num_layers) / max(num_layers - 1, 1)


def digest(*arrays) -> str:
    """sha256 of the arrays' bytes: a fixture records it so a test knows it regenerated the same inputs."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def to_mask(positions, n: int) -> str:
    """A set of positions < n as a hex bitmask (bit i = position i), with duplicates marked: "hex" or "hex+dups"."""
    bits, seen, dups = 0, set(), []
    for p in positions:
        p = int(p)
        if p in seen:
            dups.append(p)
        seen.add(p)
        bits |= 1 << p
    text = format(bits, "x")
    return text + ("+" + ",".join(str(p) for p in sorted(dups)) if dups else "")


def from_mask(text: str) -> list[int]:
    """Positions of ``to_mask``'s text, sorted, duplicates repeated."""
    hexpart, _, dups = text.partition("+")
    bits = int(hexpart, 16)
    out = [i for i in range(bits.bit_length()) if bits >> i & 1]
    out += [int(p) for p in dups.split(",")] if dups else []
    return sorted(out)


def parity_cases(reference: str) -> ModuleType:
    """``scripts/parity/<reference>/cases.py`` (the seeded cases its generator wrote the fixtures from), imported by
    path: the scripts folder is not a package."""
    spec = importlib.util.spec_from_file_location(f"{reference}_parity_cases",
                                                  ROOT / "scripts" / "parity" / reference / "cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
