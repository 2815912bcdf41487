"""ThinK in the engine: the pruned keys' attention is q.k over the kept channels, compositions with other token methods
keep their keys pruned through decode-time eviction, the composed name is in the result key, and the readings ThinK
cannot serve are refused with one line."""

from __future__ import annotations

import pytest
import torch

from helpers import make_layer, prefill_ctx, record_caches
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.attention import grouped_attention
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods import build_method


def _prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_attention_over_pruned_keys_is_qk_over_the_kept_channels():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g), \
        torch.randn(2, 2, 40, 16, generator=g)
    method = build_method({"name": "think", "key_channel_compression_ratio": 0.25}, Budget.parse(100))
    layer = make_layer(k.clone(), v.clone())
    ctx = prefill_ctx(q, layer, 100)
    method.prefill(layer, ctx)
    method.finish_prefill([layer], ctx)
    assert layer.keys.shape == (2, 2, 40, 12) and layer.values.shape == (2, 2, 40, 16)
    query = torch.randn(2, 8, 1, 16, generator=g)
    out, _ = grouped_attention(layer.gather_query(query), layer.keys, layer.values, None, 16**-0.5)
    for row in range(2):
        for head in range(8):
            kept = layer.key_channels[row, head // 4]
            logits = (query[row, head, 0, kept] @ k[row, head // 4][:, kept].T) * 16**-0.5
            expected = torch.softmax(logits, -1) @ v[row, head // 4]
            assert torch.allclose(out[row, 0, head], expected, atol=1e-5)
    layer.update(torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g))
    assert layer.keys.shape == (2, 2, 41, 12)  # a generated key is stored with the same channels


@pytest.mark.parametrize("inner", ["h2o", "pyramidkv", "streamingllm"])
def test_think_composes_with_token_methods(toy_llama, inner, monkeypatch):
    caches = record_caches(monkeypatch)
    budget = Budget.parse(48)
    method = build_method({"name": "think", "inner": {"name": inner}}, budget)
    with CompressionSession(toy_llama, method, budget) as session:
        out = greedy_generate(toy_llama, [_prompt(120)], 4, [], 0)
    grown = 0 if inner in ("h2o", "streamingllm") else out.decode_steps
    assert sum(session.stats.layer_entries_after_prefill) == 3 * 48
    assert out.resident_kv_bytes_final == 3 * 2 * (48 + grown) * (8 + 16) * 4  # keys 8 of 16 channels
    assert all(layer.keys.shape[-1] == 8 for layer in caches[-1].layers)


def test_the_composed_name_is_in_the_result_key():
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs.plan import plan_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        job = plan_job(compose(config_name="config", overrides=["method=think", "budget=128",
                                                                  "method.inner.name=pyramidkv"]))
    assert job.key["method"]["composed"] == "think+pyramidkv"
    assert job.key["method"]["inner"]["name"] == "pyramidkv" and job.key["method"]["inner"]["window"] == 8


@pytest.mark.parametrize(("fields", "message"), [
    ({"inner": {"name": "quest"}}, "computes its own decode attention"),
    ({"inner": {"name": "fullkv"}}, "composes with a token-eviction method"),
    # what the composition cannot forward, refused before any model loads (before: AdaKV's ragged layers failed in
    # the middle of the prefill, KVzip's scoring forwards never ran, TriAttention's decode compression never ran)
    ({"inner": {"name": "adakv"}}, r"layout=ragged .* use method.inner.layout=padded"),
    ({"inner": {"name": "kvzip", "layout": "padded"}}, "scores the prompt with forwards after prefill"),
    ({"inner": {"name": "triattention"}}, "compresses across layers after each decode forward"),
    ({"key_channel_compression_ratio": 1.0}, "must be in"),
    ({"storage": "zero"}, "storage='zero' is not valid"),
])
def test_readings_think_cannot_serve_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        build_method({"name": "think", **fields}, Budget.parse(64))


def test_a_full_budget_is_refused_while_it_prunes_channels():
    """The engine runs no method at a full budget: ThinK's channel pruning would be off too, and FullKV's numbers
    filed as ThinK's (a channel-only ThinK at a full budget is what kvpress's ThinKPress alone runs; not offered)."""
    with pytest.raises(ConfigError, match=r"^budget=full switches method 'think' off, its key-channel pruning "
                                          r"included \(key_channel_compression_ratio=0.5\): .* budget=128\)$"):
        build_method({"name": "think"}, Budget.full())
    build_method({"name": "think", "key_channel_compression_ratio": 0.0}, Budget.full())  # SnapKV at full: FullKV


def test_compact_positions_are_refused(toy_llama):
    budget = Budget.parse(48)
    method = build_method({"name": "think"}, budget)
    with pytest.raises(NotAvailableError, match="position_mode=compact"):
        with CompressionSession(toy_llama, method, budget, position_mode="compact"):
            greedy_generate(toy_llama, [_prompt(120)], 2, [], 0)

