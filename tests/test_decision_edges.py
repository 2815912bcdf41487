"""Boundary tests of the decision lines in ``kvbench/methods`` and ``kvbench/engine`` (issue #39 item 5): equalities,
rows of one batch that keep different numbers of entries, and the first and last entry of a window. Each test pins a
line that a one-line mutation (``scripts/mutants.py``) would otherwise change unnoticed; tensor-level, no model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import decode_step, kept_positions, make_layer, prefill_ctx
from kvbench.engine.cache import KVLayer
from kvbench.methods.base import keep_top


def _layer(b: int, h: int, n: int, d: int = 4, seed: int = 0) -> KVLayer:
    g = torch.Generator().manual_seed(seed)
    return make_layer(torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g))


def _row_alone(layer: KVLayer, row: int) -> KVLayer:
    """Row ``row`` of ``layer`` as a batch of one (its valid entries only, in stored order: as it would be alone)."""
    alone = KVLayer()
    valid = layer.valid[row] if layer.valid is not None else torch.ones(layer.positions.shape[1:], dtype=torch.bool)
    assert bool((valid.sum(-1) == valid.sum(-1)[0]).all()), "every head of the row holds as many entries"
    keep = valid[0]
    alone.update(layer.keys[row : row + 1, :, keep], layer.values[row : row + 1, :, keep])
    alone.positions = layer.positions[row : row + 1, :, keep].clone()
    return alone


def _held(layer: KVLayer, row: int) -> list[list[int]]:
    return kept_positions(layer, row)


# ---- keep_top: rows of a batch keeping different numbers of entries ------------------------------------------------
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("windows", [0, [0, 2, 0, 3]])
def test_keep_top_rows_keeping_different_numbers_select_as_each_row_alone(padded, windows):
    """Rows keep 12 (all: fits), 11 (one eviction), 7 and 5 entries of 12, on integer scores with many ties: each
    row's kept set (and the tied entry that stays) is exactly what ``keep_top`` keeps of the row alone."""
    b, h, n = 4, 3, 12
    layer = _layer(b, h, n, seed=1)
    scores = torch.randint(0, 4, (b, h, n), generator=torch.Generator().manual_seed(2)).float()
    if padded:  # row 3 left-padded by two entries (the engine's padded prompt), -inf as the engine gives them
        valid = torch.ones(b, h, n, dtype=torch.bool)
        valid[3, :, :2] = False
        layer.set_valid(valid)
        scores[3, :, :2] = float("-inf")
    keep = [12, 11, 7, 5]
    rows = [_row_alone(layer, r) for r in range(b)]
    wins = [windows] * b if isinstance(windows, int) else windows
    for r, alone in enumerate(rows):
        own = scores[r : r + 1, :, 2:] if padded and r == 3 else scores[r : r + 1]
        keep_top(alone, own, [keep[r]], window=[wins[r]])
    keep_top(layer, scores, torch.tensor(keep), window=windows)
    for r, alone in enumerate(rows):
        assert _held(layer, r) == _held(alone, r * 0), r
        held = layer.valid[r].sum(-1).tolist() if layer.valid is not None else [layer.num_entries] * h
        assert held == [min(keep[r], n - (2 if padded and r == 3 else 0))] * h, r


def test_keep_top_single_eviction_row_breaks_ties_as_argmin():
    """A row losing exactly one entry among others losing more: the first of its tied lowest entries leaves, as
    ``keep_top``'s one-eviction step (argmin) evicts it when the row is alone; a topk would drop another."""
    b, h, n = 2, 1, 8
    layer = _layer(b, h, n, seed=3)
    scores = torch.tensor([[[5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0]],
                           [[5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0]]])
    keep_top(layer, scores, [7, 3])
    assert _held(layer, 0) == [[0, 2, 3, 4, 5, 6, 7]]
    alone = _layer(1, h, n, seed=3)
    keep_top(alone, scores[:1], [7])
    assert _held(alone, 0) == _held(layer, 0)


def test_keep_top_rows_keeping_as_many_with_their_own_windows():
    """Rows keep 5 of 10 each but protect different windows (0 and 3 newest): each row as it is alone, the second
    keeping its three newest entries although they score lowest."""
    layer = _layer(2, 1, 10, seed=5)
    scores = torch.tensor([[[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 0.0, 1.0, 2.0]]]).repeat(2, 1, 1)
    keep_top(layer, scores, [5, 5], window=[0, 3])
    assert [_held(layer, r) for r in range(2)] == [[[0, 1, 2, 3, 4]], [[0, 1, 7, 8, 9]]]


