"""The captured decode step moves no copy of its cache (issue #36 item 1: the floor is every weight and the cache read
once per step; "nothing copied into or out of the graph per step").

A decode step on a GPU is bound by the bytes it moves. Inductor compiles a write into a graph input in place only
where its reinplace pass re-places the functional write: ``index_put`` is re-placed, ``scatter`` is not. A cache
written with ``scatter_`` (kvbench until this test) became, in every layer of every step, a copy of the whole key and
value buffers, the one-entry scatter into the copies, attention over the copies and a copy back: four passes over the
cache besides attention's one (FullKV at 8k and batch 16: about 68 GB more per step than its 17 GB of KV). The same
happens where inductor's ``reorder_for_locality`` moves a read of a buffer after a method's write into it (D2O's and
CaM's merges write the values attention read): ``engine.graph.inductor_options`` turns that pass off.

Whether a write is re-placed is decided before any kernel is generated, by passes that do not depend on the device
(functionalization, the post-grad passes, inductor's lowering and scheduler), so this runs inductor on the CPU up to
its code generation (no C++ is compiled) and reads what the generated code would allocate: no buffer that copies a
buffer the step writes. The check is shown to find the copies of the ``scatter_`` write and of the reordered graph.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from test_static_decode import STATIC, _fields, _prompt

from helpers import ByteTokenizer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, graph, greedy_generate, static
from kvbench.methods import build_method

pytestmark = pytest.mark.compat

inductor_graph = pytest.importorskip("torch._inductor.graph")
import torch._functorch.config  # noqa: E402  (the caches the check turns off)
import torch._inductor.config  # noqa: E402

WRITES = ("index_put", "scatter", "copy")  # the origins of a buffer that holds a written copy of another


class _Generated(Exception):
    """Raised after inductor's code generation, before anything is compiled or run."""


