"""OmniKV: selection against a slow reference, layer roles, the Mem% formula, and decoding through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_layer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.base import DecodeContext
from kvbench.methods.omnikv import OmniKV


def _omni(budget, **fields):
    method = OmniKV(**fields)
    method.validate(Budget.parse(budget))
    return method


def test_mem_formula_matches_the_paper_table():
    # Llama-3-8B: L=32, filters {2, 8, 18}: f = 8/32, Mem 30 % -> r = 0.0667 (methods.md A3.2)
    method = _omni(0.3, filter_layers=[2, 8, 18])
    assert method.selected_tokens(100_000, 32) == math.floor((0.3 - 0.25) / 0.75 * 100_000)
    # Llama-3.1-70B: L=80, {4, 19, 41}: f = 10/80, Mem 20 % -> r = 0.0857
    assert _omni(0.2, filter_layers=[4, 19, 41]).selected_tokens(70_000, 80) == math.floor(0.075 / 0.875 * 70_000)
    assert _omni(128).selected_tokens(5000, 32) == 128
    assert _omni(0.3, mem_formula=False).selected_tokens(1000, 32) == 300
    with pytest.raises(ConfigError, match="below the dense fraction"):
        _omni(0.2, filter_layers=[2, 8, 18]).selected_tokens(1000, 32)
    # wait layers are dense: two after each filter layer give f = (2 + 3 * 3) / 32
    assert _omni(0.5, filter_layers=[2, 8, 18], wait_layers=2).selected_tokens(32_000, 32) == math.floor(
        (0.5 - 11 / 32) / (1 - 11 / 32) * 32_000)
    # no wait layers: f = (2 + 3) / 32; overlapping filters count each dense layer once ({0..4} of [2, 3])
    assert _omni(0.3, filter_layers=[2, 8, 18], wait_layers=0).selected_tokens(3200, 32) == math.floor(
        (0.3 - 5 / 32) / (1 - 5 / 32) * 3200)
    assert _omni(0.3, filter_layers=[2, 3]).selected_tokens(3200, 32) == math.floor((0.3 - 5 / 32) / (27 / 32) * 3200)


def test_layer_roles():
    method = _omni(128, filter_layers=[2, 8, 18])
    roles = [method._segment_filter(i, 32) for i in range(32)]
    assert roles[:4] == [None, None, None, None]  # 0-1 dense, 2 filter, 3 wait layer
    assert roles[4:8] == [2] * 4 and roles[8:10] == [None, None] and roles[10:18] == [8] * 8
    assert roles[18:20] == [None, None] and roles[20:] == [18] * 12
    assert _omni(128).filters(30) == [2, 8, 17]  # Llama-3-8B's filters scaled to 30 layers


def _rope(x, pos, inv_freq):
    """One vector ``(D,)`` rotated at ``pos`` (rotate-half layout), in float64 with Python loops."""
    half = x.shape[0] // 2
    out = torch.empty(x.shape[0], dtype=torch.float64)
    for i in range(half):
        angle = pos * float(inv_freq[i])
        a, b = float(x[i]), float(x[i + half])
        out[i], out[i + half] = a * math.cos(angle) - b * math.sin(angle), b * math.cos(angle) + a * math.sin(angle)
    return out


def _probs(q, keys_h, upto, scaling):
    return torch.softmax(torch.tensor([float(q @ keys_h[x].double()) * scaling for x in range(upto)]), 0)


def _reference_selection(raw, keys, k, selector, step, window, inv_freq, scaling, reading):
    """Slow OmniKV selection at decode step ``step`` (0-based) for one row: loops over heads, rows and positions.

    raw: ``(Hq, n + steps, D)`` pre-RoPE queries; keys ``(Hkv, n, D)``. ``official_code``: every window query rotated
    at the current position, softmax and top-max(1, k - p) over the first n - p tokens, then the p window prompt
    tokens. ``paper``: window queries at their own positions, softmax over all n, the window's prompt tokens forced
    into the top-k.
    """
    hq = raw.shape[0]
    hkv, n, _ = keys.shape
    g = hq // hkv
    cur = n + step
    if selector in ("last", "softmax_before_last"):
        q = [_rope(raw[h, cur], cur, inv_freq) for h in range(hq)]
        if selector == "last":
            scores = [max(float(q[h] @ keys[h // g, j].double()) * scaling for h in range(hq)) for j in range(n)]
        else:
            probs = [_probs(q[h], keys[h // g], n, scaling) for h in range(hq)]
            scores = [max(float(p[j]) for p in probs) for j in range(n)]
        return sorted(sorted(range(n), key=lambda j: -scores[j])[:k])
    rows = list(range(max(0, cur - window + 1), cur + 1))
    w = len(rows)
    alpha = [1.0] * w if selector == "uniform" else [2.0 ** (u - (w - 1)) for u in range(w)]
    p = sum(r < n for r in rows)
    upto = n - p if reading == "official_code" else n
    scores = [0.0] * upto
    for u, r in enumerate(rows):
        at = cur if reading == "official_code" else r
        probs = [_probs(_rope(raw[h, r], at, inv_freq), keys[h // g], upto, scaling) for h in range(hq)]
        for j in range(upto):
            scores[j] += alpha[u] * max(float(pr[j]) for pr in probs)
    forced = list(range(n - p, n))
    if reading == "official_code":
        return sorted(sorted(range(upto), key=lambda j: -scores[j])[: min(upto, max(1, k - p))]) + forced
    rest = sorted((j for j in range(n) if j not in forced), key=lambda j: -scores[j])[: k - len(forced)]
    return sorted(forced + rest)


def _inv_freq(d):
    return 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


@pytest.mark.parametrize("reading", ["official_code", "paper"])
@pytest.mark.parametrize("selector", ["last", "softmax_before_last", "uniform", "exp"])
def test_filter_selection_matches_reference(selector, reading):
    """Several decode steps (the window's prompt rows run out), GQA, a softmax scale that is not 1/sqrt(d) (the
    module's own), k below the window's prompt rows in the last case."""
    from dataclasses import replace

    from helpers import prefill_ctx

    hq, hkv, d, w, steps, scaling = 4, 2, 8, 5, 6, 0.6
    inv_freq = _inv_freq(d)
    for seed, n, k in ((0, 40, 10), (1, 33, 7), (2, 30, 3)):
        if reading == "paper" and k < w - 1:  # more forced window tokens than k: the paper reading is undefined
            continue
        g = torch.Generator().manual_seed(seed)
        keys = torch.randn(1, hkv, n, d, generator=g)
        raw = torch.randn(hq, n + steps, d, generator=g)
        post = torch.stack([torch.stack([_rope(raw[h, i], i, inv_freq) for i in range(n + steps)])
                            for h in range(hq)]).float()[None]  # (1, Hq, n + steps, D) at their own positions
        layer = make_layer(keys, torch.randn(1, hkv, n, d, generator=g))
        method = _omni(k, filter_layers=[0], selector=selector, window=w, window_reading=reading)
        ctx = replace(prefill_ctx(post[:, :, :n], layer, k, layer_idx=0, num_layers=3), rope_inv_freq=inv_freq)
        method.prefill(layer, ctx)
        for step in range(steps):
            layer.update(torch.randn(1, hkv, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g))
            query = post[:, :, n + step : n + step + 1]
            dctx = DecodeContext(layer_idx=0, num_layers=3, num_kv_heads=hkv, query=query, probs=None,
                                 capacity=torch.tensor([k]), scaling=scaling, rope_inv_freq=inv_freq)
            assert method.select(layer, dctx) is None  # the filter layer itself attends densely
            ours = method._selection[0][0].tolist()
            ref = _reference_selection(raw, keys[0], k, selector, step, w, inv_freq, scaling, reading)
            assert ours == ref, (seed, step)
            # the next sparse layer (wait_layers=1: layer 1 dense, layer 2 sparse) attends to selection + generated
            assert method.select(layer, DecodeContext(1, 3, hkv, query, None, torch.tensor([k]))) is None
            index = method.select(layer, DecodeContext(2, 3, hkv, query, None, torch.tensor([k])))
            generated = list(range(n, n + step + 1))
            assert index.shape == (1, hkv, len(ours) + step + 1) and index[0, 0].tolist() == ours + generated


def test_official_window_softmax_excludes_the_window_prompt_tokens():
    """official_code: the window's prompt tokens take no softmax mass. Head 0 puts almost all its mass on prompt
    token 11 (inside the window) and, among tokens 0-9, on token 0; head 1 prefers 9, then 8. Over tokens 0-9
    (official) head 0's 0.94 on token 0 wins the max over heads; over the whole prompt (paper) token 11 flattens
    head 0 and head 1's favourites win."""
    from dataclasses import replace

    from helpers import prefill_ctx

    n, h, d, w, k = 12, 2, 4, 3, 4
    keys = torch.zeros(1, h, n, d)
    keys[0, 0, 0, 0], keys[0, 0, 11, 0] = 5.0, 40.0  # head 0: token 0 among 0-9, token 11 above all
    keys[0, 1, 9, 1], keys[0, 1, 8, 1] = 1.0, 0.8  # head 1: token 9, then 8
    queries = torch.zeros(1, h, n + 1, d)
    queries[0, 0, :, 0] = queries[0, 1, :, 1] = 1.0
    none = torch.zeros(d // 2)  # zero RoPE frequencies: rotating changes nothing
    picks = {}
    for reading in ("official_code", "paper"):
        layer = make_layer(keys, torch.zeros(1, h, n, d))
        method = _omni(k, filter_layers=[0], selector="uniform", window=w, window_reading=reading)
        method.prefill(layer, replace(prefill_ctx(queries[:, :, :n], layer, k, layer_idx=0, num_layers=3),
                                      rope_inv_freq=none))
        layer.update(torch.zeros(1, h, 1, d), torch.zeros(1, h, 1, d))
        method.select(layer, DecodeContext(0, 3, h, queries[:, :, n:], None, torch.tensor([k]), scaling=1.0,
                                           rope_inv_freq=none))
        picks[reading] = method._selection[0][0].tolist()
        assert picks[reading] == _reference_selection(queries[0], keys[0], k, "uniform", 0, w, none, 1.0, reading)
    assert picks == {"official_code": [0, 9, 10, 11], "paper": [8, 9, 10, 11]}


def test_official_window_needs_a_rotatable_rope():
    from helpers import prefill_ctx
    from kvbench.errors import NotAvailableError

    layer = make_layer(torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4))
    ctx = prefill_ctx(torch.randn(1, 2, 20, 4), layer, 5, layer_idx=0, num_layers=3)  # rope_inv_freq None
    with pytest.raises(NotAvailableError, match="window_reading=paper"):
        _omni(5, filter_layers=[0], selector="exp").prefill(layer, ctx)
    _omni(5, filter_layers=[0], selector="exp", window_reading="paper").prefill(layer, ctx)
    _omni(5, filter_layers=[0], selector="last").prefill(layer, ctx)  # the last query needs no rotation


def test_through_the_engine(toy_llama):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (120,), generator=g).tolist()
    full_b = Budget.parse(None)
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, full_b), full_b):
        full = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    everything = Budget.parse(500)  # k >= n: OmniKV attends to everything and equals FullKV
    with CompressionSession(toy_llama, build_method({"name": "omnikv", "filter_layers": [0]}, everything), everything):
        same = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    assert same.tokens == full.tokens
    b = Budget.parse(16)
    method = build_method({"name": "omnikv", "filter_layers": [0], "wait_layers": 0}, b)
    with CompressionSession(toy_llama, method, b) as session:
        sparse = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 120 * 2 * 16 * 2 * 4  # nothing evicted
    assert sparse.resident_kv_bytes_final == full.resident_kv_bytes_final
    # per step: layer 0 dense over 120 + t + 1 entries, layers 1-2 over 16 selected + t + 1 generated
    steps = sparse.decode_steps
    expected = sum((120 + t + 1) + 2 * (16 + t + 1) for t in range(steps)) / (3 * steps)
    assert session.stats.attended_tokens_mean == pytest.approx(expected)
    # the window selectors' official reading rotates with the model's RoPE frequencies (k = 16 >= p + 1 here)
    for selector in ("uniform", "exp"):
        method = build_method({"name": "omnikv", "filter_layers": [0], "wait_layers": 0, "selector": selector}, b)
        with CompressionSession(toy_llama, method, b) as session:
            out = greedy_generate(toy_llama, [prompt], 10, [255], 0)
        assert session.stats.attended_tokens_mean == pytest.approx(
            sum((120 + t + 1) + 2 * (16 + t + 1) for t in range(out.decode_steps)) / (3 * out.decode_steps))
        assert method.describe()["window_reading"] == "official_code"