def test_keep_top_one_eviction_keeps_the_window_whatever_its_scores():
    """Every row loses one entry with a window: the lowest score inside the window stays, the lowest outside goes
    (the single-eviction argmin is only for window-less calls)."""
    layer = _layer(2, 1, 6, seed=4)
    scores = torch.tensor([[[4.0, 3.0, 2.0, 5.0, 6.0, 0.0]], [[4.0, 1.0, 2.0, 5.0, 0.0, 6.0]]])
    keep_top(layer, scores, [5, 5], window=2)
    assert [_held(layer, r) for r in range(2)] == [[[0, 1, 3, 4, 5]], [[0, 2, 3, 4, 5]]]


# ---- D2O: the EMA gate at exact equality, one eviction per step (eager and captured paths) --------------------------
def _d2o_at_unit_similarity(variant: str):
    """A D2O layer after prefill whose keys are all the unit vector e_0 (every cosine is exactly 1.0), the next
    step's query/key/value, and the method. ``official_code`` compresses the prompt at its first decode step (many
    evictions), so that step is run here: the next one is a single eviction as on the paper variant."""
    from kvbench.methods.d2o import D2O

    g = torch.Generator().manual_seed(5)
    b, h, n, d, size = 1, 2, 24, 4, 12
    keys = torch.zeros(b, h, n + 2, d)
    keys[..., 0] = 1.0
    values = torch.randn(b, h, n + 2, d, generator=g)
    queries = torch.randn(b, h, n + 2, d, generator=g)
    method = D2O(variant=variant, **({"keep_edge_layers": False} if variant == "official_code" else {}))
    layer = make_layer(keys[:, :, :n].clone(), values[:, :, :n].clone())
    ctx = prefill_ctx(queries[:, :, :n], layer, size)
    method.prefill(layer, ctx)
    method.finish_prefill([layer], ctx)
    steps = [tuple(t[:, :, j : j + 1] for t in (queries, keys, values)) for j in (n, n + 1)]
    if variant == "official_code":
        decode_step(method, layer, *steps.pop(0), size)
    assert layer.num_entries == size
    return method, layer, steps[0], size


def _static_step(method, layer: KVLayer, step, size: int) -> KVLayer:
    """The captured path's D2O step (``d2o_ops.static_merge_evict``) on a copy of ``layer`` holding the step's entry:
    the same accumulated scores as ``decode_step`` gives the eager path."""
    from kvbench.engine.attention import grouped_attention
    from kvbench.methods.d2o import static_evict

    query, key, value = step
    static = copy.deepcopy(layer)
    static.update(key, value)
    _, probs = grouped_attention(query, static.keys, static.values, None, query.shape[-1] ** -0.5)
    static.state["acc"] = static.state["acc"] + probs.sum(3).mean(2)
    static.valid = torch.ones_like(static.positions, dtype=torch.bool)
    slots = type("Slots", (), {"keys": static.keys, "values": static.values, "positions": static.positions,
                               "valid": static.valid, "acc": static.state["acc"],
                               "capacity": static.capacity.view(-1, 1, 1), "row_state": static.row_state})
    static_evict(slots, None, method.static_policy(size))
    return static


def _by_position(layer: KVLayer, name: str) -> torch.Tensor:
    """``(B, H, kept, D)`` of the valid entries of ``layer`` in position order (either layout)."""
    valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
    out = []
    for r in range(layer.positions.shape[0]):
        heads = []
        for hd in range(layer.positions.shape[1]):
            order = torch.argsort(layer.positions[r, hd].masked_fill(~valid[r, hd], 1 << 40))[: int(valid[r, hd].sum())]
            heads.append(getattr(layer, name)[r, hd, order])
        out.append(torch.stack(heads))
    return torch.stack(out)


def _merged_rows(before: KVLayer, after: torch.Tensor, new_value: torch.Tensor) -> int:
    """Value rows of ``after`` ``(B, H, k, D)`` that are none of the values held before the step nor its own: rows
    a merge changed."""
    held = torch.cat([before.values, new_value], dim=2)
    return sum(not bool((after[0, hd, j] == held[0, hd]).all(-1).any())
               for hd in range(after.shape[1]) for j in range(after.shape[2]))


