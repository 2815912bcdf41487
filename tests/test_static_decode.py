"""engine.compile: a decode step a GPU can run without the host (issue: GPU-grade speed), checked on the CPU.

After prefill every layer becomes a fixed-capacity ``StaticKVLayer`` and each decode step runs one compiled function
per layer (``engine.static.static_step``). Two things are pinned here, as counts rather than times: the static path
generates exactly what the default path generates (greedy, fp32), and the step is captured whole
(``fullgraph=True``) and never recompiled while a generation goes on (graph counts over 32 steps).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from kvbench.budget import Budget
from kvbench.engine import CompressionSession, graph, greedy_generate
from kvbench.engine.static import StaticKVLayer
from kvbench.errors import ConfigError
from kvbench.methods import build_method

pytestmark = pytest.mark.compat
STATIC = ["fullkv", "snapkv", "pyramidkv", "dynamickv", "streamingllm", "h2o", "local", "kvmerger", "quest", "knorm",
          "keydiff", "expected_attention", "adakv", "chunkkv", "d2o", "omnikv", "tova", "rkv", "think", "think+h2o",
          "lminfinite", "kvzip", "roco", "triattention", "cam", "pyramidinfer", "sirllm", "infllm", "cla"]
# OmniKV's default filter layers (Llama-3-8B's, scaled) leave no sparse layer on a 3-layer model: one filter layer
#: AdaKV's default ragged layout has no fixed-capacity form (refused: test_ragged_cache); its padded layout runs
#: ThinK's keys keep half their channels: its default inner SnapKV (no probabilities: the fused kernel over the kept
#: channels) and H2O (probabilities accumulated and an eviction every step over them)
#: CLA runs its untrained proxy (its mechanism, not its quality): layer 1 attends layer 0's slots, layer 2 its own
#: TriAttention compresses every layer after the forward where they hold budget + 16 (its host phase between captured
#: steps: 3 of them in the 66-step test, the first at the 40-token prompt's 24th step)
FIELDS = {"omnikv": {"filter_layers": [0]}, "adakv": {"layout": "padded"}, "cla": {"allow_untrained": True},
          "think+h2o": {"name": "think", "inner": {"name": "h2o"}}, "triattention": {"divide_length": 16}}


def _fields(model, name: str, fields: dict | None) -> dict:
    from helpers import method_fields

    return {"name": name, **method_fields(name, model), **FIELDS.get(name, {}), **(fields or {})}


def _prompt(n=200, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(model, name, budget, compile, prompts, new=32, fields=None, after_each_step=None):
    from helpers import ByteTokenizer

    b = Budget.parse(budget)
    method = build_method(_fields(model, name, fields), b)
    tokenizer = ByteTokenizer() if method.needs_reconstruction else None  # KVzip's repeat prompt, in toy ids
    with CompressionSession(model, method, b, compile=compile, tokenizer=tokenizer) as session:
        out = greedy_generate(model, prompts, new, [], 0, after_each_step)
    return out, session


def _entries(session, acc: str = "acc") -> list[tuple[torch.Tensor, ...]]:
    """Per layer: the valid entries of every (row, head) in position order (positions, keys, values, accumulated
    scores), whatever slots hold them, and the layer's per-row method state."""
    out = []
    for idx in sorted(session._layers):
        layer = session._layers[idx]
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        order = torch.argsort(layer.positions.masked_fill(~valid, 1 << 40), dim=-1)[..., : int(valid.sum(-1).max())]
        held = torch.gather(valid, -1, order)  # False: the empty slots of a (row, head) holding fewer entries

        def take(t: torch.Tensor, order=order, held=held) -> torch.Tensor:
            if t.dim() == 3:
                return torch.gather(t, -1, order).masked_fill(~held, 0)
            return torch.gather(t, 2, order.unsqueeze(-1).expand(*order.shape, t.shape[-1])).masked_fill(
                ~held.unsqueeze(-1), 0)

        out.append((take(layer.positions), take(layer.keys), take(layer.values), take(layer.state[acc]),
                    {k: v.clone() for k, v in layer.row_state.items()}))
    return out


@pytest.mark.parametrize("method", STATIC)
def test_static_decode_equals_the_default_path(toy_llama, method):
    budget = None if method == "fullkv" else 64
    eager, eager_session = _generate(toy_llama, method, budget, False, [_prompt()])
    static, static_session = _generate(toy_llama, method, budget, "eager", [_prompt()])
    assert static.tokens == eager.tokens
    assert static_session.stats.attended_tokens_mean == pytest.approx(eager_session.stats.attended_tokens_mean)
    # the entries held, as the default path holds them (not the slots: the step's own token's slot of evicting
    # methods, the unused reserve of the others, the bucket's and the job's sizing are the captured step's layout)
    assert static.resident_kv_bytes_final == eager.resident_kv_bytes_final
    assert static_session.stats.resident_curve == eager_session.stats.resident_curve


@pytest.mark.parametrize("method", STATIC)
def test_a_padded_batch_ending_early_records_what_the_default_path_records(toy_llama, method):
    """What a record stores of a generation, for three rows at the batch bucket of four (one row where the method
    takes no batch) whose first row ends at an EOS early, so the captured loop runs steps past its end: the tokens,
    the resident bytes after prefill and at the end, the resident curve, the entries attended per step and the layer
    calls equal the host-driven path's. A sweep of this kind found the attended mean taken over the bucket's copy of
    the last row and a ragged cache's bytes counting the steps past the end."""
    from helpers import ByteTokenizer

    b = Budget.parse(None if method == "fullkv" else 64)
    probe = build_method(_fields(toy_llama, method, None), b)
    prompts = [_prompt(200, 1), _prompt(163, 2), _prompt(126, 3)][: 3 if probe.supports_batching else 1]
    free, _ = _generate(toy_llama, method, b.label(), False, prompts, new=24)
    tokens = free.tokens[0]
    eos = [tokens[max(i for i, t in enumerate(tokens) if t not in tokens[:i])]]  # row 0's last new token ends it
    records = {}
    for compile in (False, "eager"):
        m = build_method(_fields(toy_llama, method, None), b)
        tokenizer = ByteTokenizer() if m.needs_reconstruction else None
        with CompressionSession(toy_llama, m, b, compile=compile, tokenizer=tokenizer) as session:
            out = greedy_generate(toy_llama, prompts, 24, eos, 0)
        stats = session.stats
        records[compile] = (out.tokens, out.resident_kv_bytes_final, stats.resident_kv_bytes_after_prefill,
                            stats.resident_curve, stats.attended_tokens_mean, stats.decode_layer_calls)
    assert len(records[False][0][0]) < 24
    assert records["eager"] == records[False]


@pytest.fixture(scope="session")
def capture_probe(toy_llama) -> dict:
    """``graph.STATUS`` after one captured FullKV generation: whether this torch / transformers pair traces the
    model's forward whole (probed once per process: the pair does not change)."""
    graph.STATUS.clear()
    _generate(toy_llama, "fullkv", None, "eager", [_prompt(40)], new=3)
    return dict(graph.STATUS)


@pytest.fixture
def capturable(capture_probe):
    """Skip where this torch / transformers pair cannot trace the model's forward whole (torch 2.6 with transformers
    5.6, CI's lowest leg): the captured decode then runs the same step uncompiled (``test_an_untraceable_forward_...``
    checks that path everywhere). ``graph.STATUS`` starts as the probe left it."""
    graph.STATUS.clear()
    graph.STATUS.update(capture_probe)
    if not graph.STATUS.get("captured"):
        pytest.skip(f"dynamo cannot trace this model's forward whole here: {graph.STATUS.get('refused')}")


