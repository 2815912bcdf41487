"""Seeded cases of the kvpress parity fixtures (scripts/parity/kvpress/generate*.py, run next to kvpress 0.5.5) and
their tests (tests/test_parity_kvpress*.py): plain numpy (the legacy ``RandomState`` stream never changes across numpy
versions), no kvbench, kvpress or transformers import.

Scorers (knorm, keydiff, tova, expected_attention, adakv, chunkkv): one attention layer's prompt: pre-RoPE queries
``(n, Hq, D)`` (kvpress computes its query statistics and window queries from the layer's hidden states through
``q_proj``; the generator makes ``q_proj`` the identity, so the hidden states are these queries), post-RoPE keys and
values ``(n, Hkv, D)`` (what the cache holds). The default RoPE (theta 10000) is applied to the queries at positions
``0 .. n-1`` by kvpress (TOVA's window attention) and by the test (kvbench's engine hands methods post-RoPE queries).

ThinK: one attention layer's post-RoPE queries ``(B, Hq, n, D)`` and keys ``(B, Hkv, n, D)``, float32. Channel
magnitudes are uneven, as in real keys and queries (the paper's Figure 2): each (head, channel) gets its own scale.
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


def digest_arrays(*arrays) -> str:
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
    return digest_arrays(*arrays)


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


# ---- decoding: kvpress DecodingPress around a scorer, one attention layer over a generation -------------------------
#: (query heads, KV heads, head dim, prompt tokens, decode steps, interval, target_size, query buffer)
DECODING_SHAPES = [
    (4, 4, 16, 40, 70, 16, 48, 128),   # MHA; buffer longer than the interval (every step since the last compression)
    (8, 2, 32, 60, 90, 20, 50, 6),     # GQA 4:1; buffer 6 < interval: 7 queries score (kvpress trims after appending)
    (4, 2, 16, 30, 50, 12, 24, 0),     # prompt above the target from the start; buffer 0: the current query alone
]
#: the presses the generator wraps (kvbench method fields of the same scorer in the test)
DECODING_PRESSES = ["knorm", "keydiff", "tova", "snapkv"]
#: SnapKV's window and kernel in these cases (kvpress SnapKVPress(window_size, kernel_size); kvbench pooling=avg)
DECODING_SNAPKV = (4, 5)


def decoding_case(index: int, seed: int) -> dict:
    hq, hkv, d, n, steps, interval, target, buffer = DECODING_SHAPES[index]
    return {"index": index, "seed": seed, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "n": n, "steps": steps,
            "interval": interval, "target_size": target, "query_buffer": buffer}


def decoding_inputs(case: dict) -> dict[str, np.ndarray]:
    """The prompt's keys/values ``(1, Hkv, n, D)`` and, per decode step, its query ``(1, Hq, 1, D)`` and key/value
    ``(1, Hkv, 1, D)`` (stacked over steps on axis 2), float32. Values carry their position in channel 0 (the generator
    reads kvpress's kept positions back from them), times the case's ``position_scale`` (1 unless set: K-norm, KeyDiff,
    TOVA and SnapKV read no values; Expected Attention's value norms would be the positions at scale 1)."""
    rng = np.random.RandomState(case["seed"])
    hq, hkv, d, n, steps = case["q_heads"], case["kv_heads"], case["head_dim"], case["n"], case["steps"]
    total = n + steps
    keys = (rng.standard_normal((1, hkv, total, d)) * rng.uniform(0.5, 1.5, (1, hkv, total, 1))
            + rng.standard_normal((1, hkv, 1, d))).astype(np.float32)
    values = rng.standard_normal((1, hkv, total, d)).astype(np.float32)
    values[..., 0] = np.arange(total, dtype=np.float32) * np.float32(case.get("position_scale", 1))
    queries = rng.standard_normal((1, hq, steps, d)).astype(np.float32)
    return {"keys": keys, "values": values, "queries": queries}


def decoding_applies(case: dict, press: str) -> bool:
    """Whether the press can score this case's buffer: SnapKV needs more queries than its window, Expected Attention
    more than its sinks (kvpress drops the buffer's first n_sink; kvbench refuses both at plan)."""
    queries = min(case["interval"], case["query_buffer"] + 1)
    if press == "expected_attention":
        return queries > DECODING_EXPECTED_ATTENTION["n_sink"]
    return press != "snapkv" or queries > DECODING_SNAPKV[0]


#: Expected Attention's decode cases (scripts/parity/kvpress/generate_decoding_expected_attention.py): kvpress's
#: defaults (ExpectedAttentionPress(): 512 future positions, 4 sinks, covariance and value norms on), a real RoPE
#: (base 10000) and the values' position channel scaled down (so the value norms are not the positions)
DECODING_EXPECTED_ATTENTION = {"n_sink": 4, "rope_theta": 10000.0, "position_scale": 1e-3}
