"""The scoring interface (``Method.prefill_scores``) and the methods built on it: the scorers K-norm, KeyDiff, TOVA
and Expected Attention, and the wrappers AdaKV (head-wise budgets) and ChunkKV (whole chunks). Their kvpress readings
are pinned by tests/test_parity_kvpress.py; these tests pin the paper readings and the interface."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import decode_step, kept_positions, make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.errors import ConfigError
from kvbench.methods import METHODS, build_method
from kvbench.methods.adakv import adakv_keep
from kvbench.methods.base import scorer_names
from kvbench.methods.chunkkv import chunk_keep
from kvbench.report.store import method_label

SCORERS = ["snapkv", "pyramidkv", "h2o", "knorm", "keydiff", "tova", "expected_attention", "rkv"]


def _inputs(b=1, hq=4, hkv=2, n=48, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g),
            torch.randn(b, hkv, n, d, generator=g))


def _ctx(q, layer, cap, **kw):
    d = q.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return replace(prefill_ctx(q, layer, cap, **kw), rope_inv_freq=inv_freq)


def _fields(name):
    return {"mode": "whole_prompt"} if name == "keydiff" else {"window": 8} if name in ("snapkv", "pyramidkv") else {}


def test_the_scorers_are_the_methods_with_prefill_scores():
    assert sorted(scorer_names()) == sorted(SCORERS)


@pytest.mark.parametrize("name", SCORERS)
def test_scores_have_the_layer_shape_and_padding_is_minus_inf(name):
    q, k, v = _inputs(b=2)
    valid = torch.ones(2, 48, dtype=torch.bool)
    valid[1, :5] = False
    layer = make_layer(k, v)
    layer.set_valid(valid[:, None].expand(2, 2, 48).clone())
    scores = METHODS.build(name, _fields(name)).prefill_scores(layer, _ctx(q, layer, 16, key_valid=valid))
    assert scores.shape == (2, 2, 48)
    assert bool((scores[1, :, :5] == float("-inf")).all()) and bool((scores[0] > float("-inf")).all())


@pytest.mark.parametrize("name", ["knorm", "keydiff", "expected_attention", "tova"])
def test_prefill_keeps_the_top_scores(name):
    q, k, v = _inputs()
    method = METHODS.build(name, {"mode": "whole_prompt"} if name == "keydiff" else {})
    layer = make_layer(k, v)
    scores = method.prefill_scores(layer, _ctx(q, layer, 12))
    method.prefill(layer, _ctx(q, layer, 12))
    assert kept_positions(layer) == [sorted(scores[0, h].topk(12).indices.tolist()) for h in range(2)]


def test_knorm_keeps_the_smallest_norms():
    _, k, v = _inputs()
    layer = make_layer(k, v)
    METHODS.build("knorm", {}).prefill(layer, _ctx(_inputs()[0], layer, 10))
    assert kept_positions(layer) == [sorted(k[0, h].norm(dim=-1).topk(10, largest=False).indices.tolist())
                                     for h in range(2)]


def test_keydiff_block_mode_scores_each_block_against_what_is_kept():
    q, k, v = _inputs(n=40)
    layer = make_layer(k, v)
    METHODS.build("keydiff", {"block_size": 8}).prefill(layer, _ctx(q, layer, 16))
    for h in range(2):  # the procedure, by hand
        kept = list(range(16))
        for start in range(16, 40, 8):
            cand = kept + list(range(start, min(start + 8, 40)))
            keys = k[0, h, cand]
            anchor = torch.nn.functional.normalize(keys, dim=-1).mean(0)
            cos = torch.nn.functional.cosine_similarity(keys, anchor[None], dim=-1)
            kept = [cand[i] for i in (-cos).topk(16).indices.tolist()]
        assert kept_positions(layer)[h] == sorted(kept)


def test_keydiff_blocks_score_as_kvpress_bit_for_bit_in_fewer_kernels():
    """``block_keep`` computes each key's directions once per prompt and gathers them per block; kvpress's form
    gathers the keys and scores each set with ``keydiff_scores`` (``F.normalize``, ``F.cosine_similarity``). The
    same operations on the same values: equal kept indices on random keys of several sizes (small-norm ones too),
    in 13 kernels per block instead of 21 (the loop is the paper's sequential procedure: one step per block)."""
    from test_host_sync import CountOps, is_kernel

    from kvbench.methods.keydiff import block_keep, keydiff_scores

    def kvpress_form(keys, keep, block):
        b, h, n, d = keys.shape
        kept = torch.arange(keep).expand(b, h, keep)
        for start in range(keep, n, block):
            cand = torch.cat([kept, torch.arange(start, min(start + block, n)).expand(b, h, -1)], dim=-1)
            scores = keydiff_scores(torch.gather(keys, 2, cand.unsqueeze(-1).expand(*cand.shape, d)))
            kept = torch.gather(cand, -1, scores.topk(keep, dim=-1).indices)
        return kept

    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        keys = torch.randn(2, 2, 300 + 7 * seed, (16, 64, 128)[seed % 3], generator=g) * (1 + seed)
        keys[..., :4, :] *= 1e-4
        assert torch.equal(block_keep(keys, 64, 32), kvpress_form(keys, 64, 32)), seed
    keys = torch.randn(1, 2, 64 + 3 * 32, 16)
    counts = []
    for form in (block_keep, kvpress_form):
        with CountOps(is_kernel) as mode:
            form(keys, 64, 32)
        counts.append(mode.count)
    assert counts == [6 + 3 * 13, 1 + 3 * 21], counts


def test_tova_paper_evicts_the_least_attended_entry_of_every_step_heads_averaged():
    q, k, v = _inputs(n=30, hq=4, hkv=2)
    method = METHODS.build("tova", {})
    layer = make_layer(k, v)
    ctx = _ctx(q, layer, 10)
    probs = torch.softmax(torch.einsum("hd,hnd->hn", q[0, :, -1], k[0].repeat_interleave(2, 0)) / 4, -1).mean(0)
    method.prefill(layer, ctx)
    expected = sorted(probs.topk(10).indices.tolist())
    assert kept_positions(layer) == [expected, expected]  # one set for every head, the last token not forced
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        query, key, value = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g), \
            torch.randn(1, 2, 1, 16, generator=g)
        before = kept_positions(layer)[0] + [30 + step]
        keys = layer.keys.clone()
        decode_step(method, layer, query, key, value, 10)
        all_keys = torch.cat([keys, key], dim=2)[0].repeat_interleave(2, 0)
        attn = torch.softmax((query[0, :, 0, None] @ all_keys.transpose(-1, -2))[:, 0] / 4, -1).mean(0)
        gone = before[int(attn.argmin())]
        assert kept_positions(layer) == [sorted(set(before) - {gone})] * 2