def test_an_untraceable_forward_decodes_uncompiled_with_one_line(toy_llama, monkeypatch, caplog):
    """Where dynamo refuses the forward (raised while tracing, before anything ran), the same step runs uncompiled:
    the tokens are the host-driven path's, one warning line says so, ``graph.STATUS`` records it."""
    import logging

    def refuse(model, kw, buffers):
        raise torch._dynamo.exc.Unsupported("a forward dynamo cannot trace (this test's)")

    monkeypatch.setattr(CompressionSession, "captured_step_function", lambda self: refuse)
    graph.STATUS.clear()
    eager, _ = _generate(toy_llama, "h2o", 64, False, [_prompt()], new=40)
    with caplog.at_level(logging.WARNING, logger="kvbench"):
        static, _ = _generate(toy_llama, "h2o", 64, "eager", [_prompt()], new=40)
        again, _ = _generate(toy_llama, "h2o", 64, "eager", [_prompt()], new=40)
    assert static.tokens == eager.tokens == again.tokens and static.decode_steps == 39
    lines = [r.getMessage() for r in caplog.records if "cannot trace" in r.getMessage()]
    assert len(lines) == 1 and "this test's" in lines[0]  # once per reason, not per generation
    assert graph.STATUS["captured"] is False


def _capture_counts(model, method, budget, prompts, new, fields=None):
    """Dynamo's graph count after each step's tokens reached the host (read at every step: ``READ_EVERY`` = 1)."""
    seen = []

    def after_each_step(row, tokens):
        if row == 0:
            seen.append(counters["stats"]["unique_graphs"])
        return False

    from helpers import ByteTokenizer

    b = Budget.parse(budget)
    m = build_method(_fields(model, method, fields), b)
    tokenizer = ByteTokenizer() if m.needs_reconstruction else None
    with CompressionSession(model, m, b, compile="eager", tokenizer=tokenizer) as session:
        out = greedy_generate(model, prompts, new, [], 0, after_each_step)
    return out, seen, session


@pytest.mark.parametrize("method", STATIC)
def test_the_whole_step_is_captured_once_and_never_recompiled(toy_llama, method, monkeypatch, capturable):
    """The whole decode step (every layer, the method's step, the LM head, the greedy choice) is one graph
    (``fullgraph=True``: a graph break raises), captured at the second decode step (the first is host-driven and
    checked) and never recompiled over 64 steps while a 40-token prompt's cache fills to the budget of 64 and then
    evicts; a second batch bucket (2 rows) adds exactly one graph, and a batch of 2 again none."""
    monkeypatch.setattr(graph, "READ_EVERY", 1)
    torch._dynamo.reset()
    counters.clear()
    budget = None if method == "fullkv" else 64
    out, seen, session = _capture_counts(toy_llama, method, budget, [_prompt(40)], 66)
    assert out.decode_steps == 65 and len(seen) == 66
    assert seen[:3] == [0, 0, 1]  # the prompt's token, the host-driven first step's, then the captured steps'
    assert seen[-1] == 1, seen  # 63 more steps, the cache filled and evicting: no new graph
    assert session.stats.decode_layer_calls == 65 * 3
    if not session.method.supports_batching:  # one prompt at a time (KVzip): no second bucket to capture
        return
    _, seen2, _ = _capture_counts(toy_llama, method, budget, [_prompt(40), _prompt(37, 2)], 20)
    assert seen2[-1] == 2, seen2
    # another sample of the bucket (a new session, new buffers): the same graph; FullKV's slot count follows the
    # prompt's length, rounded to engine.session.SLOT_ROUND: another length within the bucket, the same graph too (a
    # method whose step has constants set by a prompt within the budget, H2O's recent window, captures per length)
    lengths = (45, 41) if method == "fullkv" else (40, 37)
    _, seen3, _ = _capture_counts(toy_llama, method, budget, [_prompt(lengths[0], 3), _prompt(lengths[1], 4)], 20)
    assert seen3[-1] == 2, seen3


def test_heads_of_their_own_lengths_replay_one_graph_across_samples(toy_llama, capturable):
    """AdaKV's longest head differs per layer and per prompt: its static layers get one slot count (the most any
    layer needs, rounded up, never below what the job's earlier samples had), so four prompts beyond the budget
    compile one graph, not one per sample (4 before; 3 with the rounding alone)."""
    torch._dynamo.reset()
    counters.clear()
    for seed in range(4):
        out, session = _generate(toy_llama, "adakv", 48, "eager", [_prompt(120 + 7 * seed, seed)], new=12)
        assert out.decode_steps == 11 and {layer.keys.shape[2] for layer in session._layers.values()} == {128}
    assert counters["stats"]["unique_graphs"] == 1


def test_the_host_driven_path_is_not_captured(toy_llama, monkeypatch):
    """The counts above are the capture's: the default path compiles nothing."""
    monkeypatch.setattr(graph, "READ_EVERY", 1)
    torch._dynamo.reset()
    counters.clear()
    b = Budget.parse(64)
    with CompressionSession(toy_llama, build_method({"name": "h2o"}, b), b):
        greedy_generate(toy_llama, [_prompt(40)], 10, [], 0)
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("method", ["fullkv", "h2o", "d2o", "omnikv", "quest", "think+h2o", "pyramidinfer", "sirllm",
                                    "infllm"])
def test_the_captured_step_writes_static_addresses_only(toy_llama, method):
    """Every tensor the captured step mutates (slots, positions, validity, the method's per-entry and per-row state,
    the step's token / position / output buffers) is allocated before the first captured step, marked a static
    address for the compiler, and still at that address after 40 steps: CUDA graphs replay over it in place, nothing
    is copied into or out of the graph per step. (The per-layer compiled step marked nothing: inductor skipped CUDA
    graphs for its mutated inputs.)"""
    b = Budget.parse(None if method == "fullkv" else 64)
    m = build_method(_fields(toy_llama, method, None), b)
    marked = {}
    real_mark = graph.mark_static

    def spy(tensors):
        marked.update({id(t): (t, t.data_ptr()) for t in tensors})
        real_mark(tensors)

    with CompressionSession(toy_llama, m, b, compile="eager") as session, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph, "mark_static", spy)
        greedy_generate(toy_llama, [_prompt()], 41, [], 0)
        layers = [session._layers[i] for i in sorted(session._layers)]
        token_logp = session._token_logp  # SirLLM's surprisal of the step's token, which the step writes
        if token_logp is not None:  # the layers read the step's own buffer, the same object (no aliasing inputs)
            assert any(t is token_logp for t, _ in marked.values())
    buffers = [t for layer in layers for t in layer.buffers()] + ([] if token_logp is None else [token_logp])
    assert (token_logp is not None) == (method == "sirllm")
    assert buffers and len(marked) >= len(buffers) + 4
    addresses = {ptr for _, ptr in marked.values()}
    assert all(t.data_ptr() in addresses for t in buffers)  # what the layers hold now is what the graph wrote
    for t, ptr in marked.values():
        assert getattr(t, "_dynamo_static_input_type", None) is not None
        assert t.data_ptr() == ptr


HOST_READ_NODES = {"item", "tolist", "nonzero", "masked_select", "_local_scalar_dense", "is_nonzero", "__bool__",
                   "__int__", "__float__"}


