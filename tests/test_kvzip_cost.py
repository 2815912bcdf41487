"""KVzip's reconstruction stays about the cost of its forwards (issue #27 item 7), counted, not timed.

At 4k tokens on SmolLM2 (1 CPU thread) a KVzip prefill took 10x FullKV's: the repeat forwards attended the cache
through ``grouped_attention`` (``(B, Hkv, g, q, T)`` probabilities materialised per layer: 142 s) and the scoring built
the ``(B, Hq, q, sink + chunk + q)`` probabilities at once (61 s). These tests fail if either comes back: every repeat
forward's layer attends through the model's own kernel (sdpa), as a plain forward's layers do, and the scoring holds
one block of queries' probabilities at a time.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import ByteTokenizer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession
from kvbench.engine import session as session_module
from kvbench.engine.cache import KVCache
from kvbench.engine.compat import cache_kwargs
from kvbench.methods import build_method
from kvbench.methods.kvzip_ops import reconstruction_scores


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(5))


def _attention_calls(model, method_config: dict, budget: Budget, ids: torch.Tensor, monkeypatch) -> dict[str, int]:
    """How often one prompt forward (with a KVzip session: its repeat forwards too) called the fused kernel and the
    engine's materialising ``grouped_attention``."""
    calls = {"sdpa": 0, "grouped": 0}
    sdpa, grouped = torch.nn.functional.scaled_dot_product_attention, session_module.grouped_attention

    def counting_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    def counting_grouped(*args, **kwargs):
        calls["grouped"] += 1
        return grouped(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(session_module, "grouped_attention", counting_grouped)
    with torch.no_grad(), CompressionSession(model, build_method(method_config, budget), budget,
                                             tokenizer=ByteTokenizer()):
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, KVCache()))
    monkeypatch.undo()
    return calls


def test_repeat_forwards_attend_through_the_models_kernel(toy_llama, monkeypatch):
    """A 200-token prompt in chunks of 64: four repeat forwards, each of whose 3 layers calls sdpa once, as the prompt's
    forward does (FullKV: once per layer), and none goes through ``grouped_attention``."""
    assert toy_llama.config._attn_implementation == "sdpa"
    layers, ids = toy_llama.config.num_hidden_layers, _prompt(200)
    plain = _attention_calls(toy_llama, {"name": "fullkv"}, Budget.parse(None), ids, monkeypatch)
    assert plain == {"sdpa": layers, "grouped": 0}
    kvzip = _attention_calls(toy_llama, {"name": "kvzip", "chunk_size": 64}, Budget.parse(48), ids, monkeypatch)
    assert kvzip == {"sdpa": layers * (1 + 4), "grouped": 0}


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returned."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("start,end", [(0, 256), (256, 512)])
def test_scoring_holds_one_block_of_probabilities(start, end):
    """Scoring a 256-entry chunk from 300 repeat queries (4 query heads over 2 KV heads): the whole probability
    tensor would hold 4 x 300 x (sinks + 256 + 300) values; with blocks of at most 16384 no tensor exceeds the blocks
    or the inputs, and the scores equal the one-block computation's."""
    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(1, 4, 300, 8, generator=g), torch.randn(1, 2, 812, 8, generator=g)
    whole = reconstruction_scores(queries, keys, start, end, 4, 8**-0.5, block_elements=1 << 30)
    with _LargestTensor() as seen:
        blocked = reconstruction_scores(queries, keys, start, end, 4, 8**-0.5, block_elements=16384)
    full_size = 4 * 300 * (min(4, start) + (end - start) + 300)
    assert seen.largest <= max(16384, keys.numel()) < full_size // 40
    torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=0)
