"""KVzip's scoring and selection against kvpress: on seeded inputs, kvbench's reconstruction scores equal kvpress 0.5.5
``KVzipPress.score_kvzip``'s within 1e-6 (absolute; attention probabilities in float32) and the entries kept per layer
and KV head equal ``KVzipPress.compress_post``'s exactly (global and layerwise allocation, sinks, a chat prefix).

The fixture ``tests/fixtures/parity/kvpress_kvzip.json`` was written by ``scripts/parity/kvpress/generate_kvzip.py``
in the kvpress side environment; this test needs neither. The repeat forwards themselves (the engine's hook)
are compared end to end on a tiny random Llama (``kvpress_kvzip_model.json``, ``generate_kvzip_model.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import parity_cases

from kvbench.methods.kvzip_ops import kvzip_keep, reconstruction_scores

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "parity" / "kvpress_kvzip.json").read_text())
TOLERANCE = 1e-6


CASES = parity_cases("kvpress")


def _scores(case) -> torch.Tensor:
    """kvbench's scores ``(L, 1, H, n)``, chunk by chunk as the repeat forwards would produce them."""
    arrays = CASES.kvzip_inputs(case)
    assert CASES.kvzip_digest(arrays) == case["inputs_sha256"], "the seeded inputs changed"
    n = case["prefix"] + case["context"]
    out = torch.zeros(case["layers"], 1, case["kv_heads"], n)
    for layer in range(case["layers"]):
        keys = torch.from_numpy(arrays["keys"][layer])
        for (start, end), q, rk in zip(CASES.kvzip_chunks(case), arrays["queries"][layer],
                                       arrays["repeat_keys"][layer]):
            cached = torch.cat([keys, torch.from_numpy(rk)], dim=2)
            out[layer, :, :, start:end] = reconstruction_scores(torch.from_numpy(q), cached, start, end,
                                                                case["n_sink"], case["head_dim"] ** -0.5)
    return out


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"case{c['index']}")
def test_kvpress_kvzip_scores(case):
    ours = _scores(case)[:, 0]
    assert torch.allclose(ours, torch.tensor(case["scores"]), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"case{c['index']}")
def test_kvpress_kvzip_kept_entries(case):
    scores = _scores(case)
    n_layers, _, h, n = scores.shape
    per = h * n if case["layerwise"] else n_layers * h * n
    keep = kvzip_keep(scores, int(per * case["ratio"]), case["layerwise"], case["n_sink"])
    kept = [[torch.nonzero(keep[layer, 0, head]).flatten().tolist() for head in range(h)] for layer in range(n_layers)]
    assert kept == case["kept"]


MODEL_FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "parity" / "kvpress_kvzip_model.json").read_text())
MODEL_TOLERANCE = 1e-5  # the repeat forwards' hidden states: kvpress's model under sdpa, kvbench's attention


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**MODEL_FIXTURE["model"], attn_implementation="sdpa")).eval()
    weights = CASES.tiny_llama_weights([(name, tuple(p.shape)) for name, p in model.state_dict().items()])
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(torch.from_numpy(weights[name]))
    return model.requires_grad_(False)


@pytest.mark.parametrize("case", MODEL_FIXTURE["cases"], ids=lambda c: f"n{c['n']}-chunk{c['chunk_size']}")
def test_kvpress_kvzip_end_to_end_on_a_tiny_llama(tiny_llama, case, monkeypatch):
    """The whole method in the engine (prefill, the session's repeat forwards, scoring, eviction) against kvpress's
    pipeline on the same model and tokens: scores within 1e-5, kept entries exact per layer and KV head."""
    from helpers import ByteTokenizer, kept_positions
    from kvbench.budget import Budget
    from kvbench.engine import CompressionSession, greedy_generate
    from kvbench.engine import generate as generate_module
    from kvbench.engine.cache import KVCache
    from kvbench.methods import build_method
    from kvbench.methods.kvzip import KVzip

    n = case["n"]
    layers, heads = len(case["kept"]), len(case["kept"][0])
    per = heads * n if case["layerwise"] else layers * heads * n
    capacity = n - int(per * case["ratio"]) // (heads if case["layerwise"] else layers * heads)
    assert (n - capacity) * (heads if case["layerwise"] else layers * heads) == int(per * case["ratio"])
    budget = Budget.parse(capacity)
    method = build_method({"name": "kvzip", "chunk_size": case["chunk_size"], "layerwise": case["layerwise"]}, budget)
    scores, caches = [], []
    finish = KVzip.finish_reconstruction

    def recording(self, layers_):
        scores.append(torch.stack([self._scores[i][0] for i in range(len(layers_))]))
        finish(self, layers_)

    class Recording(KVCache):
        def __init__(self):
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(KVzip, "finish_reconstruction", recording)
    monkeypatch.setattr(generate_module, "KVCache", Recording)
    with CompressionSession(tiny_llama, method, budget, tokenizer=ByteTokenizer()) as session:
        greedy_generate(tiny_llama, [CASES.kvzip_prompt(n, case["seed"])], 1, [], 0)
    assert torch.allclose(scores[0], torch.tensor(case["scores"]), atol=MODEL_TOLERANCE, rtol=0)
    assert [kept_positions(layer) for layer in caches[0].layers] == case["kept"]
    assert sum(session.stats.layer_entries_after_prefill) == layers * capacity