def test_tova_kvpress_reading_keeps_the_last_token_and_does_not_evict_while_decoding():
    q, k, v = _inputs(n=30)
    method = METHODS.build("tova", {"variant": "kvpress_prefill"})
    assert not method.needs_decode_probs
    layer = make_layer(k, v)
    method.prefill(layer, _ctx(q, layer, 10))
    assert all(29 in heads for heads in kept_positions(layer))


def test_expected_attention_recovers_the_pre_rope_queries_exactly():
    """Rotating the queries at other positions changes the post-RoPE queries the engine hands over, not the scores:
    the method un-rotates them at their own positions."""
    from kvbench.engine.rope import rotate_keys

    q, k, v = _inputs()
    method = METHODS.build("expected_attention", {})
    layer = make_layer(k, v)
    ctx = _ctx(q, layer, 16)
    pos = torch.arange(48).float().expand(1, 4, 48)
    post = rotate_keys(q, pos, ctx.rope_inv_freq)
    direct = method.prefill_scores(layer, replace(ctx, queries=post))
    shifted = layer.positions.clone()
    layer.positions += 7  # the same prompt placed 7 positions later: queries rotated 7 further
    moved = method.prefill_scores(layer, replace(ctx, queries=rotate_keys(post, pos * 0 + 7, ctx.rope_inv_freq)))
    layer.positions = shifted
    assert bool(torch.isinf(direct[..., :4]).all())
    assert not torch.allclose(direct[..., 4:], method.prefill_scores(layer, ctx)[..., 4:])  # RoPE matters
    # the averaged future rotation starts at the prompt length in both: identical up to rounding
    torch.testing.assert_close(moved, direct, rtol=1e-4, atol=1e-6)