def test_no_host_read_inside_a_captured_step(toy_llama, monkeypatch, capturable):
    """The captured step's graph (every op dynamo traced, recorded by a backend of this test) holds no scalar read
    and no data-dependent shape, each a wait for the GPU; the host reads the chosen ids once per ``READ_EVERY`` steps
    (48 steps: 3 reads)."""
    graphs, reads = [], []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_read = graph.read_chosen
    monkeypatch.setattr(graph, "read_chosen", lambda *a: reads.append(a[2:]) or real_read(*a))
    for method in ("h2o", "d2o", "quest", "think+h2o"):
        graphs.clear(), reads.clear()
        b = Budget.parse(64)
        with CompressionSession(toy_llama, build_method(_fields(toy_llama, method, None), b), b,
                                compile=recorder):
            out = greedy_generate(toy_llama, [_prompt()], 50, [], 0)
        assert out.decode_steps == 49 and len(graphs) == 1
        names = {str(getattr(n.target, "__name__", n.target)) for n in graphs[0].graph.nodes}
        assert names & HOST_READ_NODES == set(), method
        assert "argmax" in names and "index_put_" in names  # the greedy choice and the cache write are in the graph
        assert reads == [(0, 16)] * 3, reads  # the host-driven first step, then 48 captured steps: 3 reads


#: tensor factories: without a ``device`` they make CPU tensors, and a CPU tensor inside the step makes inductor skip
#: CUDA graphs for it ("skipping cudagraphs due to cpu device") on a GPU, where the model's tensors are CUDA ones
FACTORIES = {"arange", "zeros", "ones", "full", "empty", "tensor", "linspace", "rand", "randn", "randint", "eye",
             "scalar_tensor", "as_tensor", "empty_strided", "randperm"}


@pytest.mark.parametrize("method", STATIC)
def test_every_captured_step_reads_nothing_back_and_makes_no_host_tensor(toy_llama, method, capturable):
    """For every method with a captured step, the traced step (one graph: a backend of this test records it) holds
    no scalar read or data-dependent shape (a wait for the GPU each), and every tensor it creates names its device
    (a factory without one creates a CPU tensor, which on a GPU makes inductor run the step without CUDA graphs).
    On the CPU both are counts of the mechanism a GPU needs, not times."""
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    from helpers import ByteTokenizer

    b = Budget.parse(None if method == "fullkv" else 64)
    m = build_method(_fields(toy_llama, method, None), b)
    tokenizer = ByteTokenizer() if m.needs_reconstruction else None
    with CompressionSession(toy_llama, m, b, compile=recorder, tokenizer=tokenizer):
        out = greedy_generate(toy_llama, [_prompt()], 40, [], 0)
    assert out.decode_steps == 39 and len(graphs) == 1
    nodes = [n for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]
    names = {str(getattr(n.target, "__name__", n.target)) for n in nodes}
    assert names & HOST_READ_NODES == set()
    hostless = [n.format_node() for n in nodes if str(getattr(n.target, "__name__", n.target)) in FACTORIES
                and "device" not in n.kwargs]
    assert hostless == []


def test_a_padded_batch_decodes_as_each_row_alone(toy_llama):
    long, short = _prompt(200, 3), _prompt(150, 4)
    both, _ = _generate(toy_llama, "h2o", 64, "eager", [long, short])
    alone = [_generate(toy_llama, "h2o", 64, "eager", [p])[0].tokens[0] for p in (long, short)]
    eager, _ = _generate(toy_llama, "h2o", 64, False, [long, short])
    assert both.tokens == eager.tokens
    assert both.tokens[0] == alone[0]


@pytest.mark.parametrize("method", ["fullkv", "snapkv", "h2o", "d2o", "tova", "streamingllm", "think", "lminfinite",
                                    "sirllm"])
def test_a_batch_of_three_runs_in_the_bucket_of_four(toy_llama, method):
    """Three left-padded rows decode in a bucket of four (the fourth repeats the third and is dropped): the tokens
    are the host-driven path's, and the reported bytes are three rows'."""
    prompts = [_prompt(200, 3), _prompt(150, 4), _prompt(180, 5)]
    budget = None if method == "fullkv" else 64
    eager, _ = _generate(toy_llama, method, budget, False, prompts, new=24)
    static, session = _generate(toy_llama, method, budget, "eager", prompts, new=24)
    assert static.tokens == eager.tokens
    assert all(session._layers[i].keys.shape[0] == 3 for i in session._layers)
    assert static.resident_kv_bytes_final == sum(session._layers[i].resident_bytes() for i in session._layers)
    assert static.resident_kv_bytes_final == eager.resident_kv_bytes_final  # three rows' entries, not the bucket's


D2O_FIELDS = [{}, {"similarity_feature": "key_value", "merge_score": "add"},
              {"merge_weights": "average", "group_agg": "max"},
              {"granularity": "query_head", "similarity_feature": "value"}, {"variant": "official_code"},
              {"variant": "official_code", "granularity": "query_head", "similarity_feature": "key_value"}]