def test_refuses_batches_and_bad_fields():
    with pytest.raises(ConfigError, match="selector='top'"):
        OmniKV(selector="top")
    with pytest.raises(ConfigError, match="filter_layers"):
        OmniKV(filter_layers=[])
    assert OmniKV.supports_batching is False


def test_context_bank_offload(toy_llama, caplog):
    """offload=always: sparse layers' prompt KV leaves the cache for the bank and comes back as packed loads of the
    selection; tokens and attended counts equal offload=off. offload=on on a CPU model is a logged no-op."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (120,), generator=g).tolist()
    b = Budget.parse(16)
    runs = {}
    for offload in ("off", "always", "on"):
        method = build_method({"name": "omnikv", "filter_layers": [0], "wait_layers": 0, "offload": offload}, b)
        with CompressionSession(toy_llama, method, b) as session:
            out = greedy_generate(toy_llama, [prompt], 10, [255], 0)
        runs[offload] = (out, session.stats, method)
    off, always, on = runs["off"], runs["always"], runs["on"]
    assert always[0].tokens == off[0].tokens == on[0].tokens
    assert always[1].attended_tokens_mean == pytest.approx(off[1].attended_tokens_mean)
    per_layer = 120 * 2 * 16 * 2 * 4
    assert off[1].resident_kv_bytes_after_prefill == 3 * per_layer
    assert always[1].resident_kv_bytes_after_prefill == per_layer  # only filter layer 0 keeps its prompt KV
    assert sorted(always[2]._bank) == [1, 2] and always[2]._bank[1][0].shape[2] == 120
    assert on[1].resident_kv_bytes_after_prefill == 3 * per_layer and not on[2]._bank
    assert "context bank is a no-op" in caplog.text
    with pytest.raises(ConfigError, match="offload='disk'.*off, on, always"):
        OmniKV(offload="disk")
