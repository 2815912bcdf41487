"""Brutal Offload: which layers go to host memory and when each copy is issued (as data), the bookkeeping through
the engine with a synchronous stand-in for the CUDA transport (outputs equal FullKV), and the refusals on CPU."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from kvbench.budget import Budget
from kvbench.config import CONF_DIR, register_resolvers
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.jobs import plan_job
from kvbench.methods import build_method
from kvbench.methods.offload import BrutalOffload


def test_offloaded_layers_and_prefetch_schedule():
    method = BrutalOffload()
    assert method.offloaded_layers(32) == list(range(12, 32))  # the code: offload_sid = 12 of 32, the last 20
    assert method.prefetch_schedule(32) == {layer: [layer + 4] for layer in range(8, 28)}
    assert method.offloaded_layers(30) == list(range(11, 30))  # round(0.375 * 30) = 11 (SmolLM2)
    early = BrutalOffload(offload_start=2, prefetch_ahead=4)
    assert early.prefetch_schedule(8) == {0: [2, 3, 4], 1: [5], 2: [6], 3: [7]}
    with pytest.raises(ConfigError, match="offload_start=40 is not a layer"):
        BrutalOffload(offload_start=40).offloaded_layers(32)
    for bad in (1.5, -1, "x", True):
        with pytest.raises(ConfigError, match="offload_start"):
            BrutalOffload(offload_start=bad)
    with pytest.raises(ConfigError, match="prefetch_ahead=0"):
        BrutalOffload(prefetch_ahead=0)


class SyncTransport:
    """Stands in for CudaTransport on CPU: copies, and a log of what was moved when."""

    def __init__(self, log):
        self.log = log

    def to_host(self, tensor):
        self.log.append(("offload", tuple(tensor.shape)))
        return tensor.clone()

    def fetch(self, stored):
        self.log.append(("fetch", tuple(stored.shape)))
        return stored.clone()

    def ready(self, fetched):
        return fetched


def test_bookkeeping_through_the_engine_equals_fullkv(toy_llama):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (120,), generator=gen).tolist()
    full_b = Budget.parse(None)
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, full_b), full_b) as full_session:
        full = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    b = Budget.parse(128)
    method = build_method({"name": "offload", "offload_start": 1, "prefetch_ahead": 1}, b)
    log = []
    method._transport = SyncTransport(log)
    calls = []
    attend = method.attend

    def spy(layer, ctx):
        calls.append((ctx.layer_idx, sorted(method._fetched)))
        return attend(layer, ctx)

    method.attend = spy
    with CompressionSession(toy_llama, method, b) as session:
        out = greedy_generate(toy_llama, [prompt], 10, [255], 0)
    assert out.tokens == full.tokens
    layer_bytes = 120 * 2 * 16 * 4  # K or V of one layer: 120 tokens x 2 KV heads x 16 dims x fp32
    assert session.stats.resident_kv_bytes_after_prefill == 2 * layer_bytes  # layer 0 only; layers 1-2 on the host
    assert method.host_bytes == 4 * layer_bytes
    assert session.stats.attended_tokens_mean == full_session.stats.attended_tokens_mean
    assert log[:4] == [("offload", (1, 2, 120, 16))] * 4  # K and V of layers 1 and 2 after prefill
    steps = out.decode_steps
    assert log[4:] == [("fetch", (1, 2, 120, 16))] * 4 * steps  # the prompt KV only; generated KV stays
    # in flight when each layer starts: layer 0 issued layer 1's copy, layer 1 issued layer 2's; nothing left over
    assert calls == [(0, []), (1, [1]), (2, [2])] * steps
    assert method._fetched == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_equals_fullkv(toy_llama):
    model = toy_llama.to("cuda")
    try:
        prompt = torch.randint(3, 250, (300,), generator=torch.Generator().manual_seed(4)).tolist()
        full_b = Budget.parse(None)
        with CompressionSession(model, build_method({"name": "fullkv"}, full_b), full_b):
            full = greedy_generate(model, [prompt], 16, [255], 0)
        b = Budget.parse(128)
        method = build_method({"name": "offload", "offload_start": 1, "prefetch_ahead": 1}, b)
        with CompressionSession(model, method, b):
            out = greedy_generate(model, [prompt], 16, [255], 0)
        assert out.tokens == full.tokens
        assert method.host_bytes == 4 * 300 * 2 * 16 * 4
    finally:
        toy_llama.to("cpu")


def test_refuses_on_cpu_before_loading():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["method=offload"])
    with pytest.raises(NotAvailableError, match="needs the model on a CUDA device.*would run on 'cpu'"):
        plan_job(cfg)
    layer_method = build_method({"name": "offload"}, Budget.parse(128))
    from helpers import make_layer, prefill_ctx

    layer = make_layer(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4))
    with pytest.raises(NotAvailableError, match="needs the model on a CUDA device; its KV is on 'cpu'"):
        layer_method.prefill(layer, prefill_ctx(torch.randn(1, 4, 8, 4), layer, 8))
