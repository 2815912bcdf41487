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
           "rkv_position": {"name": "rkv", "window": 4, "cache_order": "position"}}


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


def _prompt(n, seed=1, high=250):
    return torch.randint(3, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("rows", [1, 2])
def test_toy_graph_equals_eager(toy_llama, name, rows):
    prompts = [_prompt(90), _prompt(70, 2)][:rows]
    eager, eager_session = _run(toy_llama, name, 48, False, prompts, 70, 8, query_buffer=6)
    captured, session = _run(toy_llama, name, 48, "eager", prompts, 70, 8, query_buffer=6)
    assert session._captured_compression is not None and graph.STATUS.get("captured") is not False
    assert captured.tokens == eager.tokens
    assert session.stats.resident_curve == eager_session.stats.resident_curve
    assert _kept(session) == _kept(eager_session)
    assert session._decode_compressor.compressions == eager_session._decode_compressor.compressions
