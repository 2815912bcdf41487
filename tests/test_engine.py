"""The engine: real eviction, resident bytes, equality with plain generate, padding, backends, positions."""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import Budget
from kvbench.engine import CompressionSession, KVCache, cache_kwargs, greedy_generate
from kvbench.engine.rope import rotate_keys
from kvbench.methods import build_method

pytestmark = pytest.mark.compat  # also run on the lowest supported transformers and torch (.ci/run)

NEVER_EOS = [255]


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def _run(model, method, budget, prompts, new=12, **kw):
    b = Budget.parse(budget)
    with CompressionSession(model, build_method({"name": method}, b), b, **kw) as session:
        out = greedy_generate(model, prompts, new, NEVER_EOS, 0)
    return out, session.stats


def test_fullkv_equals_plain_generate(toy_llama):
    prompt = _prompt(120, 0)
    ref = toy_llama.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 120:].tolist()
    out, stats = _run(toy_llama, "fullkv", None, [prompt])
    assert out.tokens[0] == ref
    assert stats.layer_entries_after_prefill == [120, 120, 120]
    assert out.resident_kv_bytes_final == 3 * 2 * 131 * 16 * 2 * 4  # 120 prompt + 11 generated tokens cached


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streamingllm"])
def test_compressed_cache_inside_model_generate_equals_engine_loop(toy_llama, method):
    prompt = _prompt(150, 1)
    b = Budget.parse(48)
    m = build_method({"name": method}, b)
    with CompressionSession(toy_llama, m, b):
        hf = toy_llama.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 150:].tolist()
    with CompressionSession(toy_llama, m, b):
        hf_kvcache = toy_llama.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                        **cache_kwargs(toy_llama, KVCache()))[0, 150:].tolist()
    out, _ = _run(toy_llama, method, 48, [prompt], new=10)
    assert out.tokens[0] == hf == hf_kvcache


@pytest.mark.parametrize("method, budget", [("snapkv", 48), ("pyramidkv", 48), ("streamingllm", 48), ("h2o", 48),
                                            ("h2o", 0.3)])
def test_resident_bytes_equal_budget_bytes(toy_llama, method, budget):
    out, stats = _run(toy_llama, method, budget, [_prompt(160, 2)])
    per_token = 2 * 16 * 2 * 4  # kv heads x head_dim x (K and V) x fp32
    expected_tokens = Budget.parse(budget).tokens_for(160)
    assert stats.resident_kv_bytes_after_prefill == 3 * expected_tokens * per_token
    if method in ("h2o", "streamingllm"):  # evict at every step: the cache stays at the budget
        assert out.resident_kv_bytes_final == 3 * expected_tokens * per_token
    if method == "pyramidkv":
        assert stats.layer_entries_after_prefill[0] > stats.layer_entries_after_prefill[-1]


@pytest.mark.parametrize("method", ["fullkv", "snapkv", "h2o", "streamingllm", "pyramidkv"])
def test_left_padded_batch_equals_single_rows(toy_llama, method):
    prompts = [_prompt(140, 3), _prompt(90, 4)]
    batched, _ = _run(toy_llama, method, 40, prompts, new=8)
    for row, prompt in enumerate(prompts):
        single, _ = _run(toy_llama, method, 40, [prompt], new=8)
        assert batched.tokens[row] == single.tokens[0], (method, row)


def test_eager_backend_with_per_layer_lengths(toy_llama):
    """PyramidKV gives every layer a different length; eager must still decode (reference/environment.md pitfall 2)."""
    prompt = _prompt(200, 5)
    sdpa, _ = _run(toy_llama, "pyramidkv", 48, [prompt])
    toy_llama.set_attn_implementation("eager")
    try:
        eager, stats = _run(toy_llama, "pyramidkv", 48, [prompt])
    finally:
        toy_llama.set_attn_implementation("sdpa")
    assert len(set(stats.layer_entries_after_prefill)) == 3
    assert eager.tokens == sdpa.tokens
    assert toy_llama.config._attn_implementation == "sdpa"  # the session restored the model


def test_rotation_composes():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 5, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    a = torch.full((1, 2, 5), 3.0)
    b = torch.full((1, 2, 5), -7.0)
    twice = rotate_keys(rotate_keys(keys, a, inv_freq), b, inv_freq)
    assert torch.allclose(twice, rotate_keys(keys, a + b, inv_freq), atol=1e-5)
    assert torch.allclose(rotate_keys(keys, torch.zeros(1, 2, 5), inv_freq), keys)


