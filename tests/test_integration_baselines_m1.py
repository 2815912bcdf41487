"""CaM, RoCo, Local window, LM-Infinite and SirLLM on the real SmolLM2-135M-Instruct: one needle_chat sample at
~1.5k tokens, budget 128 (marked slow). The cache must hold what each method claims."""

from __future__ import annotations

import pytest

from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.methods import build_method
from kvbench.models import load_model, spec_from_config
from kvbench.tasks import build_task
from kvbench.tasks.encoding import encode_sample

pytestmark = pytest.mark.slow
PER_ENTRY = 30 * 3 * 64 * 2 * 4  # layers x KV heads x head_dim x (K, V) x fp32 bytes


@pytest.fixture(scope="module")
def smol():
    return load_model(spec_from_config({"name": "smollm2-135m", "source": "embedded"}))


@pytest.fixture(scope="module")
def needle_prompt(smol):
    task = build_task({"name": "needle", "context_lengths": [1700], "depths": [50], "chat_template": True})
    sample = task.samples(smol.tokenizer)[0]
    return encode_sample(task, sample, smol.tokenizer, smol.spec)


# (method config, entries kept per layer and KV head after prefill, after decoding)
CASES = [
    ({"name": "local"}, 128, 128),
    ({"name": "lminfinite"}, 128, 128),  # n_global 10 + n_local 119 - 1 (each query also attends itself)
    ({"name": "roco", "stride": 16}, 128, 128),  # stride 16 keeps this test short; the unit tests use stride 1
    ({"name": "cam"}, 128, 128),
    ({"name": "cam", "variant": "prefill_only"}, 128, 128 + 5),  # prefill-only: generated tokens are appended
    ({"name": "sirllm"}, 128, 128),
]


@pytest.mark.parametrize("cfg, after_prefill, after_decode", CASES, ids=lambda c: str(c))
def test_needle_run_holds_the_claimed_cache(smol, needle_prompt, cfg, after_prefill, after_decode):
    assert 1400 < len(needle_prompt) < 1700
    budget = Budget.parse(128)
    with CompressionSession(smol.model, build_method(cfg, budget), budget) as session:
        out = greedy_generate(smol.model, [needle_prompt], 6, [], smol.tokenizer.pad_token_id)
    assert len(out.tokens[0]) == 6 and out.decode_steps == 5
    assert session.stats.layer_entries_after_prefill == [after_prefill] * 30
    assert session.stats.resident_kv_bytes_after_prefill == PER_ENTRY * after_prefill
    assert out.resident_kv_bytes_final == PER_ENTRY * after_decode
