"""Issue #27 item 3, real memory: heads that keep different numbers of entries (AdaKV, KVzip) hold what they keep.

``KVLayer.to_ragged`` stores a layer's kept entries flat per (row, head); attention reads a transient padded view.
Pinned here: the view holds exactly the padded layout's valid entries, resident bytes are the kept entries' (and grow by
one entry per (row, head) and decode step), and generation under ``layout=ragged`` (the default) equals
``layout=padded`` token for token (greedy, fp32) on tiny random models, batch and sliding windows included. The SmolLM2
check at budget 128 (resident bytes within 1.05x the budget's) is ``test_compression_verified``'s
``test_ragged_heads_hold_the_budget_and_decode_as_padded_ones_on_smollm2``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import ByteTokenizer, kept_positions, make_layer, tiny_family
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine import generate as generate_module
from kvbench.engine.attention import grouped_attention
from kvbench.engine.cache import KVCache, KVLayer
from kvbench.engine.static import StaticKVLayer
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods import build_method
from kvbench.methods.base import keep_entries

pytestmark = pytest.mark.compat


def _layer_pair(b=2, h=3, n=12, d=4, seed=0, padding=True):
    """The same layer twice, and a kept mask whose (row, head)s keep different numbers (row 1 left-padded by 2)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    layers = [make_layer(keys.clone(), values.clone()) for _ in range(2)]
    kept = torch.rand(b, h, n, generator=g) < 0.5
    kept[0, 0] = False
    kept[0, 0, 3] = True  # one head keeps one entry, the others about half
    if padding:
        valid = torch.ones(b, h, n, dtype=torch.bool)
        valid[1, :, :2] = False
        for layer in layers:
            layer.set_valid(valid.clone())
        kept = kept & valid
    return layers, kept


def test_ragged_holds_the_kept_entries_and_views_them_as_the_padded_layout():
    (ragged, padded), kept = _layer_pair()
    keep_entries(padded, kept)
    ragged.to_ragged(kept)
    entry = (4 + 4) * 4  # K and V, float32
    assert ragged.resident_bytes() == int(kept.sum()) * entry < padded.resident_bytes()
    assert torch.equal(ragged.valid_counts(), kept.sum(-1)) and torch.equal(padded.valid_counts(), kept.sum(-1))
    assert ragged.num_entries == padded.num_entries == int(kept.sum(-1).max())
    for row in range(2):
        assert kept_positions(ragged, row) == kept_positions(padded, row)
    keys, values, valid = ragged.attention_view()
    for row in range(2):  # per (row, head), the same entries in the same (position) order
        for h in range(3):
            assert torch.equal(keys[row, h][valid[row, h]], padded.keys[row, h][padded.valid[row, h]])
            assert torch.equal(values[row, h][valid[row, h]], padded.values[row, h][padded.valid[row, h]])
    # a decode step appends one entry per (row, head): resident bytes grow by exactly that
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g)
    for layer in (ragged, padded):
        layer.update(k, v)
    assert ragged.resident_bytes() == (int(kept.sum()) + 2 * 3) * entry
    q = torch.randn(2, 6, 1, 4, generator=g)
    keys, values, valid = ragged.attention_view()
    assert keys.shape[2] == padded.num_entries and torch.equal(keys[:, :, -1:], k)
    out, _ = grouped_attention(q, keys, values, valid.unsqueeze(2), 0.5)
    ref, _ = grouped_attention(q, padded.keys, padded.values, padded.valid.unsqueeze(2), 0.5)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_a_ragged_layer_with_equal_heads_has_no_mask_and_refuses_in_place_edits():
    (layer, _), _ = _layer_pair(padding=False)
    kept = torch.zeros(2, 3, 12, dtype=torch.bool)
    kept[..., 4:9] = True
    layer.to_ragged(kept)
    assert layer.attention_view()[2] is None and layer.num_entries == 5
    for edit in (lambda: layer.evict_one(torch.zeros(2, 3, dtype=torch.long)), lambda: layer.evict_at(0),
                 lambda: layer.gather(torch.zeros(2, 3, 1, dtype=torch.long)), lambda: layer.repeat_heads(2),
                 lambda: layer.batch_select_indices(torch.tensor([0])), lambda: layer.to_ragged(kept)):
        with pytest.raises(NotAvailableError, match="ragged"):
            edit()