def test_compact_positions_are_a_noop_without_eviction_and_differ_with_it(toy_llama):
    prompt = _prompt(60, 6)
    original, _ = _run(toy_llama, "fullkv", None, [prompt])
    compact, _ = _run(toy_llama, "fullkv", None, [prompt], position_mode="compact")
    assert compact.tokens == original.tokens
    b = Budget.parse(24)
    m = build_method({"name": "streamingllm"}, b)
    with CompressionSession(toy_llama, m, b, position_mode="compact") as s:
        cache = KVCache()
        toy_llama(torch.tensor([_prompt(100, 7)]), **cache_kwargs(toy_llama, cache), use_cache=True)
    layer = cache.layers[0]
    # kept entries are re-rotated so they sit contiguously just before the next query position (100)
    assert layer.rope_pos[0, 0].tolist() == list(range(76, 100))
    assert layer.positions[0, 0].tolist() == list(range(4)) + list(range(80, 100))
    assert s.stats.layer_entries_after_prefill == [24, 24, 24]


def test_session_without_cache_runs_full_attention(toy_llama):
    b = Budget.parse(40)
    ids = torch.tensor([_prompt(50, 8)])
    ref = toy_llama(ids, use_cache=False).logits
    with CompressionSession(toy_llama, build_method({"name": "snapkv"}, b), b):
        out = toy_llama(ids, use_cache=False).logits
    assert torch.allclose(out, ref)


def test_finish_prefill_sees_every_layer_and_stats_follow_it(toy_llama):
    """Cross-layer methods (D2O, DynamicKV) decide after the last layer; the reported sizes are the final ones."""
    from dataclasses import dataclass

    from kvbench.methods.base import Method, keep_top

    @dataclass
    class KeepLastFive(Method):
        seen_layers: int = 0

        def finish_prefill(self, layers, ctx):
            self.seen_layers = len(layers)
            for layer in layers:
                keep_top(layer, layer.positions.float(), torch.full_like(ctx.capacity, 5))

    method = KeepLastFive()
    b = Budget.parse(40)
    with CompressionSession(toy_llama, method, b) as session:
        out = greedy_generate(toy_llama, [_prompt(60, 9)], 4, NEVER_EOS, 0)
    assert method.seen_layers == 3
    assert session.stats.layer_entries_after_prefill == [5, 5, 5]
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 5 * 2 * 16 * 2 * 4
    assert out.resident_kv_bytes_final == 3 * 8 * 2 * 16 * 2 * 4  # + 3 generated tokens appended


def test_a_layer_in_a_methods_order_keeps_prefixes_and_sorts_back():
    """``gather(..., position_order=False)`` stores entries in the index's order (DynamicKV's score order);
    ``keep_first`` then keeps a prefix per (row, head), fresh copies, empty slots past a row's own count;
    ``sort_by_position`` stores valid entries in position order with the empty slots after them."""
    from helpers import make_layer

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 10, 4, generator=g), torch.randn(2, 2, 10, 4, generator=g)
    layer = make_layer(keys, values)
    order = torch.stack([torch.randperm(10, generator=g) for _ in range(4)]).view(2, 2, 10)
    layer.gather(order, position_order=False)
    assert not layer.position_ordered and torch.equal(layer.positions, order)
    assert torch.equal(layer.keys, torch.gather(keys, 2, order[..., None].expand(-1, -1, -1, 4)))
    before = layer.keys
    layer.keep_first(6, [6, 4])
    assert layer.keys.shape[2] == 6 and layer.keys.is_contiguous() and layer.keys.data_ptr() != before.data_ptr()
    assert torch.equal(layer.positions, order[..., :6])
    assert layer.valid_counts().tolist() == [[6, 6], [4, 4]]
    layer.sort_by_position()
    assert layer.position_ordered
    for row, count in ((0, 6), (1, 4)):
        for head in range(2):
            kept = sorted(order[row, head, :count].tolist())
            assert layer.positions[row, head, :count].tolist() == kept
            assert layer.valid[row, head].tolist() == [True] * count + [False] * (6 - count)
            assert torch.equal(layer.values[row, head, :count], values[row, head, kept])
    layer.keep_first(6)  # nothing to cut: the layer stays as it is
    assert layer.keys.shape[2] == 6


