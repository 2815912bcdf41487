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


#: KVzip: (layers, query heads, KV heads, head dim, prefix (tokens before the context), context tokens, chunk size,
#: repeat-prompt tokens before each chunk's copy, compression ratio (removed), layerwise)
KVZIP_SHAPES = [
    (3, 4, 4, 16, 0, 40, 2048, 6, 0.5, False),   # MHA, one chunk, no prefix
    (3, 8, 2, 16, 5, 70, 32, 9, 0.6, False),     # GQA 4:1, three chunks, a chat prefix
    (2, 4, 2, 32, 2, 50, 20, 7, 0.3, True),      # layerwise, prefix shorter than the sinks
    (4, 6, 3, 16, 6, 64, 64, 5, 0.75, True),     # GQA 2:1, one chunk, layerwise
]


def kvzip_case(index: int, seed: int) -> dict:
    layers, hq, hkv, d, prefix, ctx, chunk, extra, ratio, layerwise = KVZIP_SHAPES[index]
    return {"index": index, "seed": seed, "layers": layers, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "prefix": prefix, "context": ctx, "chunk_size": chunk, "repeat_extra": extra, "ratio": ratio,
            "layerwise": layerwise, "n_sink": 4}


def kvzip_chunks(case: dict) -> list[tuple[int, int]]:
    """(start, end) of each reconstructed chunk in cache positions (the context starts after the prefix)."""
    start, n, size = case["prefix"], case["prefix"] + case["context"], case["chunk_size"]
    return [(s, min(s + size, n)) for s in range(start, n, size)]


def kvzip_inputs(case: dict) -> dict:
    """Per layer: the cached keys of prefix + context ``(1, Hkv, n, D)`` and, per chunk, the repeat forward's post-RoPE
    queries ``(1, Hq, q, D)`` and keys ``(1, Hkv, q, D)`` (q = repeat_extra + chunk length), float32. A repeat query
    resembles the key of the context token it copies (the reconstruction attends to it), plus noise."""
    rng = np.random.RandomState(case["seed"])
    hq, hkv, d = case["q_heads"], case["kv_heads"], case["head_dim"]
    n = case["prefix"] + case["context"]
    out = {"keys": [], "queries": [], "repeat_keys": []}
    for _ in range(case["layers"]):
        keys = rng.standard_normal((1, hkv, n, d)).astype(np.float32)
        layer_q, layer_k = [], []
        for start, end in kvzip_chunks(case):
            q_len = case["repeat_extra"] + end - start
            q = rng.standard_normal((1, hq, q_len, d)).astype(np.float32)
            target = np.repeat(keys[:, :, start:end], hq // hkv, axis=1)
            q[:, :, case["repeat_extra"]:] += np.float32(0.8) * target
            layer_q.append(q)
            layer_k.append(rng.standard_normal((1, hkv, q_len, d)).astype(np.float32))
        out["keys"].append(keys)
        out["queries"].append(layer_q)
        out["repeat_keys"].append(layer_k)
    return out


def kvzip_digest(inputs: dict) -> str:
    arrays = list(inputs["keys"])
    for layer_q, layer_k in zip(inputs["queries"], inputs["repeat_keys"]):
        arrays += list(layer_q) + list(layer_k)
    return digest(*arrays)


# ---- KVzip end to end: a tiny random Llama, the same weights in both environments, a byte-level stub tokenizer ------
TINY_LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
              "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
              "tie_word_embeddings": False}
#: (prompt tokens, chunk size, compression ratio (removed), layerwise, seed)
KVZIP_MODEL_CASES = [
    (90, 2048, 0.5, False, 11),   # one chunk, global allocation
    (90, 32, 0.5, True, 12),      # three chunks, layerwise
    (120, 48, 0.75, False, 13),   # three chunks, 3/4 removed
]


def tiny_llama_weights(names_shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> dict:
    """Every parameter from numpy's legacy stream in name order (so both environments build the same model whatever
    their transformers initialises): norms 1 + 0.1 N(0, 1), the rest 0.08 N(0, 1)."""
    rng = np.random.RandomState(seed)
    out = {}
    for name, shape in sorted(names_shapes):
        noise = rng.standard_normal(shape).astype(np.float32)
        out[name] = (1 + np.float32(0.1) * noise) if name.endswith("norm.weight") else np.float32(0.08) * noise
    return out


def byte_encode(text: str) -> list[int]:
    """The stub tokenizer both sides use: one id per UTF-8 byte, in the tiny vocabulary."""
    return [3 + b % 250 for b in text.encode("utf-8")]


def kvzip_prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.RandomState(seed).randint(3, 253, size=n)]
