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
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.errors import ConfigError
from kvbench.methods import build_method

pytestmark = pytest.mark.compat
STATIC = ["fullkv", "snapkv", "pyramidkv", "dynamickv", "streamingllm", "h2o", "local", "kvmerger", "quest", "knorm",
          "keydiff", "expected_attention", "adakv", "chunkkv"]
#: AdaKV's default ragged layout has no fixed-capacity form (refused: test_ragged_cache); its padded layout runs
FIELDS = {"adakv": {"layout": "padded"}}


def _prompt(n=200, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(model, name, budget, compile, prompts, new=32):
    b = Budget.parse(budget)
    with CompressionSession(model, build_method({"name": name, **FIELDS.get(name, {})}, b), b,
                            compile=compile) as session:
        out = greedy_generate(model, prompts, new, [], 0)
    return out, session


@pytest.mark.parametrize("method", STATIC)
def test_static_decode_equals_the_default_path(toy_llama, method):
    budget = None if method == "fullkv" else 64
    eager, eager_session = _generate(toy_llama, method, budget, False, [_prompt()])
    static, static_session = _generate(toy_llama, method, budget, "eager", [_prompt()])
    assert static.tokens == eager.tokens
    assert static_session.stats.attended_tokens_mean == pytest.approx(eager_session.stats.attended_tokens_mean)
    # one slot per layer and head more than what the default path holds at the end: the step's own token's slot
    # (evicting methods) or the unused reserve (others); allocated bytes are what is reported
    assert static.resident_kv_bytes_final >= eager.resident_kv_bytes_final


@pytest.mark.parametrize("method", STATIC)
def test_the_step_is_captured_once_and_never_recompiled(toy_llama, method):
    """Graphs are counted after the first decode step (every layer has run the step once: layers of different
    capacities, PyramidKV's, make the one shape-generic graph) and after 32: none is added in between."""
    torch._dynamo.reset()
    counters.clear()
    seen = []

    def after_each_step(row, tokens):
        seen.append(counters["stats"]["unique_graphs"])
        return False

    b = Budget.parse(None if method == "fullkv" else 64)
    with CompressionSession(toy_llama, build_method({"name": method, **FIELDS.get(method, {})}, b), b,
                            compile="eager"):
        out = greedy_generate(toy_llama, [_prompt()], 33, [], 0, after_each_step)
    assert out.decode_steps == 32 and len(seen) == 33
    assert seen[1] >= 1  # captured (fullgraph=True: a graph break would have raised)
    assert seen[-1] == seen[1], seen  # 31 more steps: no new graph


def test_a_padded_batch_decodes_as_each_row_alone(toy_llama):
    long, short = _prompt(200, 3), _prompt(150, 4)
    both, _ = _generate(toy_llama, "h2o", 64, "eager", [long, short])
    alone = [_generate(toy_llama, "h2o", 64, "eager", [p])[0].tokens[0] for p in (long, short)]
    eager, _ = _generate(toy_llama, "h2o", 64, False, [long, short])
    assert both.tokens == eager.tokens
    assert both.tokens[0] == alone[0]


NO_STATIC = ["d2o", "cam", "roco", "sirllm", "pod", "omnikv", "infllm", "lminfinite", "pyramidinfer", "tova"]


@pytest.mark.parametrize("method", NO_STATIC)
def test_methods_without_a_static_step_are_refused(toy_llama, method):
    """Each listed in the README's engine.compile paragraph with the reason."""
    b = Budget.parse(64)
    m = build_method({"name": method, **({"filter_layers": [0]} if method == "omnikv" else {})}, b)
    assert m.static_policy(64) is None
    with pytest.raises(ConfigError, match="engine.compile=true: method"):
        with CompressionSession(toy_llama, m, b, compile="eager"):
            pass