def test_expected_attention_refuses_a_model_without_rope_frequencies():
    from kvbench.errors import NotAvailableError

    q, k, v = _inputs()
    layer = make_layer(k, v)
    with pytest.raises(NotAvailableError, match="RoPE"):
        METHODS.build("expected_attention", {}).prefill(layer, replace(_ctx(q, layer, 16), rope_inv_freq=None))


# ---- AdaKV ----------------------------------------------------------------------------------------------------------
def test_adakv_takes_the_layer_top_scores_across_heads_with_the_safeguard():
    scores = torch.tensor([[0.0] * 10, [float(10 + i) for i in range(10)]])  # head 0 loses every comparison
    assert adakv_keep(scores, 5, 0.0).sum(-1).tolist() == [0, 10]
    kept = adakv_keep(scores, 5, 0.2)  # n_safe = 1: head 0 keeps one, head 1 the other 9
    assert kept.sum(-1).tolist() == [1, 9] and kept[1, 1:].all()
    assert adakv_keep(scores, 5, 0.4).sum(-1).tolist() == [2, 8]


def _adakv_uneven(layout: str):
    """AdaKV on one layer whose head 0 loses every comparison: it keeps its safeguard (2), head 1 the rest (18)."""
    _, k, v = _inputs(hkv=2, n=40)
    k[0, 0] *= 10  # head 0's keys all have large norms: knorm scores them all below head 1's
    method = build_method({"name": "adakv", "scorer": "knorm", "layout": layout}, Budget.parse(10))
    layer = make_layer(k, v)
    method.prefill(layer, _ctx(_inputs(n=40)[0], layer, 10))
    return method, layer, k, v


def test_adakv_padded_holds_the_longest_head_and_records_it():
    method, layer, _, _ = _adakv_uneven("padded")
    counts = layer.valid_counts()[0].tolist()
    assert counts == [2, 18] and layer.num_entries == 18  # 2 x 10 entries; head 0 keeps its safeguard
    assert layer.resident_bytes() == 2 * 18 * 16 * 2 * 4  # the padding of head 0 is allocated and counted
    assert method.sample_stats(0) == {"adakv_kept_entries": [20], "adakv_allocated_entries": [36]}


def test_adakv_ragged_holds_what_each_head_keeps_and_records_it():
    method, layer, k, v = _adakv_uneven("ragged")
    _, padded, _, _ = _adakv_uneven("padded")
    assert layer.valid_counts()[0].tolist() == [2, 18] and layer.num_entries == 18
    assert layer.resident_bytes() == 20 * 16 * 2 * 4  # 2 + 18 entries, nothing for head 0's difference
    assert method.sample_stats(0) == {"adakv_kept_entries": [20], "adakv_allocated_entries": [20]}
    keys, values, valid = layer.attention_view()  # the padded view holds the padded layout's valid entries, in order
    assert valid.shape == padded.valid.shape and torch.equal(valid.sum(-1), padded.valid.sum(-1))
    assert torch.equal(keys[valid], padded.keys[padded.valid])
    assert torch.equal(values[valid], padded.values[padded.valid])
    assert layer.ragged.positions.tolist() == padded.positions[padded.valid].tolist()


def test_adakv_kvpress_mask_frees_nothing():
    _, k, v = _inputs(n=40)
    method = build_method({"name": "adakv", "scorer": "knorm", "layout": "kvpress_mask"}, Budget.parse(10))
    layer = make_layer(k, v)
    method.prefill(layer, _ctx(_inputs(n=40)[0], layer, 10))
    assert layer.num_entries == 40 and int(layer.valid_counts().sum()) == 20
    assert method.expected_compression(Budget.parse(10), 40, 1) == "attention"