def test_keep_after_on_a_ragged_layer_keeps_the_window_as_the_padded_layout():
    (ragged, padded), kept = _layer_pair(seed=3)
    keep_entries(padded, kept)
    ragged.to_ragged(kept)
    for layer in (ragged, padded):
        layer.update(torch.ones(2, 3, 2, 4), torch.ones(2, 3, 2, 4))
        layer.keep_after(torch.tensor([7, 9]).view(2, 1, 1))
    assert ragged.ragged is not None
    for row in range(2):
        assert kept_positions(ragged, row) == kept_positions(padded, row)
    assert ragged.resident_bytes() == int(ragged.valid_counts().sum()) * (4 + 4) * 4


def _run(model, name, layout, prompts, budget, new=24, fields=None, **kwargs):
    b = Budget.parse(budget)
    method = build_method({"name": name, "layout": layout, **(fields or {})}, b)
    caches = []

    class Recording(KVCache):
        def __init__(self):
            super().__init__()
            caches.append(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(generate_module, "KVCache", Recording)
    try:
        with CompressionSession(model, method, b, tokenizer=ByteTokenizer(), **kwargs) as session:
            out = greedy_generate(model, prompts, new, [], 0)
    finally:
        mp.undo()
    return out, session, method, caches[-1]


def _prompt(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name,rows", [("adakv", 1), ("adakv", 2), ("kvzip", 1)])
def test_ragged_decodes_as_padded_and_holds_only_the_kept_entries(toy_llama, name, rows):
    prompts = [_prompt(200, 1), _prompt(150, 2)][:rows]
    # AdaKV with kvpress's allocation: exactly H x C per layer (the authors' rounds each head's budget)
    fields = {"allocation": "kvpress"} if name == "adakv" else {}
    ragged, ragged_session, method, cache = _run(toy_llama, name, "ragged", prompts, 48, fields=fields)
    padded, padded_session, _, padded_cache = _run(toy_llama, name, "padded", prompts, 48, fields=fields)
    assert ragged.tokens == padded.tokens
    assert ragged_session.stats.attended_tokens_mean == pytest.approx(padded_session.stats.attended_tokens_mean)
    assert ragged_session.stats.layer_entries_after_prefill == padded_session.stats.layer_entries_after_prefill
    entry = 2 * (16 + 16) * 4  # 2 KV heads, K and V of 16 dims, float32
    layers = toy_llama.config.num_hidden_layers
    kept = sum(48 * len(prompts) for _ in range(layers))  # H x C per layer and row (AdaKV), L x C over layers (KVzip)
    steps = ragged.decode_steps * len(prompts) * layers  # one token per row and layer at every step
    assert ragged_session.stats.resident_kv_bytes_after_prefill == kept * entry
    assert ragged.resident_kv_bytes_final == (kept + steps) * entry == cache.resident_bytes()
    assert sum(int(layer.valid_counts().sum()) for layer in cache.layers) * 16 * 2 * 4 == cache.resident_bytes()
    assert padded.resident_kv_bytes_final > ragged.resident_kv_bytes_final  # the padding the ragged layout saves
    if name == "adakv":  # the recorded allocation is the kept entries
        stats = method.sample_stats(0)
        assert stats["adakv_allocated_entries"] == stats["adakv_kept_entries"] == [2 * 48] * layers


def test_ragged_heads_inside_sliding_windows_decode_as_padded_ones(monkeypatch):
    """Mistral slides everywhere (sliding_layers=auto -> compress): the window's reach (64) evicts from ragged layers,
    heads losing different numbers; 12 steps after a 300-token prompt, part of the kept prompt is still in reach."""
    model = tiny_family("mistral")
    flattened = []
    densify = KVLayer._densify
    monkeypatch.setattr(KVLayer, "_densify", lambda self: flattened.append(1) or densify(self))
    ragged, session, _, cache = _run(model, "adakv", "ragged", [_prompt(300, 1)], 40, new=12)
    padded, _, _, _ = _run(model, "adakv", "padded", [_prompt(300, 1)], 40, new=12)
    assert ragged.tokens == padded.tokens and flattened  # entries left the ragged layers
    assert all(layer.ragged is not None for layer in cache.layers)
    latest = 300 + ragged.decode_steps - 1
    assert all(min(min(head) for head in kept_positions(layer)) >= latest - 62 for layer in cache.layers)
    assert any(layer.ragged.positions.min() < 300 for layer in cache.layers)
    assert cache.resident_bytes() == sum(int(layer.valid_counts().sum()) for layer in cache.layers) * 16 * 2 * 4
    assert ragged.resident_kv_bytes_final < padded.resident_kv_bytes_final


@pytest.mark.parametrize(("name", "fields"), [("adakv", {}), ("adakv", {"allocation": "kvpress"}), ("kvzip", {})])
def test_the_captured_decode_runs_a_ragged_cache_as_padded_slots(toy_llama, name, fields):
    """engine.compile holds fixed (B, H, slots, D) layers: a ragged layer becomes its padded view there (the empty
    slots of shorter heads invalid), decodes the same tokens, and reports the bytes its heads hold, as the ragged
    layer does. KVzip's layers become static after its scoring forwards (before, it had no captured step)."""
    b = Budget.parse(48)
    runs = {}
    for compile in (False, "eager"):
        with CompressionSession(toy_llama, build_method({"name": name, **fields}, b), b, compile=compile,
                                tokenizer=ByteTokenizer()) as s:
            runs[compile] = greedy_generate(toy_llama, [_prompt(200, 1)], 20, [], 0)
            if compile:
                assert all(isinstance(layer, StaticKVLayer) and layer.ragged is None for layer in s._layers.values())
    assert runs["eager"].tokens == runs[False].tokens
    assert runs["eager"].resident_kv_bytes_final == runs[False].resident_kv_bytes_final


@pytest.mark.parametrize("name", ["adakv", "kvzip"])
def test_compact_positions_are_refused_for_a_ragged_cache(toy_llama, name):
    b = Budget.parse(48)
    with pytest.raises(ConfigError, match="ragged cache .*position_mode=compact"):
        with CompressionSession(toy_llama, build_method({"name": name}, b), b, position_mode="compact",
                                tokenizer=ByteTokenizer()):
            pass


@pytest.mark.parametrize("history", ["keep", "rollback"])
def test_questions_after_a_ragged_compression_answer_as_after_a_padded_one(toy_llama, history):
    """question=after_compression / turns: continued multi-token forwards over a ragged cache (causal among the new
    tokens, appended to the tail), and turn_history=rollback restoring the compressed context's ragged layers."""
    from kvbench.engine.generate import staged_generate

    runs = {}
    for layout in ("ragged", "padded"):
        b = Budget.parse(48)
        method = build_method({"name": "adakv", "layout": layout, "allocation": "kvpress"}, b)  # exactly H x C
        with CompressionSession(toy_llama, method, b):
            runs[layout] = staged_generate(toy_llama, _prompt(200, 1), [_prompt(7, 2), _prompt(5, 3)], [6, 6], [],
                                           history=history)
    ragged, padded = runs["ragged"], runs["padded"]
    assert [t.tokens for t in ragged.turns] == [t.tokens for t in padded.turns]
    assert ragged.layer_entries_after_compression == padded.layer_entries_after_compression == [48] * 3
    entry = 2 * (16 + 16) * 4
    assert ragged.resident_kv_bytes_after_compression == 3 * 48 * entry
    first = ragged.turns[0]
    assert first.resident_kv_bytes_after_question == 3 * (48 + 7) * entry
    assert [t.layer_entries_final for t in ragged.turns] == [t.layer_entries_final for t in padded.turns]


def test_entries_out_of_position_order_are_stored_in_position_order():
    """A layer whose entries are not in position order (a method that reordered them) is flattened sorted, as the
    padded layout's gather sorts its kept entries."""
    (ragged, padded), kept = _layer_pair(seed=4, padding=False)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    for layer in (ragged, padded):
        layer.positions = order.expand(2, 3, 12).clone()
    keep_entries(padded, kept)
    ragged.to_ragged(kept)
    for row in range(2):
        for h in range(3):
            positions = ragged.position_view()[0][row, h]
            assert positions[positions >= 0].tolist() == kept_positions(padded, row)[h]
    keys, _, valid = ragged.attention_view()
    assert torch.equal(keys[valid], padded.keys[padded.valid])