@pytest.mark.parametrize("variant", ["paper", "official_code"])
@pytest.mark.parametrize("at_threshold", [True, False])
def test_d2o_merges_a_single_eviction_whose_similarity_equals_tau(variant, at_threshold):
    """The gate is ``m >= tau``: an evicted key whose nearest cosine equals tau exactly (1.0 = 1.0) is merged, on the
    eager path (``_evict_one``) and on the captured one (``static_merge_evict``); with tau one ulp above, neither
    merges. Both paths leave the same entries and values."""
    method, layer, step, size = _d2o_at_unit_similarity(variant)
    tau = 1.0 if at_threshold else float(torch.nextafter(torch.tensor(1.0, dtype=torch.float64),
                                                             torch.tensor(2.0, dtype=torch.float64)))
    if variant == "official_code" and not at_threshold:
        tau = 1.5  # the code's float32 tau: the next float32 above 1.0 after its EMA is still above 1.0
    layer.row_state["d2o_tau_key"].fill_(tau)
    static = _static_step(method, layer, step, size)
    before = copy.deepcopy(layer)
    fast = []
    real = type(method)._evict_one
    method._evict_one = lambda *a: fast.append(1) or real(method, *a)
    decode_step(method, layer, *step, size)
    assert fast == [1], "the eager step took the one-eviction path"
    assert layer.num_entries == size and int(static.valid.sum(-1).max()) == size
    eager_values = _by_position(layer, "values")
    assert torch.equal(_by_position(static, "positions"), layer.positions)
    assert torch.equal(_by_position(static, "values"), eager_values)
    assert _merged_rows(before, eager_values, step[2]) == (2 if at_threshold else 0)  # one per head, or none


# ---- engine/static.py: slot eviction on fixed-capacity layers -------------------------------------------------------
def test_evict_one_frees_a_slot_only_above_capacity():
    """A (row, head) holding exactly ``capacity`` valid slots keeps them all; one more, and its lowest key goes. Rows
    of one batch decide alone (row 0 at capacity, row 1 above it)."""
    from kvbench.engine.static import evict_one

    valid = torch.tensor([[[True, True, True, False]], [[True, True, True, True]]])
    key = torch.tensor([[[3.0, 1.0, 2.0, 9.0]], [[3.0, 1.0, 2.0, 4.0]]])
    evict_one(valid, key, torch.tensor([3, 3]).view(-1, 1, 1))
    assert valid.tolist() == [[[True, True, True, False]], [[True, False, True, True]]]


def _slots(positions, valid, capacity, acc=None):
    b, h, c = positions.shape
    return type("Slots", (), {"positions": positions, "valid": valid, "acc": acc,
                              "capacity": torch.tensor(capacity).view(-1, 1, 1), "keys": torch.zeros(b, h, c, 1)})


def test_evict_oldest_takes_the_first_position_after_the_sinks():
    """Slots out of position order (a freed slot is reused): with 4 sinks the entry at position 4 leaves, never a
    sink (positions 0-3) nor an empty slot holding an old position."""
    from kvbench.engine.static import StaticPolicy, evict_oldest

    positions = torch.tensor([[[9, 0, 4, 1, 2, 3, 5, 4, 8]]])
    valid = torch.tensor([[[True, True, False, True, True, True, True, True, True]]])  # slot 2: freed, position 4
    evict_oldest(_slots(positions, valid, [7]), None, StaticPolicy(evict=evict_oldest, params=(4,)))
    assert positions[valid].tolist() == [9, 0, 1, 2, 3, 5, 8]