def _uncached() -> contextlib.ExitStack:
    """Inductor's graph caches off: a graph compiled before (by another test, an earlier run) is loaded from them,
    not generated."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    try:
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    except (AttributeError, KeyError):  # (a torch without AOT autograd's cache)
        pass
    return stack


def _copies(monkeypatch, model, name: str, budget, prompts: list[list[int]]) -> tuple[list[dict], int]:
    """The step's graphs as inductor generates them: for each, the buffers the generated code would allocate with the
    shape of a graph input the step writes (a cache layer's keys, values, validity, positions, statistics) and made by
    a write. Returns them and how many written inputs the graphs have."""
    reports: list[dict] = []
    original = inductor_graph.GraphLowering.codegen

    def codegen(self, *args, **kwargs):
        original(self, *args, **kwargs)  # the code is generated (buffers final), nothing compiled yet
        written = {n: tuple(self.graph_inputs[n].get_size()) for n in self.mutated_inputs if n in self.graph_inputs}
        copies = []
        for buf_name, buf in self.name_to_buffer.items():
            layout = type(getattr(buf, "layout", None)).__name__
            if buf_name in self.removed_buffers or buf_name in self.graph_inputs or "Mutation" in layout \
                    or layout in ("NoneLayout", "MultiOutputLayout", "NoneType"):
                continue  # not allocated: an in-place write's alias, a kernel-local value, a multi-output tuple
            made_by = sorted({str(o.target) for o in getattr(buf, "origins", ()) if any(w in str(o.target)
                                                                                       for w in WRITES)})
            shape = tuple(buf.get_size())
            if made_by and shape in written.values() and (len(shape) == 4 or "index_put" in " ".join(made_by)):
                copies.append({"buffer": buf_name, "shape": shape, "made_by": made_by})
        reports.append({"written": len(written), "copies": copies})
        raise _Generated

    monkeypatch.setattr(inductor_graph.GraphLowering, "codegen", codegen)
    b = Budget.parse(budget)
    method = build_method(_fields(model, name, None), b)
    tokenizer = ByteTokenizer() if method.needs_reconstruction else None
    torch._dynamo.reset()  # (a graph of the same shapes compiled before would be reused, not generated)
    limit = sys.getrecursionlimit()
    try:
        with _uncached(), CompressionSession(model, method, b, compile=True, tokenizer=tokenizer):
            greedy_generate(model, prompts, 8, [], 0)
    except Exception:  # inductor wraps the sentinel in its own error
        if not reports:
            raise
    finally:
        torch._dynamo.reset()
        sys.setrecursionlimit(limit)  # (inductor raises it to 2000 when it compiles; the next test gets it back)
    if not reports and graph.STATUS.get("captured") is False:  # torch 2.6 with transformers 5.6: not traced whole
        pytest.skip(f"dynamo cannot trace this model's forward whole here: {graph.STATUS.get('refused')}")
    assert reports, "no graph was generated"
    return [c for r in reports for c in r["copies"]], sum(r["written"] for r in reports)


@pytest.mark.parametrize("method", STATIC)
def test_no_methods_step_copies_a_buffer_it_writes(toy_llama, monkeypatch, method):
    """Every method with a captured step, at batch 1: the step writes its cache buffers in place (keys, values,
    positions and validity at the new entry, the method's statistics, its evictions and merges)."""
    copies, written = _copies(monkeypatch, toy_llama, method, None if method == "fullkv" else 64, [_prompt()])
    assert written >= 4 * 3  # keys, values, positions, validity of 3 layers: the check has writes to look at
    assert copies == []


@pytest.mark.parametrize("method", ["fullkv", "h2o", "d2o", "snapkv"])
def test_a_padded_batch_copies_nothing_either(toy_llama, monkeypatch, method):
    """Three left-padded rows in the bucket of four (per-row positions, the rows' entries-attended count)."""
    prompts = [_prompt(200, 3), _prompt(150, 4), _prompt(180, 5)]
    copies, _ = _copies(monkeypatch, toy_llama, method, None if method == "fullkv" else 64, prompts)
    assert copies == []


def test_the_check_finds_the_copies_of_a_scatter_write(toy_llama, monkeypatch):
    """The cache written with ``scatter_`` (kvbench before this test): every layer's keys and values copied."""
    def scatter_slots(buffer, slot, value, accumulate=False):
        index = slot.view(*slot.shape, *[1] * (buffer.dim() - 3)).expand(*slot.shape, *buffer.shape[3:])
        value = value.expand(index.shape)
        buffer.scatter_add_(2, index, value) if accumulate else buffer.scatter_(2, index, value)

    monkeypatch.setattr(static, "put_slots", scatter_slots)
    copies, _ = _copies(monkeypatch, toy_llama, "fullkv", None, [_prompt()])
    assert len([c for c in copies if len(c["shape"]) == 4]) >= 2 * 3, copies  # keys and values of 3 layers


def test_the_check_finds_the_copy_of_a_reordered_merge(toy_llama, monkeypatch):
    """With inductor's ``reorder_for_locality`` (the pass ``engine.graph.inductor_options`` turns off), D2O's merge
    into the values its attention read gets a copy of the values."""
    real = graph.inductor_options
    monkeypatch.setattr(graph, "inductor_options", lambda mode: {**real(mode), "reorder_for_locality": True})
    graph.compiled_decode_step.cache_clear()
    try:
        copies, _ = _copies(monkeypatch, toy_llama, "d2o", 64, [_prompt()])
    finally:
        graph.compiled_decode_step.cache_clear()
    assert any(len(c["shape"]) == 4 for c in copies), copies


def test_a_gpu_compiles_the_step_with_cuda_graphs_and_without_the_reorder():
    """On CUDA the session asks for ``reduce-overhead`` (CUDA graphs): its options, with the reorder pass off."""
    options = graph.inductor_options("reduce-overhead")
    assert options["triton.cudagraphs"] is True and options["reorder_for_locality"] is False
    assert graph.inductor_options(None) == {"reorder_for_locality": False}  # the CPU's: inductor's defaults but one
