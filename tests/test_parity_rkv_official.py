"""R-KV against its authors' code (Zefan-Cai/R-KV d15c976, ``R1KV.update_kv``).

tests/fixtures/parity/rkv_official.json was written by scripts/parity/rkv/generate.py, which runs ``r1_kv.py`` and
``rkv/utils.py`` unchanged (torch 2.13.0, numpy 2.2.2) on seeded post-RoPE queries/keys/values
(tests/parity_inputs.py); this test feeds kvbench's RKV the same tensors, layer by layer, as the engine does, and
needs neither the code nor its environment.

Compared exactly: the positions every KV head keeps (MHA, GQA, MQA; budgets 16 to 128; a cache of budget + 128
entries, the decode-time compression; the window and kernel, the README's lambda and ``retain_direction="first"``;
a cache of exactly the budget and one under it). Within the fixture's tolerance: the code's ``final_score`` of
layer 0, per head and position, against ``RKV.score``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity_inputs import digest, from_mask, layer_scale, stream

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.methods.rkv import RKV

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "rkv_official.json").read_text())
CASES = {c["name"]: c for c in FIXTURE["cases"]}
TOL = FIXTURE["tolerance"]


def _method(case) -> RKV:
    s = case["settings"]
    return RKV(window=s["window_size"], kernel=s["kernel_size"], mix_lambda=s["mix_lambda"],
               retain_direction=s["retain_direction"])


def _streams(case):
    n, hq, hkv, d, layers = (case[k] for k in ("n", "hq", "hkv", "d", "layers"))
    out = [stream(case["seed"], li, n, 0, hq, hkv, d, layer_scale(li, layers)) for li in range(layers)]
    assert digest(*[a for s in out for a in s]) == case["input_sha"], "the seeded inputs changed"
    return [tuple(torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous() for a in s) for s in out]


def _kept(method: RKV, case) -> list[list[list[int]]]:
    out = []
    for li, (q, k, v) in enumerate(_streams(case)):
        layer = make_layer(k.clone(), v.clone())
        method.prefill(layer, prefill_ctx(q, layer, case["budget"], layer_idx=li, num_layers=case["layers"]))
        out.append(kept_positions(layer))
    return out


def test_fixture_is_the_authors_code():
    assert FIXTURE["official"]["repo"] == "Zefan-Cai/R-KV"
    assert FIXTURE["official"]["commit"].startswith("d15c976")
    assert FIXTURE["environment"]["torch"].startswith("2.13.0")
    assert len(CASES) >= 10 and sum(c["hkv"] < c["hq"] for c in CASES.values()) >= 5
    assert any(c["n"] < c["budget"] for c in CASES.values()) and any(c["n"] == c["budget"] for c in CASES.values())
    assert RKV() == _method({"settings": {"window_size": 8, "kernel_size": 7, "mix_lambda": 0.07,
                                          "retain_direction": "last"}})  # the code's defaults are RKV's


@pytest.mark.parametrize("name", sorted(CASES))
def test_rkv_keeps_what_the_authors_code_keeps(name):
    case = CASES[name]
    ours = _kept(_method(case), case)
    for li, layer in enumerate(case["per_layer"]):
        official = [from_mask(mask) for mask in layer["kept"]]
        assert ours[li] == official, (name, li)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if "final_score" in c["per_layer"][0]))
def test_rkv_scores_equal_the_authors_final_score(name):
    case = CASES[name]
    method = _method(case)
    q, k, v = _streams(case)[0]
    layer = make_layer(k.clone(), v.clone())
    scores = method.score(layer, prefill_ctx(q, layer, case["budget"]))[0]
    w = method.window
    assert bool(torch.isinf(scores[:, -w:]).all())  # the window stays whatever its score
    torch.testing.assert_close(scores[:, :-w].double(),
                               torch.tensor(case["per_layer"][0]["final_score"], dtype=torch.float64),
                               rtol=TOL["scores_rtol"], atol=TOL["scores_atol"])


def test_the_fixture_tells_the_readings_apart():
    """A case fails when a field of R-KV's is read another way: the retain direction, lambda, the window; and the
    redundancy term changes what is kept (importance alone, SnapKV-like, keeps other positions)."""
    first = CASES["gqa_n110_b36_first"]
    official = [[from_mask(m) for m in layer["kept"]] for layer in first["per_layer"]]
    assert _kept(RKV(retain_direction="last"), first) != official
    readme = CASES["mha_n90_b30_lambda0.1"]
    official = [[from_mask(m) for m in layer["kept"]] for layer in readme["per_layer"]]
    assert _kept(RKV(), readme) != official
    for name in ("gqa_n256_b128_decode", "gqa_n256_b128_sim"):
        case = CASES[name]
        official = [[from_mask(m) for m in layer["kept"]] for layer in case["per_layer"]]
        assert _kept(RKV(mix_lambda=1.0), case) != official
        assert _kept(RKV(mix_lambda=0.0), case) != official


def test_batch_rows_are_selected_as_alone():
    """A left-padded batch of two fixture cases' layers keeps, per row, what each keeps alone (the code reads row 0's
    keys for every row's redundancy, ``key_states[0]``; kvbench scores each row on its own keys: the code at its
    scripts' batch of 1)."""
    case = CASES["gqa_n100_b32"]
    method = _method(case)
    q, k, v = _streams(case)[0]
    alone = _kept(method, case)[0]
    short = 70
    pad = q.shape[2] - short
    junk = torch.Generator().manual_seed(0)  # padding holds whatever the model computed there: never read

    def padded(t):
        return torch.cat([t, torch.cat([torch.randn(t[:, :, :pad].shape, generator=junk), t[:, :, :short]], 2)])

    qb, kb, vb = padded(q), padded(k), padded(v)
    valid = torch.ones(2, q.shape[2], dtype=torch.bool)
    valid[1, :pad] = False
    layer = make_layer(kb.clone(), vb.clone())
    method.prefill(layer, prefill_ctx(qb, layer, case["budget"], key_valid=valid))
    assert kept_positions(layer, 0) == alone
    short_layer = make_layer(k[:, :, :short].clone(), v[:, :, :short].clone())
    method.prefill(short_layer, prefill_ctx(q[:, :, :short], short_layer, case["budget"]))
    assert kept_positions(layer, 1) == [[p + pad for p in head] for head in kept_positions(short_layer)]