# ---- H2O: the recent window's first entry (decode, eager and captured) ----------------------------------------------
@pytest.mark.parametrize("lowest_rank", [7, 8])
def test_h2o_decode_protects_exactly_the_recent_window(lowest_rank):
    """Budget 10, recent_ratio 0.2: the 2 newest of 11 entries (ranks 9, 10) are protected. The lowest score at
    rank 8 (just outside the window) is evicted; at rank 7 too. Eager (``H2O.decode``) and captured
    (``h2o.static_evict``) agree."""
    from kvbench.methods.base import DecodeContext
    from kvbench.methods.h2o import H2O, static_evict

    n, cap = 11, 10
    acc = torch.arange(10.0, 10.0 + n).view(1, 1, n)
    acc[..., lowest_rank] = 0.0
    acc[..., 9] = -1.0  # inside the window: lower still, but protected
    method = H2O(recent_ratio=0.2)
    layer = _layer(1, 1, n, seed=6)
    layer.state["acc"] = acc.clone()
    layer.capacity = torch.tensor([cap])
    ctx = DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=1, query=torch.zeros(1, 1, 1, 4),
                        probs=torch.zeros(1, 1, 1, 1, n), capacity=torch.tensor([cap]))
    method.decode(layer, ctx)
    expected = [p for p in range(n) if p != lowest_rank]
    assert _held(layer, 0) == [expected]
    positions, valid = torch.arange(n).view(1, 1, n).flip(-1).clone(), torch.ones(1, 1, n, dtype=torch.bool)
    static_evict(_slots(positions, valid, [cap], acc=acc.flip(-1).clone()), None, method.static_policy(cap))
    assert sorted(positions[valid].tolist()) == expected


# ---- engine/graph.py: batch buckets and the ring of read_every columns ----------------------------------------------
def test_batch_buckets_hold_their_size_exactly():
    from kvbench.engine.graph import bucket

    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 64, 65, 128, 129)] == [1, 2, 4, 4, 8, 8, 16, 64, 128, 128, 192]


class _Counter:
    """A model whose next token is its input + 1 (the captured loop's tokens are then 1, 2, 3, ...)."""

    def forward(self, input_ids, position_ids, use_cache, logits_to_keep, past_key_values=None):
        logits = torch.nn.functional.one_hot(input_ids + 1, 512).float()
        return type("Out", (), {"logits": logits})

    __call__ = forward


class _Session:
    def __init__(self):
        self.advanced = []

    def captured_step_function(self):
        from kvbench.engine.graph import decode_step

        return decode_step

    def bucket_rows(self, rows):
        from kvbench.engine.graph import bucket

        return bucket(rows)

    def captured(self, rows, tensors, column=None, columns=1):
        import contextlib

        return contextlib.nullcontext()

    def read_block(self, columns):
        pass

    def graph_cache(self):
        return None

    def advance(self, chunk):
        self.advanced.append(chunk)

    def compression_due_in(self):
        return None  # no compression during decode

    def token_logp(self, tokens):
        return None  # no method reads the tokens' log-probabilities


@pytest.mark.parametrize("steps", [16, 17, 37])
def test_captured_loop_reads_every_step_once_in_order_across_the_ring(steps):
    """``read_every=16``: the host reads full chunks of 16 columns and the last partial one; the ids come in step
    order (the ring restarts at column 0 for each read) and no step runs past ``steps``."""
    from kvbench.engine.graph import captured_generate

    session, seen = _Session(), []
    done = captured_generate(session, _Counter(), torch.tensor([0, 100]), torch.tensor([[7], [7]]), steps,
                             lambda columns: seen.append(columns) and False, read_every=16)
    assert done == steps and sum(session.advanced) == steps
    assert session.advanced == [16] * (steps // 16) + ([steps % 16] if steps % 16 else [])
    assert [sum((c[r] for c in seen), []) for r in range(2)] == [list(range(1, steps + 1)),
                                                                 list(range(101, 101 + steps))]


def test_captured_loop_stops_at_the_read_where_every_row_ended():
    from kvbench.engine.graph import captured_generate

    session = _Session()
    done = captured_generate(session, _Counter(), torch.tensor([0]), torch.tensor([[0]]), 100,
                             lambda columns: columns[0][-1] >= 20, read_every=16)
    assert done == 32 and session.advanced == [16, 16]


# ---- engine/scores.py: the causal diagonal, the observation window and the window block's edges --------------------
def _reference_probs(q, k, allowed, key_valid=None):
    """Softmax ``(B, Hq, n, n)`` in float64 over the keys ``allowed`` ``(n, n)`` marks (and valid keys); rows with no
    key -> 0."""
    g = q.shape[1] // k.shape[1]
    logits = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(g, 1)) * q.shape[-1] ** -0.5
    mask = allowed.view(1, 1, *allowed.shape)
    if key_valid is not None:
        mask = mask & key_valid.view(key_valid.shape[0], 1, 1, -1)
    return torch.nan_to_num(torch.softmax(logits.masked_fill(~mask, float("-inf")), -1), nan=0.0)