def test_a_prefill_reads_the_masks_it_left_unread_once_for_all_layers(toy_llama):
    """During a method's prefill ``set_valid`` stores a layer's new mask unread (``defer_valid_check``); after the
    last layer the session reads them all at once: a mask with no empty slot becomes None (the fast path), one with
    an empty slot stays. A keep_top that must take a -inf entry to fill its budget marks it empty."""
    from dataclasses import dataclass

    from kvbench.methods.base import Method, keep_top

    @dataclass
    class KeepAllButOddLayers(Method):
        name = "odd_layers_short"
        seen: tuple = ()

        def prefill(self, layer, ctx):
            self.seen += (layer.defer_valid_check,)
            scores = torch.zeros(layer.positions.shape, dtype=torch.float32)
            if ctx.layer_idx % 2:  # odd layers: only 20 entries may stay, the budget takes 40
                scores[..., 20:] = float("-inf")
            keep_top(layer, scores, ctx.capacity)
            assert layer.valid is not None and layer.valid_unchecked

    method = KeepAllButOddLayers()
    b = Budget.parse(40)
    with CompressionSession(toy_llama, method, b) as session:
        greedy_generate(toy_llama, [_prompt(60, 9)], 2, NEVER_EOS, 0)
        layers = [session._layers[i] for i in range(3)]
        assert method.seen == (True, True, True) and not any(layer.defer_valid_check for layer in layers)
        assert [layer.valid is None for layer in layers] == [True, False, True]
        assert not any(layer.valid_unchecked for layer in layers)
        assert layers[1].valid_counts().tolist() == [[21, 21]]  # 20 kept, then the second token appended


def test_the_session_refuses_a_layer_left_out_of_position_order(toy_llama):
    """Decode-time code relies on position order (``real_rank``): a method whose prefill leaves a layer in its own
    order stops the run in one line instead of decoding from it."""
    from dataclasses import dataclass

    from kvbench.methods.base import Method

    @dataclass
    class Reversed(Method):
        name = "reversed"

        def finish_prefill(self, layers, ctx):
            for layer in layers:
                n = layer.num_entries
                layer.gather(torch.arange(n - 1, -1, -1).expand(*layer.positions.shape[:2], n), position_order=False)

    b = Budget.parse(40)
    with pytest.raises(RuntimeError, match=r"'reversed' left attention layers \[0, 1, 2\] out of position order"):
        with CompressionSession(toy_llama, Reversed(), b):
            greedy_generate(toy_llama, [_prompt(60, 9)], 2, NEVER_EOS, 0)


@pytest.mark.parametrize("method, fields", [
    ("snapkv", {}), ("pyramidkv", {"schedule": "kvfactory_2409"}), ("h2o", {}), ("h2o", {"variant": "kvfactory_2410"}),
    ("streamingllm", {"variant": "kvfactory", "window": None}), ("cam", {"variant": "prefill_only", "window": 8}),
])
def test_query_head_granularity_caches_query_heads(toy_llama, method, fields):
    """granularity=query_head (KVCache-Factory's default): K/V repeated to the 4 query heads before selection, each
    keeps its own tokens; resident bytes count the stored heads (twice the 2 KV heads' bytes), decode appends
    repeated heads."""
    prompt = _prompt(160, 8)
    b = Budget.parse(40)
    runs = {}
    for granularity in ("kv_head", "query_head"):
        m = build_method({"name": method, **fields, "granularity": granularity}, b)
        with CompressionSession(toy_llama, m, b) as session:
            out = greedy_generate(toy_llama, [prompt], 6, NEVER_EOS, 0)
        runs[granularity] = (out, session.stats)
    (kv_out, kv_stats), (q_out, q_stats) = runs["kv_head"], runs["query_head"]
    assert q_stats.layer_entries_after_prefill == kv_stats.layer_entries_after_prefill
    assert q_stats.resident_kv_bytes_after_prefill == 2 * kv_stats.resident_kv_bytes_after_prefill
    assert q_out.resident_kv_bytes_final == 2 * kv_out.resident_kv_bytes_final
    assert len(q_out.tokens[0]) == 6
    if method == "streamingllm":  # no scores: the same tokens, so the same outputs
        assert q_out.tokens == kv_out.tokens