@pytest.mark.parametrize("fields", D2O_FIELDS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "default")
def test_static_d2o_leaves_the_cache_of_the_default_path(toy_llama, fields):
    """Equal tokens are a weak check of a merge (a wrong weight moves a few entries slightly): after 32 steps every
    layer holds the same entries (positions), merged to the same keys and values, with the same scores and EMA
    thresholds, as the default path's, a padded batch of two rows included. ``variant=official_code`` compresses the
    prompt at the first decode step, on the default path; its layers are static from the second step on."""
    prompts = [_prompt(200, 3), _prompt(150, 4)] if not fields else [_prompt()]
    eager, eager_session = _generate(toy_llama, "d2o", 64, False, prompts, fields=fields)
    static, static_session = _generate(toy_llama, "d2o", 64, "eager", prompts, fields=fields)
    assert static.tokens == eager.tokens
    assert all(isinstance(layer, StaticKVLayer) for layer in static_session._layers.values())
    for a, b in zip(_entries(eager_session), _entries(static_session), strict=True):
        assert torch.equal(a[0], b[0])
        for x, y in zip(a[1:4], b[1:4]):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
        assert a[4].keys() == b[4].keys()
        for key in a[4]:
            torch.testing.assert_close(b[4][key], a[4][key], rtol=0, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("budget", [64, 65, 300])
def test_static_cam_merges_into_the_values_of_the_default_path(toy_llama, budget, monkeypatch):
    """CaM's paper reading merges the token leaving the window into the next r values at every step, with a draw per
    token: after 40 steps every layer holds the same entries (positions), the same merged values and the same
    accumulated scores as the default path's; some draws merged and some did not, and the draws decide.
    Budget 65: an odd capacity (33 start tokens, 32 recent: s = ceil(C / 2)). Budget 300: a 200-token prompt that
    fits (the capacity is the prompt's length: the scores are its column sums, and the merging starts at the first
    step)."""
    from kvbench.methods import cam

    merges = []
    real = cam.decode_uniforms

    def counting(key, positions):
        u = real(key, positions)
        merges.append(u)
        return u

    monkeypatch.setattr(cam, "decode_uniforms", counting)
    new = 40
    eager, eager_session = _generate(toy_llama, "cam", budget, False, [_prompt()], new=new)
    assert len(merges) == 3 * (new - 1)  # a draw per layer and step: the cache is at its capacity from the start
    draws = torch.cat(merges)
    assert 0 < float((draws < 0.5).float().mean()) < 1
    static, static_session = _generate(toy_llama, "cam", budget, "eager", [_prompt()], new=new)
    assert static.tokens == eager.tokens
    assert all(isinstance(layer, StaticKVLayer) for layer in static_session._layers.values())
    for a, b in zip(_entries(eager_session, "cam_acc"), _entries(static_session, "cam_acc"), strict=True):
        assert torch.equal(a[0], b[0]) and a[0].shape[-1] == min(budget, 200)
        for x, y in zip(a[1:4], b[1:4]):  # the steps' own attention differs in the last bits (another kernel)
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
    # the draws decide: with every draw at 1 (no merge) the values held differ
    monkeypatch.setattr(cam, "decode_uniforms", lambda key, positions: torch.ones(positions.shape))
    _, unmerged_session = _generate(toy_llama, "cam", budget, False, [_prompt()], new=new)
    assert any(not torch.equal(a[2], b[2]) for a, b in zip(_entries(eager_session, "cam_acc"),
                                                           _entries(unmerged_session, "cam_acc")))


PYRAMIDINFER_FIELDS = [{}, {"allocation": "paper"}, {"prefill_mask": False, "gen_chunk": 8},
                       {"distance_weight": 3.0, "gen_compress_ratio": 0.5, "decay_strategy": "constant"}]


@pytest.mark.parametrize("fields", PYRAMIDINFER_FIELDS,
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "default")
def test_static_pyramidinfer_keeps_the_chunks_the_default_path_keeps(toy_llama, fields):
    """PyramidInfer compresses each chunk of gen_chunk generated entries that left the last-W window, by the last W
    queries' attention rows: after 60 steps (several chunks per layer) every layer holds the same entries (positions)
    as the default path's, the same W rows for each of them (the captured step's vector per entry against the
    method's own rows) and the same frozen count; the host's count of what each layer holds (the schedule, no read)
    is what its slots hold."""
    new = 60
    eager, eager_session = _generate(toy_llama, "pyramidinfer", 64, False, [_prompt()], new=new, fields=fields)
    method = eager_session.method
    rows, frozen = dict(method._rows), dict(method._frozen)
    static, static_session = _generate(toy_llama, "pyramidinfer", 64, "eager", [_prompt()], new=new, fields=fields)
    assert static.tokens == eager.tokens
    for idx in sorted(static_session._layers):
        layer, host = static_session._layers[idx], eager_session._layers[idx]
        assert isinstance(layer, StaticKVLayer)
        valid = layer.valid[0, 0]
        order = torch.argsort(layer.positions[0, 0].masked_fill(~valid, 1 << 40))[: int(valid.sum())]
        assert torch.equal(layer.positions[0, 0, order], host.positions[0, 0])
        assert bool((layer.valid[0, 0] == layer.valid[0, 1]).all())
        assert layer.entries == host.num_entries  # the schedule's count, no read
        window = rows[idx].shape[0]
        assert int(layer.row_state["pyramidinfer_window"]) == window
        mine = layer.state["pyramidinfer_rows"][0, 0, order, -window:].t()  # (W, entries): the window's columns
        torch.testing.assert_close(mine, rows[idx], rtol=0, atol=1e-6)
        assert int(layer.row_state["pyramidinfer_frozen"]) == frozen[idx]
    assert all(frozen[i] > 0 for i in frozen)
    # the chunks were compressed: each layer's frozen count grew past what it held after prefill (64 on average)
    assert sum(frozen.values()) > 3 * 64


def test_pyramidinfer_window_weights_are_linspaces():
    """The captured step's weights for a device window W are ``torch.linspace(1, distance_weight, W)``'s values
    exactly, in the last W of the rows' columns, zero before them."""
    from kvbench.methods.pyramidinfer import window_weights

    for weight in (1.2, 3.0, 0.7, 1.0):
        for window in range(1, 300):
            w = window_weights(torch.tensor([[[window]]]), window + 3, weight)[0, 0, 0]
            assert torch.equal(w[3:], torch.linspace(1.0, weight, window)), (weight, window)
            assert not bool(w[:3].any())


def test_pyramidinfer_schedule_in_closed_form_is_its_step_loop():
    """``generated_entries`` (the host's count of a static layer, no read) equals ``PyramidInfer.decode``'s loop: one
    entry per step, and a chunk compressed whenever gen_chunk entries beyond the frozen ones left the window."""
    from kvbench.methods.pyramidinfer import generated_entries

    for window, chunk, keep, frozen, held in [(13, 16, 14, 51, 64), (13, 16, 1, 51, 64), (5, 8, 3, 20, 25),
                                              (1, 16, 7, 0, 1), (26, 16, 2, 100, 126)]:
        entries, f = held, frozen
        for step in range(1, 200):
            entries += 1
            if entries - window - f >= chunk:
                entries, f = entries - (chunk - keep), f + keep
            assert generated_entries(window, chunk, keep, frozen, held, step) == entries, (window, step)


SIRLLM_FIELDS = [({}, 64), ({"decay_ratio": 0.9, "recent_ratio": 0.0}, 64), ({"start_size": 0}, 48),
                 ({"decay_ratio": 0.7}, 300)]


@pytest.mark.parametrize(("fields", "budget"), SIRLLM_FIELDS,
                         ids=lambda f: (",".join(f"{k}={v}" for k, v in f.items()) or "default")
                         if isinstance(f, dict) else str(f))
def test_static_sirllm_keeps_the_entries_and_entropies_of_the_default_path(toy_llama, fields, budget):
    """SirLLM evicts after each forward by its tokens' surprisal; the captured step evicts inside each layer with the
    surprisal the step before handed it (``StaticPolicy.token_logp``, written after the output head): after 40 steps
    of a left-padded batch of two every layer holds the same entries (positions) with the same decayed entropies as
    the default path's. Budget 300: the prompts fit (each row's capacity is its prompt's length)."""
    prompts = [_prompt(200, 3), _prompt(150, 4)]
    eager, eager_session = _generate(toy_llama, "sirllm", budget, False, prompts, new=40, fields=fields)
    static, static_session = _generate(toy_llama, "sirllm", budget, "eager", prompts, new=40, fields=fields)
    assert static.tokens == eager.tokens
    assert static_session._token_logp is not None
    assert static_session.stats.resident_curve == eager_session.stats.resident_curve
    for a, b in zip(_entries(eager_session, "sirllm_entropy"), _entries(static_session, "sirllm_entropy"),
                    strict=True):
        assert torch.equal(a[0], b[0]) and a[0].shape[-1] == min(budget, 200)
        torch.testing.assert_close(b[3], a[3], rtol=1e-5, atol=1e-5)
        assert bool((a[3] > 0).any())


def test_the_captured_step_hands_the_next_step_its_tokens_log_probability(toy_llama):
    """``StepBuffers.token_logp`` after a captured step is the log-softmax of that step's logits at the token it
    chose: what the host-driven path's ``TokenLogits.previous`` gives the next step."""
    from kvbench.engine.compat import cache_kwargs
    from kvbench.engine.graph import StepBuffers, decode_step

    b = Budget.parse(64)
    method = build_method({"name": "sirllm"}, b)
    seen = {}
    with CompressionSession(toy_llama, method, b, compile="eager") as session:
        greedy_generate(toy_llama, [_prompt(100)], 2, [], 0)  # prefill and the host-driven first step
        tokens = torch.tensor([[5]])
        buffers = StepBuffers(tokens.clone(), torch.tensor([[101]]), torch.zeros(1, 4, dtype=torch.long),
                              torch.zeros((), dtype=torch.long), token_logp=torch.zeros(1, 1))

        class Spy(torch.nn.Module):
            def forward(self, **kw):
                out = toy_llama(**kw)
                seen["logits"] = out.logits
                return out

        with torch.inference_mode():
            decode_step(Spy(), cache_kwargs(toy_llama, session.graph_cache()), buffers)
    logp = torch.log_softmax(seen["logits"][:, -1].float(), -1)
    assert float(buffers.token_logp) == pytest.approx(float(logp[0, buffers.tokens[0, 0]]))
    assert float(buffers.token_logp) < 0


def test_static_infllm_replays_one_graph_for_a_ratio_budgets_samples(toy_llama, capturable):
    """A ratio budget (OmniKV's Mem%) sizes InfLLM's init tokens, blocks and window per prompt: the captured step reads
    them from the layers' row state, so a job's samples of three lengths (one slot count: the job's longest prompt)
    replay one graph, and each decodes as its host-driven path does."""
    torch._dynamo.reset()
    counters.clear()
    b = Budget.parse(0.6)
    sizes = set()
    for seed, n in enumerate((300, 260, 220)):
        tokens = {}
        for compile in (False, "eager"):
            method = build_method({"name": "infllm"}, b)
            with CompressionSession(toy_llama, method, b, compile=compile, job_lengths=(300, 16)):
                tokens[compile] = greedy_generate(toy_llama, [_prompt(n, seed)], 16, [], 0).tokens
            sizes.add(method._params)
        assert tokens[False] == tokens["eager"]
    assert len(sizes) == 3  # three samples' own sizes
    assert counters["stats"]["unique_graphs"] == 1


#: the default split of budget 64 (5 init, 1 block of 32, a window of 27), explicit sizes (the budget unused), and
#: budget 96 in blocks of 16
INFLLM_FIELDS = [({}, 64), ({"n_init": 4, "n_local": 24, "topk": 2, "block_size": 8, "repr_topk": 3,
                             "exc_block_size": 16}, None), ({"block_size": 16, "repr_topk": 1}, 96)]


@pytest.mark.parametrize(("fields", "budget"), INFLLM_FIELDS,
                         ids=lambda f: (",".join(f"{k}={v}" for k, v in f.items()) or "default")
                         if isinstance(f, dict) else str(f))
def test_static_infllm_attends_and_remembers_as_the_default_path(toy_llama, fields, budget):
    """InfLLM's captured step retrieves the top blocks, attends the window and the memory at their two distances and
    forms the next block as tokens leave the window: after 60 steps each layer's memory (the blocks' representative
    keys, their count, the first unblocked position, each unblocked entry's score per query head) equals the default
    path's, with more blocks than it retrieves and blocks formed during the decode."""
    new = 60
    eager, eager_session = _generate(toy_llama, "infllm", budget or 64, False, [_prompt()], new=new, fields=fields)
    memory = {i: (m.repr.clone(), m.score.clone(), m.start) for i, m in eager_session.method._memory.items()}
    static, static_session = _generate(toy_llama, "infllm", budget or 64, "eager", [_prompt()], new=new,
                                       fields=fields)
    assert static.tokens == eager.tokens
    assert static_session.stats.attended_tokens_mean == pytest.approx(eager_session.stats.attended_tokens_mean)
    topk = static_session.method.resolve(200)[1]  # the budget's split, or the explicit topk
    for idx in sorted(static_session._layers):
        layer = static_session._layers[idx]
        reprs, scores, start = memory[idx]
        count = int(layer.row_state["infllm_blocks"])
        assert count == reprs.shape[1] > topk
        assert int(layer.row_state["infllm_start"]) == start
        torch.testing.assert_close(layer.row_state["infllm_repr"][0, :, :count], reprs, rtol=0, atol=1e-5)
        hkv, g = layer.values.shape[1], reprs.shape[0] // layer.values.shape[1]
        mine = layer.state["infllm_score"][0, :, start : start + scores.shape[1]].transpose(1, 2).reshape(hkv * g, -1)
        torch.testing.assert_close(mine, scores, rtol=1e-5, atol=1e-6)
    before = {i: m.num_blocks for i, m in static_session.method._memory.items()}  # the prompt's, left by prefill
    assert all(memory[i][0].shape[1] > before[i] for i in memory)


@pytest.mark.parametrize("factor", [2, 3])
def test_static_cla_upper_layers_attend_the_lower_layers_slots_and_hold_none(toy_llama, factor):
    """CLA's captured step: the upper layers of a group (layer 1 of the pair 0-1; layers 1 and 2 of the group of three)
    attend the lowest layer's slots, which hold the step's entry already, and have no slot of their own; a group's
    lowest layer appends (the budget is unused). The tokens and the resident bytes (the lowest layers' entries) are
    the default path's; a padded batch of two included."""
    prompts = [_prompt(120, 3), _prompt(90, 4)]
    fields = {"allow_untrained": True, "sharing_factor": factor}
    eager, eager_session = _generate(toy_llama, "cla", 64, False, prompts, new=24, fields=fields)
    static, static_session = _generate(toy_llama, "cla", 64, "eager", prompts, new=24, fields=fields)
    assert static.tokens == eager.tokens
    layers = static_session._layers
    lowest = [i for i in layers if i % factor == 0]
    for idx in layers:
        assert layers[idx].borrows == (idx not in lowest)
        assert (layers[idx].keys.shape[2] == 0 and layers[idx].resident_bytes() == 0) == (idx not in lowest)
    assert static.resident_kv_bytes_final == eager.resident_kv_bytes_final > 0
    for idx in lowest:
        valid = layers[idx].valid
        held = layers[idx].positions.masked_fill(~valid, -1).sort(-1).values[..., -(120 + 23):]
        assert torch.equal(held, eager_session._layers[idx].positions.masked_fill(
            ~eager_session._layers[idx].valid, -1)[..., -(120 + 23):])


def _pod_map(tmp_path, blocks, granularity="kv_head") -> str:
    import json

    path = tmp_path / "map.json"
    path.write_text(json.dumps({"model": "toy", "delta": 0.5, "granularity": granularity, "num_layers": 3,
                                "num_kv_heads": 2, "blocks": blocks}))
    return str(path)


#: KV head 0: layers 0-1 one block, layer 2 its own; KV head 1: layer 0 its own, layers 1-2 one block. Every layer is
#: the lowest for one head at least, so no layer drops keys: layer 1 shares layer 0's logits on head 0 and passes its
#: own up on head 1, layer 2 reads them there
POD_BLOCKS = [[[0, 1], [2]], [[0], [1, 2]]]


@pytest.mark.parametrize("fields", [{}, {"tau": 0.6}, {"prefill_mode": "full"}])
def test_static_pod_decodes_as_the_default_path(toy_llama, tmp_path, fields, capturable):
    """POD's captured step (eqs. 3-4 over the slots, the distant logits passed up through the shared logits buffer)
    generates the default path's tokens, in one graph (no recompile over 40 steps), and both paths hold every entry
    (POD frees none). The toy's greedy tokens are FullKV's too: the layer test below checks the outputs."""
    fields = {"n_s": 4, "n_r": 8, "block_map": _pod_map(tmp_path, POD_BLOCKS), **fields}
    eager, eager_session = _generate(toy_llama, "pod", 64, False, [_prompt()], new=40, fields=fields)
    torch._dynamo.reset()
    counters.clear()
    static, seen, static_session = _capture_counts(toy_llama, "pod", 64, [_prompt()], 40, fields=fields)
    assert static.tokens == eager.tokens
    assert seen[-1] == 1 and all(isinstance(layer, StaticKVLayer) for layer in static_session._layers.values())
    assert static.resident_kv_bytes_final == eager.resident_kv_bytes_final
    assert static_session.stats.resident_curve == eager_session.stats.resident_curve


@pytest.mark.parametrize("n", [40, 10])  # 10 = n_s + n_r - 2: the window reaches down to the first non-sink entry
@pytest.mark.parametrize("blocks, granularity", [(POD_BLOCKS, "kv_head"), ([[0, 1, 2]], "layer")])
def test_static_pod_attention_equals_attend_on_each_layer(toy_llama, tmp_path, blocks, granularity, n):
    """Layer by layer, the captured step's attention output equals ``POD.attend``'s (the host-driven step) on the same
    entries and query, for the heads that share (and gate, tau < 1), the ones that pass their logits up, and the
    layers that keep only the window's keys (``granularity: layer``: layers 1 and 2, keys in the ring)."""
    from kvbench.engine.cache import KVLayer
    from kvbench.engine.static import StaticKVLayer, StaticPolicy, StepSlots, static_step
    from kvbench.methods.base import DecodeContext
    from kvbench.methods.pod import POD

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, n_s, n_r = 4, 2, 16, 4, 8
    method = POD(n_s=n_s, n_r=n_r, tau=0.7, block_map=_pod_map(tmp_path, blocks, granularity))
    method._structure(3, hkv)
    shared = torch.zeros(1, hkv, hq // hkv, 1, n + 6)
    for idx in range(3):
        keys, values = torch.randn(1, hkv, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g)
        query = torch.randn(1, hq, 1, d, generator=g)
        policy = method.static_policy(64, idx)
        eager = KVLayer()
        eager.lazy_initialization(keys, values)
        if policy.key_window is not None:  # trimmed: sinks and the last n_r - 1 entries, then this step's key
            keys = torch.cat([keys[:, :, :n_s], keys[:, :, max(n_s, n - n_r) :]], dim=2)
        eager.keys, eager.values = keys, values
        eager.positions = torch.arange(n).view(1, 1, n).expand(1, hkv, n).clone()
        eager.seen = n
        static = StaticKVLayer.from_layer(eager, 6, key_window=policy.key_window)
        assert static.keys.shape[2] == (n_s + n_r if policy.key_window else n + 6)
        ctx = DecodeContext(layer_idx=idx, num_layers=3, num_kv_heads=hkv, query=query, probs=None,
                            capacity=torch.tensor([64]), scaling=d**-0.5)
        want = method.attend(eager, ctx)  # (B, 1, Hq, D), or None: the engine's standard attention
        assert (want is None) == (policy.attention is None)
        if want is None:
            continue
        slots = StepSlots(static.keys, static.values, static.positions, static.valid, None,
                          torch.tensor([[[64]]]), {}, None, query, d**-0.5, None, shared=shared)
        got, _ = static_step(slots, policy)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert (policy.key_window is not None) == (granularity == "layer" and idx > 0)
        if policy.key_window is None and n > n_s + n_r:  # (no distant entry at 10: standard attention)
            plain, _ = static_step(slots, StaticPolicy())  # standard attention over the same slots
            shares = not all(policy.params[2])
            assert shares == (idx > 0) and (not torch.allclose(got, plain, atol=1e-3)) == shares
    assert method.gated > 0


@pytest.mark.parametrize("blocks, granularity", [([[0, 1, 2]], "layer"), ([[[0, 1, 2]], [[0, 1], [2]]], "kv_head")])
def test_static_pod_keeps_only_the_windows_keys_where_the_map_trims(toy_llama, tmp_path, blocks, granularity,
                                                                     capturable):
    """A layer that is non-lowest for every KV head keeps keys for its n_s sinks and last n_r - 1 entries (values for
    all): its static layer holds them in a ring of n_s + n_r key slots (StaticPolicy.key_window), the step's key
    overwriting the one that left the window. The captured step generates the default path's tokens in one graph,
    with the same resident bytes after prefill and at every step (the trimmed keys stay freed)."""
    n_s, n_r = 4, 8
    fields = {"n_s": n_s, "n_r": n_r, "block_map": _pod_map(tmp_path, blocks, granularity)}
    eager, eager_session = _generate(toy_llama, "pod", 64, False, [_prompt()], new=40, fields=fields)
    torch._dynamo.reset()
    counters.clear()
    static, seen, static_session = _capture_counts(toy_llama, "pod", 64, [_prompt()], 40, fields=fields)
    assert static.tokens == eager.tokens and seen[-1] == 1
    trimmed = [1, 2] if granularity == "layer" else [1]
    for idx, layer in static_session._layers.items():
        assert layer.keys.shape[2] == (n_s + n_r if idx in trimmed else layer.values.shape[2])
    assert static.resident_kv_bytes_final == eager.resident_kv_bytes_final
    assert static_session.stats.resident_kv_bytes_after_prefill == eager_session.stats.resident_kv_bytes_after_prefill
    assert static_session.stats.resident_curve == eager_session.stats.resident_curve
    for idx in trimmed:  # the ring holds the keys the host-driven layer kept, each at its entry's slot
        held, ring = eager_session._layers[idx], static_session._layers[idx]
        total = held.values.shape[2]
        ids = list(range(n_s)) + list(range(total - (n_r - 1), total))
        assert held.keys.shape[2] == len(ids)
        slots = [j if j < n_s else n_s + (j - n_s) % n_r for j in ids]
        torch.testing.assert_close(ring.keys[:, :, slots], held.keys, rtol=0, atol=1e-5)
    entry = 16 * 4  # one key or value: head_dim 16, float32
    full = 3 * 2 * (200 + 39) * 2 * entry
    assert static.resident_kv_bytes_final == full - len(trimmed) * 2 * (200 + 39 - n_s - (n_r - 1)) * entry


@pytest.mark.parametrize("fields", [{"variant": "official_code", "bug_compat": True},
                                    {"variant": "official_code", "carry_tau": True, "granularity": "query_head"}],
                         ids=["bug_compat", "carry_tau"])
def test_static_d2o_carries_its_thresholds_into_the_next_sample(toy_llama, monkeypatch, capturable, fields):
    """``bug_compat=true`` (official code: each layer's EMA threshold outlives the sample, ``carry_tau``): three samples
    in one session. The captured path reads the chosen ids after every step (no step past the end: the threshold is
    the last step's), and hands the layers back at the end (``Method.after_generation``); each sample's tokens, held
    entries and the thresholds carried into the next equal the host-driven path's. A sample ending at EOS (the second:
    its eos is a token the default path generates) too."""
    prompts = [_prompt(200, 3), _prompt(150, 4), _prompt(180, 5)]
    b = Budget.parse(64)

    def run(compile, eos_second):
        method = build_method(_fields(toy_llama, "d2o", fields), b)
        outs, taus = [], []
        with CompressionSession(toy_llama, method, b, compile=compile) as session:
            for i, prompt in enumerate(prompts):
                outs.append(greedy_generate(toy_llama, [prompt], 40, eos_second if i == 1 else [], 0))
                taus.append({k: v.clone() for k, v in method._carried_tau.items()})
                if i == 1:
                    entries = _entries(session)
        return outs, taus, entries, session

    unstopped = run(False, [])[0][1].tokens[0]
    eos = unstopped[-1]  # the second sample stops at the first time it generates its 40th token
    eager, eager_taus, eager_entries, _ = run(False, [eos])
    assert len(eager[1].tokens[0]) == unstopped.index(eos) < 39
    reads = []
    real = graph.captured_generate
    monkeypatch.setattr(graph, "captured_generate", lambda *a, **k: reads.append(k.get("read_every")) or real(*a, **k))
    static, static_taus, static_entries, session = run("eager", [eos])
    assert reads == [1, 1, 1] and session.method.keeps_state_after_generation()
    assert [o.tokens for o in static] == [o.tokens for o in eager]
    for a, c in zip(eager_taus, static_taus, strict=True):
        assert a.keys() == c.keys()
        for key in a:
            torch.testing.assert_close(c[key], a[key], rtol=0, atol=1e-9, equal_nan=True)
    # keep_edge_layers (bug_compat) leaves the toy's 3 layers uncompressed: no threshold; without it every layer merges
    assert len(eager_taus[-1]) == (0 if fields.get("bug_compat") else 3)
    for a, c in zip(eager_entries, static_entries, strict=True):
        assert torch.equal(a[0], c[0])
        torch.testing.assert_close(c[2], a[2], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("selector", "reading"), [("last", None), ("softmax_before_last", None),
                                                  ("uniform", "official_code"), ("exp", "official_code"),
                                                  ("exp", "paper")])
def test_static_omnikv_selects_the_default_paths_tokens(toy_llama, selector, reading, monkeypatch):
    """OmniKV's tokens on the toy model are FullKV's, so the check is the selection itself: after every decode step the
    filter layer's choice of prompt slots (those its sparse layers attend to) equals the default path's; the window
    selectors' first 16 steps hold prompt queries in their window (the official reading forces their tokens)."""
    monkeypatch.setattr(graph, "READ_EVERY", 1)  # the selection read after every step, captured ones included
    chosen = {}
    for compile in (False, "eager"):
        b = Budget.parse(64)
        method = build_method({"name": "omnikv", "filter_layers": [0], "selector": selector,
                               **({"window_reading": reading} if reading else {})}, b)
        steps = chosen[compile] = []
        with CompressionSession(toy_llama, method, b, compile=compile) as session:
            def after_each_step(row, tokens, session=session, steps=steps, static=bool(compile)):
                if static:
                    steps.append(session._chosen[0][0, 0].nonzero()[:, 0].tolist())
                else:
                    steps.append(session.method._selection[0][0].tolist() if session.method._selection else [])
                return False

            greedy_generate(toy_llama, [_prompt()], 17, [], 0, after_each_step)
    assert len(chosen[False]) == 17 and all(len(c) == 64 for c in chosen[False][1:])
    assert chosen["eager"][1:] == chosen[False][1:]


NO_STATIC = [("sirllm", {"entropy": "official_code"}),
             ("omnikv", {"filter_layers": [0], "offload": "always"})]  # a context bank on the host


def test_every_method_without_a_static_step_says_why_in_its_own_words():
    """A method that can decode host-driven only overrides ``static_refusal`` with its own reason (the line
    ``engine.decode=graph`` refuses with and docs/efficiency.md's generated table shows), for its default
    configuration and for the readings listed in NO_STATIC; the contract's fallback text is never what a user reads."""
    from pathlib import Path

    from kvbench.methods import METHODS, Method
    from kvbench.report.readme import method_conf

    root = Path(__file__).resolve().parents[1]
    configs = [(name, method_conf(name, root)) for name in METHODS.entries]
    without = []
    for name, fields in configs + NO_STATIC:
        m = METHODS.build(name, fields)
        if not m.has_static_step():
            without.append(name)
            assert type(m).static_refusal is not Method.static_refusal, f"{name}: no static_refusal of its own"
            assert m.static_refusal() != Method.static_refusal(m) and "\n" not in m.static_refusal()
    assert {"sirllm", "offload"} <= set(without)  # sirllm: entropy=official_code


@pytest.mark.parametrize(("method", "fields"), NO_STATIC, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items() if k != "filter_layers") or "-")
def test_methods_without_a_static_step_are_refused(toy_llama, method, fields):
    """Each listed in the README's engine.compile paragraph with the reason, which the refusal gives."""
    b = Budget.parse(64)
    m = build_method({"name": method, **fields}, b)
    assert m.static_policy(64) is None
    with pytest.raises(ConfigError, match="engine.compile=true: method") as refused:
        with CompressionSession(toy_llama, m, b, compile="eager"):
            pass
    assert m.static_refusal() in str(refused.value)


@pytest.mark.parametrize("method", ["fullkv", "h2o", "quest", "kvzip", "adakv"])
def test_the_steps_run_past_the_end_are_not_the_generations(toy_llama, method):
    """The captured loop reads the chosen ids every 16 steps, so it runs up to 15 decode steps past the step where
    every row ended (their ids are dropped, and the timing counts them: they ran). The memory a record reports is the
    generation's: the resident curve and the final bytes stop where the host-driven path stopped, and so do the
    entries attended per step (the steps run past the end are taken back from the sums). A layer made from a ragged
    one (KVzip's, AdaKV's heads of their own lengths) counts its heads' entries: it reported the ones the steps past
    the end wrote too (KVzip: 62,208 bytes where the generation held 53,760)."""
    from helpers import ByteTokenizer

    b = Budget.parse(None if method == "fullkv" else 64)
    free, _ = _generate(toy_llama, method, b.label(), False, [_prompt()], new=40)
    tokens = free.tokens[0]
    eos = next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])  # ends the row at step 5 or later
    runs = {}
    for compile in (False, "eager"):
        m = build_method({"name": method}, b)
        tokenizer = ByteTokenizer() if m.needs_reconstruction else None
        with CompressionSession(toy_llama, m, b, compile=compile, tokenizer=tokenizer) as session:
            out = greedy_generate(toy_llama, [_prompt()], 40, [eos], 0)
        runs[compile] = (out, session.stats.resident_curve, session.stats.attended_tokens_mean,
                         session.stats.decode_layer_calls)
    (eager, eager_curve, eager_attended, eager_calls), (captured, captured_curve, attended, calls) = \
        runs[False], runs["eager"]
    assert captured.tokens == eager.tokens and len(eager.tokens[0]) < 20
    if graph.STATUS.get("captured"):  # (torch 2.6 with transformers 5.6 runs the step uncompiled: nothing runs past)
        assert captured.decode_steps > eager.decode_steps
    assert captured_curve == eager_curve
    assert captured.resident_kv_bytes_final == eager.resident_kv_bytes_final
    assert calls == eager_calls and attended == pytest.approx(eager_attended)