def _qk(n=10, b=2, hq=4, hkv=2, d=8, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)


@pytest.mark.parametrize("padded", [False, True])
def test_window_attention_and_column_sums_include_the_diagonal(padded):
    """Each query attends its own key (``key <= query``); the observation window is exactly the last ``w`` queries;
    column sums over query chunks of 3 (chunk edges inside the prompt) start at ``query_start`` inclusive."""
    from kvbench.engine.scores import column_sums, window_attention

    n, w = 10, 4
    q, k = _qk(n)
    valid = torch.ones(2, n, dtype=torch.bool)
    if padded:
        valid[1, :3] = False
    key_valid = valid if padded else None
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    ref = _reference_probs(q, k, causal, key_valid) * valid.view(2, 1, n, 1)  # padded queries add nothing
    torch.testing.assert_close(window_attention(q, k, w, 8**-0.5, key_valid).double(), ref[:, :, n - w :],
                               rtol=1e-5, atol=1e-6)
    for start in (0, 5):
        torch.testing.assert_close(column_sums(q, k, 8**-0.5, key_valid, chunk=3, query_start=start).double(),
                                   ref[:, :, start:].sum(-2), rtol=1e-5, atol=1e-5)


def test_window_causal_column_sums_mask_exactly_the_window_block():
    """KVCache-Factory's 2024-10 H2O mask: only the last ``w`` x ``w`` block is causal; the query just before the
    window sees the window's keys, the window's first query does not see the keys after it."""
    from kvbench.engine.scores import window_causal_column_sums

    n, w = 10, 4
    q, k = _qk(n)
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    allowed = ~((j > i) & (i >= n - w) & (j >= n - w))
    ref = _reference_probs(q, k, allowed).sum(-2)
    torch.testing.assert_close(window_causal_column_sums(q, k, w, 8**-0.5, chunk=3).double(), ref,
                               rtol=1e-5, atol=1e-5)


# ---- StreamingLLM: the sinks' last entry and the window's first (unpadded and padded decode) -----------------------
@pytest.mark.parametrize("padded", [False, True])
def test_streamingllm_decode_evicts_the_first_entry_after_the_sinks(padded):
    """Paper variant, 4 sinks, budget 8, 9 entries per row: the entry of rank 4 (the first after the sinks) leaves,
    ranks 0-3 and the 4 newest stay. A left-padded row (two empty slots) ranks its own entries."""
    from kvbench.methods.base import DecodeContext
    from kvbench.methods.streamingllm import StreamingLLM

    n, cap = 11 if padded else 9, 8
    layer = _layer(2, 2, n, seed=8)
    if padded:
        valid = torch.ones(2, 2, n, dtype=torch.bool)
        valid[0, :, :2] = False
        valid[1, :, 9:] = False  # row 1: 9 entries, two empty slots at the end (a row that kept fewer)
        layer.set_valid(valid)
    method = StreamingLLM(variant="paper", sink_size=4, window=4)
    ctx = DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=2, query=torch.zeros(2, 2, 1, 4), probs=None,
                        capacity=torch.tensor([cap, cap]))
    method.decode(layer, ctx)
    first = [2, 0] if padded else [0, 0]
    for r in range(2):
        held = [first[r] + x for x in (0, 1, 2, 3, 5, 6, 7, 8)]
        assert _held(layer, r) == [held, held], r


