"""What inductor checks before it records a CUDA graph of the captured decode step, run on the CPU (issue #36 items 1
and 3: one graph per step, static addresses, no host read).

On a GPU, ``torch.compile(mode="reduce-overhead")`` compiles the step with inductor and then either records it as a
CUDA graph or logs "skipping cudagraphs due to ..." and runs it as kernels launched one by one (the per-layer step of
kvbench 1cc1e90 did, for its mutated inputs: 34.9 ms per token where the eager path took 25.9). Whether it records is
decided on the traced graph, before any kernel runs, by inductor's own predicates; this file runs them on the CPU,
on the graph inductor would be given (dynamo's graph through AOT autograd with inductor's decompositions and its
input mutations kept in the graph, as ``compile_fx`` traces it):

* a mutated input that is not a static input (a parameter, or a tensor marked with ``mark_static_address``): the
  CUDA graph would read and write a copy of it, which cudagraph trees refuse ("mutated inputs");
* an op that ``get_first_incompatible_cudagraph_node`` names (a host sync, an op of data-dependent output size, an
  index_put with a boolean index: "incompatible op");
* a symbolic-shape input ("graph with symbolic shapes inputs");
* control flow (``torch.cond``, ``while_loop``: inductor disables CUDA graphs for them).

Every method with a captured step, at batch 1; a padded batch of three rows in the bucket of four; a sampled
generation; compression during decode (every method that runs it captured); every architecture family's FullKV, and
H2O where it compresses (sliding windows, soft-caps, sink logits, QK norms). A GPU would still decide on the devices
(a CPU tensor in the graph: ``tests/test_static_decode.py`` pins that every tensor the step creates names its device,
at dynamo's level: once traced, a device is a constant, and on the CPU the model's device and a factory's default are
both ``cpu``). The check itself is shown to fail where the step's buffers are not marked (the per-layer step's
defect).
"""

from __future__ import annotations

import pytest
import torch
from test_decode_compression_graph import METHODS as DECODING
from test_static_decode import STATIC, _fields, _prompt

from helpers import FAMILIES, ByteTokenizer, tiny_family
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, graph, greedy_generate
from kvbench.engine.sampling import Sampling
from kvbench.methods import build_method

pytestmark = pytest.mark.compat

inductor_utils = pytest.importorskip("torch._inductor.utils")
if not hasattr(inductor_utils, "get_first_incompatible_cudagraph_node"):  # (torch < 2.7: CI's lowest leg)
    pytest.skip("this torch has no get_first_incompatible_cudagraph_node", allow_module_level=True)

CONTROL_FLOW = {"cond", "while_loop"}