# ---- ChunkKV --------------------------------------------------------------------------------------------------------
def test_chunkkv_keeps_whole_chunks_by_summed_scores_and_the_must_keep_entries():
    scores = torch.zeros(2, 24)
    scores[:, 0:4] = 1.0  # chunk 0: sum 8 over both heads
    scores[0, 5] = 5.0  # chunk 1: one high score, sum 5
    scores[:, 20:] = float("inf")  # a window
    kept = chunk_keep(scores, 4 + 4, 4)  # (8 - 4) // 4 = one chunk
    assert kept.nonzero().flatten().tolist() == [0, 1, 2, 3, 20, 21, 22, 23]


def test_chunkkv_layer_reuse_keeps_the_first_layers_chunks():
    q, k, v = _inputs(n=60)
    method = build_method({"name": "chunkkv", "scorer": "knorm", "chunk_length": 5, "layer_reuse": 2},
                          Budget.parse(20))
    first = make_layer(k, v)
    method.prefill(first, _ctx(q, first, 20, layer_idx=0, num_layers=2))
    second = make_layer(torch.randn_like(k), v)
    method.prefill(second, _ctx(q, second, 20, layer_idx=1, num_layers=2))
    assert kept_positions(first) == kept_positions(second) and len(kept_positions(first)[0]) == 20


# ---- composition -------------------------------------------------------------------------------------------------
def test_the_composed_name_is_in_the_key_and_the_label():
    method = build_method({"name": "adakv", "scorer": "expected_attention"}, Budget.parse(128))
    described = method.describe()
    assert method.name == described["name"] == "adakv-expected_attention"
    assert described["scorer_fields"]["n_future_positions"] == 512
    assert method_label(described) == "adakv-expected_attention"
    assert build_method(described, Budget.parse(128)).describe() == described  # a stored key rebuilds
    other = build_method({"name": "chunkkv", "scorer": "snapkv", "scorer_fields": {"window": 8}}, Budget.parse(128))
    assert method_label(other.describe()).startswith("chunkkv-snapkv[scorer_fields=")


def test_a_nested_method_is_labelled_by_its_own_non_default_fields():
    """ThinK's key holds ``composed`` and its inner method's resolved fields: at the defaults the label is ``think``;
    otherwise the inner fields that differ, prefixed (``inner.kernel=7``), and the inner method's name if not SnapKV."""
    def label(fields):
        return method_label(build_method({"name": "think", **fields}, Budget.parse(128)).describe())

    assert label({}) == "think"
    assert label({"inner": {"name": "snapkv", "kernel": 7, "granularity": "query_head"}}) == (
        "think[inner.granularity=query_head,inner.kernel=7]")
    assert label({"inner": {"name": "h2o"}, "key_channel_compression_ratio": 0.4}) == (
        "think[inner.name=h2o,key_channel_compression_ratio=0.4]")


def test_hydra_composes_a_wrapper_over_a_scorer():
    from hydra import compose, initialize_config_dir

    from kvbench.jobs.plan import plan_job

    with initialize_config_dir(config_dir=str(__import__("pathlib").Path(__file__).parents[1] / "conf"),
                               version_base=None):
        cfg = compose(config_name="config", overrides=["method=adakv", "method.scorer=knorm", "budget=64"])
    job = plan_job(cfg)
    assert job.key["method"]["name"] == "adakv-knorm" and job.parts[2] == "adakv-knorm"


@pytest.mark.parametrize("scorer,fields", [("streamingllm", {}), ("keydiff", {}), ("adakv", {})])
def test_a_wrapper_refuses_a_method_without_scores(scorer, fields):
    with pytest.raises(ConfigError, match="no per-entry prefill scores"):
        build_method({"name": "chunkkv", "scorer": scorer, "scorer_fields": fields}, Budget.parse(128))


def test_a_wrapper_checks_the_scorers_budget_minimum():
    with pytest.raises(ConfigError, match="observation window"):
        build_method({"name": "adakv", "scorer": "snapkv"}, Budget.parse(16))