@pytest.mark.parametrize(("method", "budget"), [("fullkv", None), ("snapkv", "180"), ("adakv", "180")])
def test_a_buckets_extra_rows_are_not_the_batchs(toy_llama, method, budget):
    """Three rows run at the batch bucket of four, its extra row a copy of the last one: the entries attended per step
    are the three rows' mean, as the host-driven path counts them, not the bucket's (FullKV's rows of 200, 163 and
    126 tokens reported 165.4 entries for 175.0, SnapKV's and AdaKV's at 180, where the shortest row is held whole,
    160.3 for 168.0 and 167.0). The tokens, curve and bytes were the batch's already."""
    b = Budget.parse(budget)
    prompts = [_prompt(200, 1), _prompt(163, 2), _prompt(126, 3)]
    runs = {}
    for compile in (False, "eager"):
        with CompressionSession(toy_llama, build_method({"name": method}, b), b, compile=compile) as session:
            out = greedy_generate(toy_llama, prompts, 24, [], 0)
        runs[compile] = (out.tokens, out.resident_kv_bytes_final, session.stats.resident_curve,
                         session.stats.attended_tokens_mean, session.stats.decode_layer_calls)
    assert runs["eager"] == runs[False]


def _amplified(family: str):
    """A tiny ``family`` model whose soft-cap (Gemma 2) and sink logits (GPT-OSS) move the attention visibly: the
    random toy's logits are so small that a step without them parts from the model only in the fourth decimal."""
    from helpers import tiny_family

    model = tiny_family(family)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "attn_logit_softcapping", None):
                module.attn_logit_softcapping = 2.0
                module.q_proj.weight.mul_(40)
            if getattr(module, "sinks", None) is not None:
                module.sinks.mul_(3).add_(3)
    return model