def _inductors_view(reports: list):
    """A dynamo backend that traces the graph as inductor's ``compile_fx`` does (AOT autograd, inductor's
    decompositions, input mutations kept) and reports inductor's reasons to skip CUDA graphs for it; then runs it
    uncompiled."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.decomposition import select_decomp_table

    def inspect(gm: torch.fx.GraphModule, inputs: list):
        meta = torch._guards.TracingContext.try_get().fw_metadata
        static = set(meta.static_input_indices)
        mutated = {i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata}
        incompatible = inductor_utils.get_first_incompatible_cudagraph_node(gm)
        control = [str(n.target) for n in gm.graph.nodes if getattr(n.target, "__name__", "") in CONTROL_FLOW]
        reports.append({
            "mutated_not_static": sorted(mutated - static),
            "mutated": len(mutated),
            "incompatible": None if incompatible is None else str(incompatible.target),
            "symbolic": inductor_utils.any_is_symbolic(*inputs),
            "control_flow": control,
        })
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=inspect, decompositions=select_decomp_table(), keep_inference_input_mutations=True)


def _reports(model, fields: dict, budget, prompts, new=20, sampling=None, tokenizer=None) -> list[dict]:
    reports: list[dict] = []
    b = Budget.parse(budget)
    method = build_method(fields, b)
    torch._dynamo.reset()  # a graph of the same shapes compiled by another backend would be reused, not inspected
    seeds = list(range(len(prompts))) if sampling is not None else None
    with CompressionSession(model, method, b, compile=_inductors_view(reports), tokenizer=tokenizer):
        greedy_generate(model, prompts, new, [], 0, sampling=sampling, seeds=seeds)
    if graph.STATUS.get("captured") is False:  # torch 2.6 with transformers 5.6: nothing is traced to inspect
        pytest.skip(f"dynamo cannot trace this model's forward whole here: {graph.STATUS.get('refused')}")
    return reports


def _assert_cudagraph_safe(reports: list[dict]) -> None:
    assert len(reports) == 1  # one graph for the generation's captured steps
    r = reports[0]
    assert r["mutated"] > 0  # (the step writes its cache and buffers: the check has something to check)
    assert r == {**r, "mutated_not_static": [], "incompatible": None, "symbolic": False, "control_flow": []}, r


def test_the_check_finds_a_step_whose_buffers_are_not_static(toy_llama, monkeypatch):
    """Without ``mark_static_address`` on the cache and step buffers, the same step's writes are mutated inputs that
    are not static: the reason inductor gave for the per-layer step ("skipping cudagraphs due to mutated inputs")."""
    monkeypatch.setattr(graph, "mark_static", lambda tensors: None)
    reports = _reports(toy_llama, {"name": "h2o"}, 64, [_prompt()])
    assert len(reports) == 1 and len(reports[0]["mutated_not_static"]) >= 10, reports


@pytest.mark.parametrize("method", STATIC)
def test_every_methods_step_is_one_cuda_graph_for_inductor(toy_llama, method):
    fields = _fields(toy_llama, method, None)
    budget = None if method == "fullkv" else 64
    tokenizer = ByteTokenizer() if build_method(fields, Budget.parse(budget)).needs_reconstruction else None
    _assert_cudagraph_safe(_reports(toy_llama, fields, budget, [_prompt()], tokenizer=tokenizer))


@pytest.mark.parametrize("method", ["snapkv", "h2o", "d2o", "adakv", "quest"])
def test_a_padded_batch_in_its_bucket_is_one_cuda_graph(toy_llama, method):
    """Three left-padded rows run at the bucket of four (per-row positions and validity, a repeated fourth row)."""
    prompts = [_prompt(200, 3), _prompt(150, 4), _prompt(180, 5)]
    _assert_cudagraph_safe(_reports(toy_llama, _fields(toy_llama, method, None), 64, prompts))


def test_a_sampled_step_is_one_cuda_graph(toy_llama):
    """The step reads its column of the uniforms the host wrote before the block and chooses on the device."""
    reports = _reports(toy_llama, {"name": "tova"}, 64, [_prompt(), _prompt(150, 2)], sampling=Sampling(0.6, 0.95, 20))
    _assert_cudagraph_safe(reports)


@pytest.mark.parametrize("method", sorted(DECODING))
def test_a_step_that_feeds_compression_during_decode_is_one_cuda_graph(toy_llama, method):
    """The step appends and writes its query into the ring the host's compression between blocks reads: every
    method that compresses during decode in a form the captured step runs (AdaKV: its padded layout)."""
    fields = {"name": method, **DECODING[method], "decode_compression": {"interval": 8, "query_buffer": 6}}
    _assert_cudagraph_safe(_reports(toy_llama, fields, 48, [_prompt(90)], new=30))


#: families whose full-attention layers a method compresses (Qwen3's QK norms; the others beside sliding layers); on
#: Phi-3 and Mistral every layer slides, and ``engine.decode=graph`` refuses a method inside the windows (Llama's H2O
#: is the toy's, above)
COMPRESSED = ("qwen3", "qwen2", "gemma2", "gemma3", "gpt_oss")


@pytest.mark.parametrize(("family", "method"), [(f, "fullkv") for f in FAMILIES]
                         + [(f, "h2o") for f in COMPRESSED])
def test_every_familys_step_is_one_cuda_graph(family, method):
    """Every architecture kvbench accepts (sliding windows, soft-caps, sink logits, QK norms), 300-token prompts
    beyond the window."""
    model = tiny_family(family)
    _assert_cudagraph_safe(_reports(model, {"name": method}, None if method == "fullkv" else 64, [_prompt(300)]))
