"""KVzip's scoring and selection against the official code (snu-mllab/KVzip 5d84729: ``ModelKVzip.prefill`` +
``scoring`` + ``EvictCache.prune``).

tests/fixtures/parity/kvzip_official.json was written by scripts/parity/kvzip/generate.py, which runs the official
pipeline (transformers 4.51.3; the CUDA kernels stubbed, never reached before decoding) on a tiny Llama whose q/k/v
projections return seeded post-RoPE tensors (tests/parity_inputs.py): the code's system prompt (the llama3.1
template, S tokens), the context, its repeat forwards chunk by chunk, its scores and its global threshold. These tests
hand kvbench's ``KVzip`` the same tensors through its hooks (``prefill``, ``score_reconstruction`` per chunk and layer
with the repeat tokens in the cache, ``finish_reconstruction``), with ``n_sink=S`` (the code's softmax sinks and
never-evicted entries are its system prompt) and the budget whose kept count is the code's. They need neither the
official code nor its environment.

Compared: scores within 1e-6 absolute (per-head sums within rtol 1e-5 for the long case), kept context entries per
layer and KV head exactly (global allocation over layers and heads). Named differences of kvbench's default reading
(docs/method_ambiguities.md, KVzip): the code keeps ``int(N * ratio) - 1`` context entries (strictly above the
``int(N * ratio)``-th score); its later-chunk prompt ends with a space before the previous chunk's tail; its postfix
is its own template's, not the tokenizer's chat template; it chunks the context (2,000 tokens) after the system
prompt, kvbench the whole prompt (2,048).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import digest, from_mask, layer_scale, stream

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.methods.kvzip import KVzip
from kvbench.methods.kvzip_ops import FIRST_CHUNK_PROMPT, LATER_CHUNK_PROMPT, PREVIOUS_TAIL_TOKENS

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "kvzip_official.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
TOL = FIXTURE["tolerance"]


def _streams(case):
    n = case["sys_len"] + case["context"]
    repeat = sum(c[2] for c in case["chunks"])
    out = [stream(case["seed"], li, n, repeat, case["hq"], case["hkv"], case["d"], layer_scale(li, case["layers"]),
                  0.0) for li in range(case["layers"])]
    assert digest(*[a for s in out for a in s]) == case["input_sha"], "the seeded inputs changed"
    return [tuple(torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in s) for s in out]


def _run(case):
    """kvbench's KVzip through its hooks on the code's chunks: (layers after eviction, scores per layer (1, H, n))."""
    s, n, d = case["sys_len"], case["sys_len"] + case["context"], case["d"]
    method = KVzip(n_sink=s)
    streams = _streams(case)
    layers = []
    for li, (q, k, v) in enumerate(streams):
        layer = make_layer(k[:, :, :n].clone(), v[:, :, :n].clone())
        method.prefill(layer, prefill_ctx(q[:, :, :n], layer, case["budget"], li, case["layers"]))
        layers.append(layer)
    at = n
    for start, end, length in case["chunks"]:
        for li, ((q, k, v), layer) in enumerate(zip(streams, layers)):
            layer.update(k[:, :, at : at + length], v[:, :, at : at + length])
            method.score_reconstruction(li, layer, q[:, :, at : at + length], start, end, d**-0.5)
            layer.drop_newest(length)
        at += length
    scores = [method._scores[li].clone() for li in range(len(layers))]
    method.finish_reconstruction(layers)
    return layers, scores


def test_fixture_is_the_official_codes():
    assert FIXTURE["official"]["repo"] == "snu-mllab/KVzip" and FIXTURE["official"]["commit"].startswith("5d84729")
    assert FIXTURE["environment"]["transformers"] == "4.51.3"
    assert len(CASES) >= 5 and any(len(c["chunks"]) > 1 for c in CASES.values())
    for case in CASES.values():  # the code keeps one entry fewer than its ratio names
        total = case["layers"] * case["hkv"] * case["context"]
        assert int(total * case["ratio"]) - 1 == case["kept_entries"]
        assert case["kept_entries"] == case["layers"] * case["hkv"] * (case["budget"] - case["sys_len"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_kvzip_keeps_what_the_official_code_keeps(name):
    case = CASES[name]
    s = case["sys_len"]
    layers, scores = _run(case)
    for li, (layer, official) in enumerate(zip(layers, case["per_layer"])):
        assert kept_positions(layer) == [list(range(s)) + from_mask(m) for m in official["kept"]], (name, li)
        ours = scores[li][0, :, s:].double()
        assert bool((scores[li][0, :, :s] == 0).all())  # the system prompt is never scored, as in the code
        if "scores" in official:
            theirs = torch.tensor(official["scores"], dtype=torch.float64)
            torch.testing.assert_close(ours, theirs, atol=TOL["scores_atol"], rtol=0)
        else:
            theirs = torch.tensor(official["score_sums"], dtype=torch.float64)
            torch.testing.assert_close(ours.sum(-1), theirs, rtol=TOL["score_sums_rtol"], atol=0)


def test_kvzip_repeat_prompts_differ_from_the_official_codes():
    """The code's repeat inputs (bytes of a byte-level tokenizer): the first chunk's prompt is kvbench's
    ``FIRST_CHUNK_PROMPT``; the later chunks' ends with a space before the previous chunk's last 8 tokens
    (kvbench, as kvpress: no space); both are followed by the code's template postfix, which kvbench takes from the
    tokenizer's chat template instead."""
    case = CASES["gqa_m2100_c900_two_chunks"]
    postfix = bytes(case["postfix"])
    first, later = (bytes(p) for p in case["repeat_prompts"])
    assert postfix == b"\n\n<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert first == FIRST_CHUNK_PROMPT.encode() + postfix
    assert later[: -len(postfix) - PREVIOUS_TAIL_TOKENS] == LATER_CHUNK_PROMPT.encode() + b" "
    assert case["chunks"][0][:2] == [case["sys_len"], case["sys_len"] + 2000]  # 2,000 context tokens, after S
    assert KVzip().chunk_size == 2048