def test_the_static_step_applies_the_layers_softcap_and_sinks():
    """A layer's logit soft-cap (Gemma 2) and per-head sink logits (GPT-OSS) enter the captured step's attention and
    the probabilities a method accumulates, as the host-driven path's ``grouped_attention`` applies them. Before, the
    step dropped both (a GPT-OSS model's captured tokens parted from the default path's)."""
    from kvbench.engine.attention import grouped_attention
    from kvbench.engine.static import StaticPolicy, StepSlots, static_step

    g = torch.Generator().manual_seed(0)
    b, hkv, group, c, d = 2, 2, 2, 20, 8
    keys, values = torch.randn(b, hkv, c, d, generator=g), torch.randn(b, hkv, c, d, generator=g)
    query = 3 * torch.randn(b, hkv * group, 1, d, generator=g)  # logits of several units: the soft-cap bites
    valid = torch.rand(b, hkv, c, generator=g) > 0.3
    sinks = torch.randn(hkv * group, generator=g) + 2
    for softcap, sink in [(2.0, None), (None, sinks), (1.5, sinks)]:
        expected, probs = grouped_attention(query, keys, values, valid.unsqueeze(2), 0.5, softcap, sink)
        for policy in (StaticPolicy(), StaticPolicy(accumulate=True)):
            acc = torch.zeros(b, hkv, c)
            slots = StepSlots(keys, values, torch.arange(c).expand(b, hkv, c), valid.clone(), acc,
                              torch.full((b, 1, 1), c), {}, None, query, 0.5, None, None, softcap, sink)
            out, _ = static_step(slots, policy)
            torch.testing.assert_close(out, expected)
            if policy.accumulate:
                torch.testing.assert_close(acc, probs.sum(3).mean(2))


