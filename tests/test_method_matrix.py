"""Every runnable method of the registry, in the spirit of kvpress's press matrix: a token budget and a ratio budget,
MHA and GQA, one prompt and (for methods that batch) a left-padded batch of two, on a tiny random Llama. Each run
generates, and its cache holds what the method's budget arithmetic says:

* methods that evict at prefill (and, for some, at every step) hold ``L x C`` entries per row over the layers (C the
  budget's tokens for the row's prompt; every layer C for uniform methods), plus the generated token for prefill-only
  methods; KVMerger's heads may end a few valid entries short (its ragged merge sets);
* methods that keep everything resident (FullKV, POD without a map, Quest/InfLLM/OmniKV's selection) hold the prompt;
* ThinK holds SnapKV's entries with keys of half their channels;
* KVzip (fed its repeat prompt by a byte-level stub tokenizer) holds ``L x C`` entries over layers and heads, and AdaKV
  ``H x C`` per layer over its heads, each head only what it keeps (their ragged layout: bytes exact, batch included);
  ChunkKV holds SnapKV's window and the whole 20-token chunks that fit in the rest of the budget;
* KVMerger under a ratio budget runs the paper's fixed theta (``budget_mode=auto``): its size is data-dependent, at
  most the prompt.

Resident bytes are exact where the cache's layout is (one row; a ragged layout; a batch of a uniform method: every
layer as wide as the widest row), bounded otherwise (a batch's per-layer widths are the widest row's allocation in
that layer).
"""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import ByteTokenizer, method_fields, record_caches
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.methods import METHODS, build_method
from kvbench.models.tiny import build_tiny_llama, resolve_tiny

NOT_ON_CPU = {"cla", "lococo", "offload"}  # trained checkpoints (CLA, LoCoCo), CUDA (offload)
RUNNABLE = sorted(set(METHODS.names()) - NOT_ON_CPU)
EVICTS_EVERY_STEP = {"cam", "d2o", "h2o", "lminfinite", "local", "roco", "sirllm", "streamingllm", "tova"}
PREFILL_ONLY = {"dynamickv", "kvmerger", "kvzip", "pyramidinfer", "pyramidkv", "snapkv", "think", "knorm", "keydiff",
                "expected_attention", "adakv", "chunkkv", "rkv"}
KEEPS_RESIDENT = {"fullkv", "pod", "infllm", "omnikv", "quest"}
#: compresses only once decoding filled its budget + divide_length (TriAttention: 128 steps, beyond this matrix's one
#: step; a budget of tokens only): the prompt stays whole here (tests/test_method_triattention.py runs the schedule)
COMPRESSES_LATER = {"triattention"}
UNIFORM = {"cam", "h2o", "lminfinite", "local", "roco", "sirllm", "snapkv", "streamingllm", "think", "knorm", "keydiff",
           "expected_attention", "tova", "chunkkv", "rkv"}
#: heads of a layer keep different numbers, the layer as long as its longest head (padding allocated and counted)
PADDED_HEADS = {"kvmerger"}
#: heads of a layer keep different numbers, each holding only its own (layout=ragged, their default): bytes exact
RAGGED = {"kvzip", "adakv"}
#: the authors' AdaKV allocation rounds each head's budget (round(c_h (1 - alpha) + int(alpha B))): a layer holds the
#: budget to within half an entry per head plus alpha B's fraction, not exactly (tests/test_parity_adakv_official.py)
ROUNDED = {"adakv"}
LAYERS, HEAD_DIM = 4, 16
LENGTHS = (160, 140)  # the batch's rows (the first alone for batch 1)
BUDGETS = ("64", "0.5")  # InfLLM needs 64 tokens; a ratio gives the rows 80 and 70
NEW_TOKENS = 2  # one decode step
#: OmniKV's default filter layers (Llama-3-8B's, scaled to depth) cover every layer of a 4-layer model: one, as the
#: paper sets them per model
FIELDS = {"omnikv": {"filter_layers": [0]}}
#: OmniKV's ratio is its Mem% (resident share of the sparse layers' context), above the dense layers' share (2 of 4)
RATIO = {"omnikv": 0.75}


def test_every_runnable_method_is_in_the_matrix():
    assert EVICTS_EVERY_STEP | PREFILL_ONLY | KEEPS_RESIDENT | COMPRESSES_LATER == set(RUNNABLE)


@functools.cache
def _model(kv_heads: int):
    arch = resolve_tiny({"layers": LAYERS, "heads": 4, "kv_heads": kv_heads, "head_dim": HEAD_DIM})
    return build_tiny_llama(arch, vocab_size=256, context_length=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            attn_implementation="sdpa").eval()


