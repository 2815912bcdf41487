"""Golden fixture from kvpress's KVzipPress: the reconstruction scores (max attention a context entry receives while
the model repeats the context) and the entries kept, per layer and KV head, on seeded inputs.

Runs in the kvpress side environment (kvpress 0.5.5), never in kvbench's; kvpress is imported, nothing copied here.

    /work/venv-kvpress/bin/python scripts/parity/kvpress/generate_kvzip.py

For each case of ``cases.py`` and each layer, the generator calls ``KVzipPress.score_kvzip`` once per reconstructed
chunk, exactly as its forward hook does during a repeat forward: with a stand-in attention module whose ``q_proj`` is
the identity (the hidden states are the repeat forward's post-RoPE queries) and RoPE the identity (cos 1, sin 0),
the cached keys of prefix + context followed by the repeat tokens' keys, and ``start_idx``/``end_idx`` of the chunk.
Then ``KVzipPress.compress_post`` decides what is evicted (sinks, global or layerwise bottom-k); the evicted entries
are read from each stand-in module's ``masked_key_indices``. Model-level parts (the repeat prompt's tokens, the chat
template's prefix/suffix, the forwards themselves) are not exercised here: they need a real model and tokenizer.
KVzipPress cannot run in float64 (its causal mask is built as float32 from float64's minimum), so there is no
float64 near-tie screen here: the test compares kept sets exactly and states the score tolerance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402  (scripts/parity/kvpress/cases.py, shared with the tests)


def kvpress_run(case: dict, dtype) -> tuple[list, list]:
    """(scores per layer (Hkv lists of n floats), kept entries per layer and KV head)."""
    import torch
    from kvpress import KVzipPress
    from torch import nn

    arrays = C.kvzip_inputs(case)
    hq, hkv, d = case["q_heads"], case["kv_heads"], case["head_dim"]
    n = case["prefix"] + case["context"]

    class Attention(nn.Module):  # what KVzipPress reads of a Llama attention module
        def __init__(self, layer_idx: int):
            super().__init__()
            self.config = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv,
                                          _attn_implementation="sdpa")
            self.head_dim, self.layer_idx = d, layer_idx
            self.q_proj = nn.Identity()

    modules = [Attention(i) for i in range(case["layers"])]
    press = KVzipPress(compression_ratio=case["ratio"], layerwise=case["layerwise"], n_sink=case["n_sink"],
                       chunk_size=case["chunk_size"])
    press.context_length = n
    press.score_val = torch.zeros(case["layers"], 1, hkv, n, dtype=dtype)
    for layer, module in enumerate(modules):
        keys = torch.from_numpy(arrays["keys"][layer]).to(dtype)
        for (start, end), q, rk in zip(C.kvzip_chunks(case), arrays["queries"][layer], arrays["repeat_keys"][layer]):
            press.start_idx, press.end_idx = start, end
            queries = torch.from_numpy(q).to(dtype)
            q_len = queries.shape[2]
            hidden = queries.transpose(1, 2).reshape(1, q_len, hq * d)
            cached = torch.cat([keys, torch.from_numpy(rk).to(dtype)], dim=2)
            rope = (torch.ones(1, q_len, d, dtype=dtype), torch.zeros(1, q_len, d, dtype=dtype))
            press.score_kvzip(module, hidden, cached, cached.clone(), None, {"position_embeddings": rope})
    scores = press.score_val[:, 0].tolist()
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=m) for m in modules]))
    press.compress_post(model)
    kept = []
    for module in modules:
        _, heads, seq = module.masked_key_indices
        evicted = [set() for _ in range(hkv)]
        for h, s in zip(heads.tolist(), seq.tolist()):
            evicted[h].add(s)
        kept.append([[i for i in range(n) if i not in evicted[h]] for h in range(hkv)])
    return scores, kept


def main() -> None:
    from importlib.metadata import version

    import torch
    import transformers

    cases, skipped = [], []
    for index in range(len(C.KVZIP_SHAPES)):
        case = C.kvzip_case(index, 200 + index)
        scores, kept = kvpress_run(case, torch.float32)
        case["scores"] = [[[round(x, 7) for x in head] for head in layer] for layer in scores]
        case["kept"] = kept
        case["inputs_sha256"] = C.kvzip_digest(C.kvzip_inputs(case))
        cases.append(case)
    fixture = {
        "reference": f"kvpress {version('kvpress')} KVzipPress.score_kvzip + compress_post",
        "environment": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "generator": "scripts/parity/kvpress/generate_kvzip.py",
        "skipped_seeds": skipped,
        "cases": cases,
    }
    path = REPO / "tests" / "fixtures" / "parity" / "kvpress_kvzip.json"
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {len(cases)} cases, skipped seeds {skipped}")


if __name__ == "__main__":
    main()