#: a step of each kind: appending, accumulating and evicting, a merge, a page choice, pruned key channels, a decode
#: compression between captured blocks, a method's own statistics, heads of their own lengths after scoring forwards
OTHER_FAMILY_METHODS = ("fullkv", "h2o", "tova", "d2o", "quest", "think", "rkv", "kvzip")


@pytest.mark.parametrize(("family", "methods"), [("gemma2", OTHER_FAMILY_METHODS), ("gpt_oss", OTHER_FAMILY_METHODS),
                                                 ("mistral", ("fullkv",))])
def test_the_captured_step_decodes_as_the_default_path_on_other_families(family, methods, capturable):
    """Gemma 2 (soft-cap, alternating windows), GPT-OSS (sinks, alternating windows) and Mistral (every layer slides:
    FullKV keeps each layer's window; a method inside the windows is refused, test_decode_mode): the captured step's
    tokens, bytes and resident curve are the host-driven path's, for a step of each kind. The toys' soft-cap and sinks
    are made large enough to matter."""
    model = _amplified(family)
    for method in methods:
        budget = None if method == "fullkv" else 64
        eager, eager_session = _generate(model, method, budget, False, [_prompt(300)], new=24)
        static, static_session = _generate(model, method, budget, "eager", [_prompt(300)], new=24)
        assert static.tokens == eager.tokens, method
        assert static.resident_kv_bytes_final == eager.resident_kv_bytes_final, method
        assert static_session.stats.resident_curve == eager_session.stats.resident_curve, method