# ---- Quest: the newest entry's page at a page's last and first slot (eager select, captured static_pages) ----------
@pytest.mark.parametrize("t", [15, 16, 17, 20, 21])
def test_quest_captured_pages_equal_the_eager_pages_across_a_page_boundary(t):
    """Page size 4, budget 12 (3 pages): with t entries the newest entry's page (partial or just completed) is always
    attended whole, plus the 2 best other pages; the captured step (slots in position order, 24 of them) attends
    exactly the eager step's entries."""
    from kvbench.budget import Budget
    from kvbench.methods.base import DecodeContext
    from kvbench.methods.quest import Quest, static_pages

    g = torch.Generator().manual_seed(t)
    k = torch.randn(1, 2, t, 8, generator=g)
    q = torch.randn(1, 4, 1, 8, generator=g)
    method = Quest(page_size=4)
    method.validate(Budget.parse(12))
    ctx = DecodeContext(layer_idx=2, num_layers=4, num_kv_heads=2, query=q, probs=None, capacity=torch.tensor([12]))
    index = method.select(make_layer(k, k.clone()), ctx)
    newest_page = list(range((t - 1) // 4 * 4, t))
    for h in range(2):
        chosen = index[0, h].tolist()
        assert chosen[-len(newest_page):] == newest_page and len(chosen) == 8 + len(newest_page)
    c = 24
    keys = torch.zeros(1, 2, c, 8)
    keys[:, :, :t] = k
    valid = torch.zeros(1, 2, c, dtype=torch.bool)
    valid[..., :t] = True
    slots = type("Slots", (), {"keys": keys, "valid": valid, "query": q, "capacity": torch.full((1, 1, 1), 12)})
    attended = static_pages(slots, method.static_policy(12, layer_idx=2))  # the page budget: the row's capacity
    assert [attended[0, h].nonzero().flatten().tolist() for h in range(2)] == [index[0, h].tolist() for h in range(2)]


# ---- OmniKV: the window's prompt rows (none, one, all) and the chosen count (eager and captured choice) -----------
@pytest.mark.parametrize("reading", ["paper", "official_code"])
@pytest.mark.parametrize("selector", ["uniform", "exp"])
@pytest.mark.parametrize(("prompt_rows", "k"), [(0, 6), (1, 6), (1, 1), (3, 6), (3, 2), (3, 4)])
def test_omnikv_captured_choice_equals_the_eager_choice(reading, selector, prompt_rows, k):
    """A window of 4 queries of which ``prompt_rows`` are still prompt queries (positions < n = 20; the first
    generated token's query sits at position n, so a captured step, after the first, has at most 3): the captured
    mask (``window_choice``) holds exactly the eager step's tokens (``select_by_window``): the window's prompt tokens
    forced, ``k`` tokens in all (the paper's reading) or ``max(1, k - p) + p`` (the code's), over slots that hold
    more than the prompt, with the prompt's length and ``k`` device values. The paper's reading with ``k < p`` keeps
    ``k`` of ``p`` tokens tied at +inf: the same count, another tie order."""
    from kvbench.methods.omnikv_select import select_by_window, window_choice

    n, w, d = 20, 4, 8
    g = torch.Generator().manual_seed(prompt_rows * 10 + k)
    keys = torch.randn(1, 2, n, d, generator=g)
    recent = torch.randn(1, 4, w, d, generator=g)
    positions = torch.arange(n - prompt_rows, n - prompt_rows + w).view(1, w)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    args = (recent, positions, keys, d**-0.5, k, selector, reading, inv_freq)
    eager = sorted(select_by_window(*args)[0].tolist())
    # the captured step's slots: the prompt's n, then 5 more (generated entries, empty slots) that are never chosen;
    # the prompt's length and k device values
    slots = torch.cat([keys, torch.randn(1, 2, 5, d, generator=g)], dim=2)
    mask = window_choice(recent, positions, slots, torch.tensor([[n]]), d**-0.5, torch.tensor([[k]]), selector,
                         reading, inv_freq)[0]
    assert mask.shape == (n + 5,)
    chosen = mask.nonzero().flatten().tolist()
    if reading == "paper" and k < prompt_rows:  # k of the window's forced tokens, all tied at +inf: which ones stay
        # is torch.topk's tie order on the host-driven path (of a constant k) and a sort's on the captured one
        assert len(chosen) == k and set(chosen) <= set(range(n - prompt_rows, n))
    else:
        assert chosen == eager
    if reading != "paper" or k >= prompt_rows:  # the paper's k counts the window (k < p drops some of it)
        assert set(range(n - prompt_rows, n)) <= set(eager)
    assert len(eager) == (k if reading == "paper" else max(1, k - prompt_rows) + prompt_rows)


# ---- PyramidKV: the uniform case's edge and the largest-remainder rounding ---------------------------------------
@pytest.mark.parametrize("schedule", ["exact", "kvfactory_2406", "kvfactory_2409"])
def test_pyramid_is_uniform_only_below_twice_the_base(schedule):
    """C = 128, w = 8 (base 120): a prompt of 239 tokens (< 2 x 120) keeps 120 per layer; one of exactly 240 builds
    the pyramid (max clamped to n - w = 232)."""
    from kvbench.methods.pyramidkv import pyramid_capacity

    assert pyramid_capacity(128, 239, 8, 20, 32, schedule) == [120] * 32
    caps = pyramid_capacity(128, 240, 8, 20, 32, schedule)
    assert caps[0] == 232 and caps[1] < caps[0]


def test_pyramid_exact_rounding_gives_the_largest_remainders_their_token():
    """base 16, beta 20, 4 layers: linspace(31.2, 0.8) = [31.2, 21.07, 10.93, 0.8] floors to 62 of 64 tokens; the two
    largest remainders (.93, .8: layers 2 and 3) get the missing two."""
    from kvbench.methods.pyramidkv import pyramid_capacity

    assert pyramid_capacity(20, 100, 4, 20, 4, "exact") == [31, 21, 11, 1]


# ---- KVMerger: the device theta search at a room met exactly, and a room every mergeable token fits ----------------
def test_kvmerger_device_search_meets_a_room_exactly_and_leaves_a_fitting_head_unmerged():
    """Rooms equal to the set counts some theta gives are met exactly (the search accepts ``count <= room`` and stops
    at ``count == room``); a room holding every mergeable token (``room >= mergeable``) skips the search: theta 1.0,
    every mergeable token its own set."""
    from kvbench.methods.kvmerger_ops import device_sets

    g = torch.Generator().manual_seed(0)
    kn = torch.nn.functional.normalize(torch.randn(2, 30, 3, generator=g, dtype=torch.float64), dim=-1)
    mergeable = torch.ones(2, 30, dtype=torch.bool)
    mergeable[1, :4] = False
    rooms = device_sets(kn, mergeable, 0.3)[0].sum(-1).tolist()
    assert rooms[0] < 30 and rooms[1] < 26
    anchors, theta = device_sets(kn, mergeable, 0.0, rooms)
    assert anchors.sum(-1).tolist() == rooms and bool((theta < 1.0).all())
    anchors, theta = device_sets(kn, mergeable, 0.0, [30, 26])
    assert torch.equal(anchors, mergeable) and theta.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("lowest", ["first_after_sinks", "last_before_recent"])
def test_d2o_single_eviction_spares_exactly_the_sinks_and_the_recent_window(lowest):
    """After the step's entry, ranks below ``d2o_sinks`` and the ``d2o_recent`` newest are protected even with the
    lowest scores; the victim is the first rank after the sinks, or the last one before the recent window, whichever
    scores lowest: eager (``_evict_one``) and captured (``static_merge_evict``) alike."""
    method, layer, step, size = _d2o_at_unit_similarity("paper")
    sinks, recent = int(layer.row_state["d2o_sinks"][0]), int(layer.row_state["d2o_recent"][0])
    n = layer.num_entries + 1  # after the step's entry
    acc = torch.arange(100.0, 100.0 + size).view(1, 1, size).repeat(1, 2, 1)
    acc[..., sinks - 1] = -9.0  # the last sink
    acc[..., n - recent] = -9.0  # the recent window's oldest entry after the step (the step's entry scores ~0)
    victim = sinks if lowest == "first_after_sinks" else n - recent - 1
    acc[..., victim] = 1.0
    layer.state["acc"] = acc
    static = _static_step(method, layer, step, size)
    positions = layer.positions[0, 0].tolist() + [int(layer.positions.max()) + 1]
    decode_step(method, layer, *step, size)
    expected = [p for i, p in enumerate(positions) if i != victim]
    assert kept_positions(layer) == [expected, expected]
    assert kept_positions(static) == [expected, expected]


def test_h2o_recent_window_rounds_half_to_even_and_leaves_one_heavy_hitter():
    """``round(recent_ratio x budget)`` as torch rounds (2.5 -> 2, 1.5 -> 2), at least 1 recent token and at most
    budget - 1 (one heavy hitter stays): the window every H2O step protects (prefill, decode, captured step)."""
    from kvbench.methods.h2o import H2O

    assert H2O(recent_ratio=0.25)._recent_host((10, 6)) == [2, 2]
    assert H2O(recent_ratio=0.9)._recent_host((2, 10, 3)) == [1, 9, 2]
    assert H2O(recent_ratio=0.01)._recent_host((10, 2)) == [1, 1]
