"""Golden fixture from kvpress's KVzipPress run end to end on a tiny random Llama: the scores and the entries kept
per layer and KV head after its own repeat forwards.

Runs in the kvpress side environment (kvpress 0.5.5, transformers 5.2), never in kvbench's:

    /work/venv-kvpress/bin/python scripts/parity/kvpress/generate_kvzip_model.py

The model is a ``LlamaForCausalLM`` built from ``cases.TINY_LLAMA`` with every weight set from ``cases.
tiny_llama_weights`` (numpy's legacy stream), so kvbench's test builds the same model. KVzipPress loads a tokenizer
from the model's name; the generator hands it a byte-level stub (``cases.byte_encode``, no chat template: kvpress then
uses no prefix and a newline suffix) by replacing ``AutoTokenizer`` in kvpress's module namespace. Everything else is
kvpress's: the prefill under ``with press(model)``, its chunking, its repeat forwards through the model with its
hooks, ``score_kvzip`` and ``compress_post``. Scores are read from ``score_val`` just before ``compress_post``; the
evicted entries from each attention module's ``masked_key_indices``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402


class ByteTokenizer:
    chat_template = None

    def encode(self, text, return_tensors=None, add_special_tokens=False):
        import torch

        ids = C.byte_encode(text)
        return torch.tensor([ids]) if return_tensors == "pt" else ids


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**C.TINY_LLAMA, attn_implementation="sdpa")).eval()
    shapes = [(name, tuple(p.shape)) for name, p in model.state_dict().items()]
    weights = C.tiny_llama_weights(shapes)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(torch.from_numpy(weights[name]))
    return model


def run(model, n: int, chunk: int, ratio: float, layerwise: bool, seed: int) -> dict:
    import kvpress.presses.kvzip_press as kz
    import torch
    from kvpress import KVzipPress
    from transformers import DynamicCache

    kz.AutoTokenizer = SimpleNamespace(from_pretrained=lambda *args, **kwargs: ByteTokenizer())
    press = KVzipPress(compression_ratio=ratio, layerwise=layerwise, chunk_size=chunk)
    captured = []
    compress_post = press.compress_post

    def recording(model_):
        captured.append(press.score_val[:, 0].clone())
        compress_post(model_)

    press.compress_post = recording
    ids = torch.tensor([C.kvzip_prompt(n, seed)])
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=DynamicCache())
    kept = []
    for layer in model.model.layers:
        _, heads, seq = layer.self_attn.masked_key_indices
        evicted = [set() for _ in range(C.TINY_LLAMA["num_key_value_heads"])]
        for h, s in zip(heads.tolist(), seq.tolist()):
            evicted[h].add(s)
        kept.append([[i for i in range(n) if i not in e] for e in evicted])
        del layer.self_attn.masked_key_indices
    return {"n": n, "chunk_size": chunk, "ratio": ratio, "layerwise": layerwise, "seed": seed,
            "scores": [[[round(x, 7) for x in head] for head in layer] for layer in captured[0].tolist()],
            "kept": kept}


def main() -> None:
    from importlib.metadata import version

    import torch
    import transformers

    model = build_model()
    cases = [run(model, *case) for case in C.KVZIP_MODEL_CASES]
    fixture = {
        "reference": f"kvpress {version('kvpress')} KVzipPress (prefill, repeat forwards, score_kvzip, compress_post)",
        "environment": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "generator": "scripts/parity/kvpress/generate_kvzip_model.py",
        "model": C.TINY_LLAMA,
        "cases": cases,
    }
    path = REPO / "tests" / "fixtures" / "parity" / "kvpress_kvzip_model.json"
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {len(cases)} cases")


if __name__ == "__main__":
    main()