@pytest.mark.parametrize("fields", [{}, {"sink_size": 40, "recent_ratio": 0.1, "exclude_last": 2},
                                    {"variant": "easykv"}], ids=["default", "sinks", "easykv"])
def test_static_roco_leaves_the_cache_of_the_default_path(toy_llama, fields):
    """RoCo's captured step (its three statistics per slot, the victim by its pool over the slots in position order,
    the pool's size from each row's capacity on the device) keeps, after 40 evicting steps, the entries the default
    path keeps in every layer and head, with the same attention sums, squares and counts."""
    from kvbench.methods.roco import STATS

    def held(session):
        out = []
        for idx in sorted(session._layers):
            layer = session._layers[idx]
            valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
            order = torch.argsort(layer.positions.masked_fill(~valid, 1 << 40), dim=-1)[..., : int(valid.sum(-1).max())]
            out.append([torch.gather(layer.positions, -1, order)] +
                       [torch.gather(layer.state[name], -1, order) for name in STATS])
        return out

    eager, eager_session = _generate(toy_llama, "roco", 64, False, [_prompt()], new=41, fields=fields)
    static, static_session = _generate(toy_llama, "roco", 64, "eager", [_prompt()], new=41, fields=fields)
    assert static.tokens == eager.tokens
    for a, b in zip(held(eager_session), held(static_session), strict=True):
        assert torch.equal(a[0], b[0])
        for x, y in zip(a[1:], b[1:]):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("ratio", "sinks", "exclude_last"), [(0.3, 0, 10), (0.1, 6, 2), (0.5, 3, 0)])
def test_roco_static_victim_is_roco_victims_over_the_slots(ratio, sinks, exclude_last):
    """The captured step's victim is ``roco_victims``' over the entries in position order, whatever slots hold them
    (shuffled, with empty slots among them), for every pool size, sink count and excluded tail: random statistics,
    where the toy model's attention never reaches the sinks or the pool's edge."""
    from kvbench.engine.static import StepSlots
    from kvbench.methods.roco import STATS, RoCo, roco_victims, static_evict

    g = torch.Generator().manual_seed(int(ratio * 10) + sinks)
    b, h, c = 1, 2, 30
    policy = RoCo(recent_ratio=ratio, sink_size=sinks, exclude_last=exclude_last).static_policy(24)
    for _ in range(10):
        valid = torch.ones(b, h, c, dtype=torch.bool)
        valid[..., torch.randperm(c, generator=g)[:5]] = False  # 25 held, 5 empty slots
        positions = torch.stack([torch.randperm(c, generator=g) for _ in range(h)]).unsqueeze(0)
        state = {"roco_sum": torch.rand(b, h, c, generator=g), "roco_sq": torch.rand(b, h, c, generator=g) * 0.1,
                 "roco_count": torch.randint(1, 9, (b, h, c), generator=g).float()}
        before = {k: v.clone() for k, v in state.items()}
        capacity = torch.full((b, 1, 1), 24)
        slots = StepSlots(None, None, positions, valid.clone(), None, capacity, {}, None, None, 1.0, None, state=state)
        static_evict(slots, torch.zeros(b, h, 1, 1, c), policy)
        order = torch.argsort(positions.masked_fill(~valid, 1 << 40), dim=-1)[..., :25]
        stats = [torch.gather(before[n] + (valid.float() if n == "roco_count" else 0), -1, order) for n in STATS]
        pool = max(24 - int(24 * ratio) - sinks, 1)
        expected = torch.gather(order, -1, roco_victims(*stats, 1, pool, exclude_last, sinks))
        assert torch.equal(valid & ~slots.valid, torch.zeros_like(valid).scatter_(-1, expected, True))