#: (KV heads of 4 query heads, batch); MHA's batch of two is marked slow (the matrix stays under 2 min on 2 cores)
SHAPES = [pytest.param(2, 1, id="gqa-1"), pytest.param(2, 2, id="gqa-2"), pytest.param(4, 1, id="mha-1"),
          pytest.param(4, 2, id="mha-2", marks=pytest.mark.slow)]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _entry_bytes(name: str, kv_heads: int) -> int:
    """Bytes of one entry over all layers: K and V, float32 (ThinK's keys keep half their channels)."""
    key_dim = HEAD_DIM // 2 if name == "think" else HEAD_DIM
    return LAYERS * kv_heads * (key_dim + HEAD_DIM) * 4


@pytest.mark.parametrize(("kv_heads", "batch"), SHAPES)
@pytest.mark.parametrize("budget_text", BUDGETS)
@pytest.mark.parametrize("name", RUNNABLE)
def test_method_matrix(name, budget_text, kv_heads, batch, monkeypatch):
    model = _model(kv_heads)
    value = RATIO.get(name, float(budget_text)) if "." in budget_text else int(budget_text)
    budget = Budget.parse(None if name == "fullkv" else value)
    if name in COMPRESSES_LATER and budget.kind == "ratio":
        pytest.skip(f"{name}'s budget is a number of tokens (a ratio is refused: tests/test_method_triattention.py)")
    method = build_method({"name": name, **FIELDS.get(name, {}), **method_fields(name, model)}, budget)
    if batch > 1 and not method.supports_batching:
        pytest.skip(f"{name} refuses batches (supports_batching=False)")
    prompts = [_prompt(n, 7 + row) for row, n in enumerate(LENGTHS[:batch])]
    caches = record_caches(monkeypatch)
    tokenizer = ByteTokenizer() if method.needs_reconstruction else None
    with CompressionSession(model, method, budget, tokenizer=tokenizer) as session:
        out = greedy_generate(model, prompts, NEW_TOKENS, [], 0)
    assert out.decode_steps == NEW_TOKENS - 1 and all(len(t) == NEW_TOKENS for t in out.tokens)
    layers = caches[-1].layers
    assert len(layers) == LAYERS
    kv_heads = model.config.num_key_value_heads
    entry = _entry_bytes(name, kv_heads)
    steps = out.decode_steps
    if name in KEEPS_RESIDENT | COMPRESSES_LATER:
        caps = list(LENGTHS[:batch])
        grown = steps
    else:
        caps = [budget.tokens_for(n) for n in LENGTHS[:batch]]
        grown = 0 if name in EVICTS_EVERY_STEP else steps
    if name == "chunkkv":  # SnapKV's window of 32, then whole chunks of 20 in what is left of the budget
        caps = [32 + (cap - 32) // 20 * 20 for cap in caps]
    data_dependent = name == "kvmerger" and budget.kind == "ratio"
    if data_dependent:
        caps = list(LENGTHS[:batch])
    for row, cap in enumerate(caps):  # valid entries per row, summed over layers (mean over KV heads)
        held = sum(float(layer.valid_counts()[row].float().mean()) for layer in layers)
        expected = LAYERS * (cap + grown)
        if data_dependent:
            assert 0 < held <= expected, (row, held)
        elif name == "kvmerger":  # heads padded to the budget; a head can end a few valid entries short
            assert expected - LAYERS * 8 <= held <= expected, (row, held)
        elif name in ROUNDED:  # mean over heads: within 1/2 (rounding) + 1 (alpha B's fraction) per layer
            assert abs(held - expected) < LAYERS * 1.5, (row, held, expected)
        else:
            assert held == expected, (row, held, expected)
    width = max(caps) + grown
    if data_dependent:
        assert 0 < out.resident_kv_bytes_final <= batch * width * entry
    elif name in ROUNDED:  # ragged: exactly the entries every head holds, nothing more
        held = sum(int(layer.valid_counts().sum()) for layer in layers)
        assert out.resident_kv_bytes_final == held * entry // (LAYERS * kv_heads)
    elif name in RAGGED:  # what every row keeps, nothing more, over heads and layers
        assert session.stats.resident_kv_bytes_after_prefill == sum(caps) * entry
        assert out.resident_kv_bytes_final == sum(cap + grown for cap in caps) * entry
    elif batch == 1 and name not in PADDED_HEADS:  # padded heads: bounded below
        assert session.stats.resident_kv_bytes_after_prefill == caps[0] * entry
        assert out.resident_kv_bytes_final == (caps[0] + grown) * entry
    elif name in UNIFORM | KEEPS_RESIDENT:  # every layer as wide as the widest row
        assert out.resident_kv_bytes_final == batch * width * entry
    else:  # per-layer allocations: at least what the rows hold, at most every layer at the widest row's total
        assert sum(cap + grown for cap in caps) * entry <= out.resident_kv_bytes_final
        assert out.resident_kv_bytes_final <= batch * LAYERS * width * entry
    if name == "think":
        assert all(layer.keys.shape[-1] == HEAD_DIM // 2 and layer.values.shape[-1] == HEAD_DIM for layer in layers)
