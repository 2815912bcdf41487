"""SirLLM's token entropies, selection and decay against a slow reference, and the engine's logits hook
(``Method.needs_logits`` / ``observe_logits``) with kvbench's greedy loop and with ``model.generate``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

from helpers import kept_positions, make_layer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.session import TokenLogits
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.base import Method
from kvbench.methods.sirllm import SirLLM

V = 12


def surprisal(logits: torch.Tensor, token: int) -> float:
    return float(-torch.log_softmax(logits.double(), -1)[token])


def reference_keep(entropy: list[float], cap: int, start: int, recent_ratio: float) -> list[int]:
    """SirLLM's kept positions over tokens 0..T-1: start ∪ top-E (Python's stable sort, reverse) ∪ newest to C."""
    rest = cap - start
    e = rest - round(rest * recent_ratio)
    top = sorted(range(len(entropy)), key=lambda i: entropy[i], reverse=True)[:e]
    keep = set(top) | set(range(min(start, len(entropy))))
    for i in range(len(entropy) - 1, -1, -1):
        if len(keep) >= cap:
            break
        keep.add(i)
    return sorted(keep)


def _layers(n, count=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        layer = make_layer(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g))
        layer.capacity = None
        out.append(layer)
    return out


@pytest.mark.parametrize("entropy", ["paper", "official_code"])
def test_entropy_selection_and_decay_over_rounds(entropy):
    n, cap, start, ratio, decay = 30, 12, 2, 0.4, 0.5
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (1, n + 3), generator=g)
    logits = torch.randn(1, n + 3, V, generator=g) * 3  # the model's logits at every position
    layers = _layers(n)
    for layer in layers:
        layer.capacity = torch.tensor([cap])
    method = SirLLM(start_size=start, recent_ratio=ratio, decay_ratio=decay, entropy=entropy)
    method.observe_logits(layers, ids[:, :n], TokenLogits(logits[:, :n], torch.nn.Identity(), None))
    # reference entropies of the prompt
    if entropy == "paper":  # -log p_{i-1}(x_i); the first token gets the round's maximum
        ent = [None] + [surprisal(logits[0, i - 1], int(ids[0, i])) for i in range(1, n)]
        ent[0] = max(ent[1:])
    else:  # official: c_i = -log p_i(x_i), shifted by one, first = max over the round
        c = [surprisal(logits[0, i], int(ids[0, i])) for i in range(n)]
        ent = [max(c)] + c[:-1]
    store = dict(enumerate(ent))
    kept = reference_keep(ent, cap, start, ratio)
    for layer in layers:
        assert kept_positions(layer) == [kept, kept]
        expect = torch.tensor([store[p] * decay for p in kept], dtype=torch.float64)
        assert torch.allclose(layer.state["sirllm_entropy"][0, 0].double(), expect, atol=1e-4)
    store = {p: store[p] * decay for p in kept}
    # three decode rounds of one token each: the previous forward's last logits score the new token
    for t in range(n, n + 3):
        for layer in layers:
            layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        prev = torch.log_softmax(logits[:, t - 1].float(), -1)
        method.observe_logits(layers, ids[:, t : t + 1], TokenLogits(logits[:, t : t + 1], torch.nn.Identity(), prev))
        new = surprisal(logits[0, t - 1], int(ids[0, t])) if entropy == "paper" else \
            surprisal(logits[0, t], int(ids[0, t]))
        store[t] = new
        order = sorted(store)
        kept = [order[i] for i in reference_keep([store[p] for p in order], cap, start, ratio)]
        store = {p: store[p] * decay for p in kept}
        for layer in layers:
            assert kept_positions(layer) == [kept, kept]
            got = layer.state["sirllm_entropy"][0, 1].double()
            assert torch.allclose(got, torch.tensor([store[p] for p in kept], dtype=torch.float64), atol=1e-4)
            assert layer.num_entries == cap


def test_left_padded_rows_keep_real_tokens_only():
    n, cap, pad = 16, 6, 5
    ids = torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(2))
    logits = torch.randn(2, n, V, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :pad] = False
    layer = make_layer(torch.randn(2, 2, n, 4), torch.randn(2, 2, n, 4))
    layer.set_valid(valid.view(2, 1, n).expand(2, 2, n).clone())
    layer.capacity = torch.tensor([cap, cap])
    layers = [layer]
    SirLLM(start_size=2).observe_logits(layers, ids, TokenLogits(logits, torch.nn.Identity(), None))
    row1 = kept_positions(layer, 1)[0]
    assert len(row1) == cap and min(row1) >= pad and {pad, pad + 1} <= set(row1)
    ent = [None] + [surprisal(logits[1, i - 1], int(ids[1, i])) for i in range(pad + 1, n)]
    ent[0] = max(ent[1:])
    assert row1 == [pad + p for p in reference_keep(ent, cap, 2, 0.5)]


@dataclass
class Recorder(Method):
    """Records what the session hands to observe_logits (and keeps everything)."""

    name: ClassVar[str] = "recorder"
    needs_logits: ClassVar[bool] = True
    seen: list = field(default_factory=list)

    def observe_logits(self, layers, input_ids, logits):
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
        first = None if logits.previous is None else torch.gather(logits.previous, -1, input_ids[:, :1])
        self.seen.append((input_ids.clone(), logits.gather(nxt)[:, :-1].clone(), first, len(layers)))


@pytest.mark.parametrize("loop", ["greedy_generate", "model.generate"])
def test_logits_hook_sees_every_forward_with_the_models_log_probs(toy_llama, loop):
    prompt = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    method, budget = Recorder(), Budget.parse(64)
    with CompressionSession(toy_llama, method, budget):
        if loop == "greedy_generate":
            generated = greedy_generate(toy_llama, [prompt], 5, [2], 0).tokens[0]
        else:
            out = toy_llama.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5)
            generated = out[0, len(prompt) :].tolist()
    full = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logp = torch.log_softmax(toy_llama(full, use_cache=False).logits[0].float(), -1)
    assert len(method.seen) == len(generated)  # the prompt, then one forward per fed-back token
    ids, scores, first, n_layers = method.seen[0]
    assert ids[0].tolist() == prompt and first is None and n_layers == 3
    ref = logp[torch.arange(len(prompt) - 1), full[0, 1 : len(prompt)]]
    assert torch.allclose(scores[0], ref, atol=1e-4)
    for step, (ids, _, first, _) in enumerate(method.seen[1:]):
        pos = len(prompt) + step
        assert ids[0].tolist() == [generated[step]]
        assert torch.allclose(first[0, 0], logp[pos - 1, full[0, pos]], atol=1e-4)


def test_sirllm_resident_bytes_are_measured_after_its_eviction(toy_llama):
    prompt = torch.randint(3, 256, (50,), generator=torch.Generator().manual_seed(6)).tolist()
    budget = Budget.parse(16)
    with CompressionSession(toy_llama, build_method({"name": "sirllm"}, budget), budget) as session:
        out = greedy_generate(toy_llama, [prompt], 6, [2], 0)
    per_entry = 3 * 2 * 16 * 2 * 4  # layers x kv heads x head_dim x (K, V) x fp32
    assert session.stats.layer_entries_after_prefill == [16] * 3
    assert session.stats.resident_kv_bytes_after_prefill == 16 * per_entry
    assert out.resident_kv_bytes_final == 16 * per_entry


def test_config_validation():
    with pytest.raises(ConfigError, match="entropy='mean'.*paper, official_code"):
        build_method({"name": "sirllm", "entropy": "mean"}, Budget.parse(64))
    with pytest.raises(ConfigError, match="decay_ratio=0"):
        build_method({"name": "sirllm", "decay_ratio": 0}, Budget.parse(64))
    with pytest.raises(ConfigError, match="budget=4 is below the minimum 5"):
        build_method({"name": "sirllm"}, Budget.parse(4))