def test_redundancy_in_row_blocks_equals_one_block(monkeypatch):
    """A long cache's similarity is summed in blocks of rows (never ``n x n`` at once): the same kept sets and scores
    as one block."""
    import kvbench.methods.rkv as rkv_module

    case = CASES["gqa_n256_b128_sim"]
    whole = _kept(_method(case), case)
    q, k, v = _streams(case)[0]
    layer = make_layer(k.clone(), v.clone())
    one = _method(case).score(layer, prefill_ctx(q, layer, case["budget"]))
    monkeypatch.setattr(rkv_module, "BLOCK_ELEMENTS", 2 * 256 * 7)  # blocks of 7 rows
    assert _kept(_method(case), case) == whole
    torch.testing.assert_close(_method(case).score(layer, prefill_ctx(q, layer, case["budget"])), one)


@pytest.mark.parametrize("name", ["gqa_n256_b128_decode", "mha_n200_b64", "gqa_n120_b40_w16_k5"])
def test_a_buffer_of_the_last_queries_scores_as_the_code(name):
    """The call shape of a decode-time compression (the code's ``query_cache``: only the last ``window`` queries,
    over the whole cache): ``RKV.score`` given those queries alone gives the code's ``final_score``, which the
    generator computed from exactly them."""
    case = CASES[name]
    method = _method(case)
    q, k, v = _streams(case)[0]
    w, n = method.window, case["n"]
    layer = make_layer(k.clone(), v.clone())
    ctx = prefill_ctx(q[:, :, n - w :], layer, case["budget"])
    assert ctx.n == w < layer.keys.shape[2]
    scores = method.score(layer, ctx)[0]
    torch.testing.assert_close(scores[:, :-w].double(),
                               torch.tensor(case["per_layer"][0]["final_score"], dtype=torch.float64),
                               rtol=TOL["scores_rtol"], atol=TOL["scores_atol"])


DECODE = {c["name"]: c for c in FIXTURE["decode_cases"]}


def _decode(method: RKV, case) -> list[list[list[list[int]]]]:
    """The code's schedule through kvbench's RKV, layer by layer: the prompt through ``prefill``, then one token per
    step appended and, at every position that is a multiple of ``divide_length``, ``score`` over the whole cache with
    the last ``window`` queries and ``keep_top`` to the budget with the window (what a decode-time compression of a
    scorer does); the kept positions per KV head after every compression that ranked (the prompt's when it held more
    than the budget)."""
    from kvbench.methods.cache_ops import keep_top

    n, steps, budget, w = case["n"], case["steps"], case["budget"], method.window
    out = []
    for li in range(case["layers"]):
        q, k, v = (torch.from_numpy(a).permute(1, 0, 2).unsqueeze(0).contiguous()
                   for a in stream(case["seed"], li, n, steps, case["hq"], case["hkv"], case["d"],
                                   layer_scale(li, case["layers"])))
        layer = make_layer(k[:, :, :n].clone(), v[:, :, :n].clone())
        sets = []
        method.prefill(layer, prefill_ctx(q[:, :, :n], layer, budget, layer_idx=li, num_layers=case["layers"]))
        if n > budget:
            sets.append(kept_positions(layer))
        for t in range(n, n + steps):
            layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            if t % case["divide_length"] == 0 and layer.num_entries >= budget:
                ctx = prefill_ctx(q[:, :, t - w + 1 : t + 1], layer, budget, layer_idx=li, num_layers=case["layers"])
                keep_top(layer, method.score(layer, ctx), ctx.capacity, window=w)
                sets.append(kept_positions(layer))
        out.append(sets)
    return out


@pytest.mark.parametrize("name", sorted(DECODE))
def test_rkv_decode_schedule_keeps_what_the_authors_code_keeps(name):
    """Every compression of the code's decode schedule (every 128 tokens, the whole cache back to the budget, scored
    by the query cache), in the code's cache order (``cache_order="code"``, the default): the kept positions of every
    KV head equal the code's at every compression; in position order they differ from the second on."""
    case = DECODE[name]
    official = [[[from_mask(m) for m in step] for step in layer["kept"]] for layer in case["per_layer"]]
    assert all(len(layer) >= 3 for layer in official)
    assert _decode(RKV(), case) == official
    by_position = _decode(RKV(cache_order="position"), case)
    for ours, theirs in zip(by_position, official):  # the first compression sees position order in both
        assert ours[0] == theirs[0] and all(a != b for a, b in zip(ours[1:], theirs[1:]))
