import math

import pytest
import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError


@pytest.mark.parametrize(
    "raw, kind, value, label",
    [(128, "tokens", 128, "128"), ("64", "tokens", 64, "64"), (0.2, "ratio", 0.2, "0.2"),
     ("0.35", "ratio", 0.35, "0.35"), (None, "full", math.inf, "full")],
)
def test_parse(raw, kind, value, label):
    b = Budget.parse(raw)
    assert (b.kind, b.value, b.label()) == (kind, value, label)


@pytest.mark.parametrize("raw", [0, -5, 0.0, -0.1, 1.0, 1.5, 256.0, "abc", True, [1]])
def test_bad_budgets_name_the_value(raw):
    with pytest.raises(ConfigError) as err:
        Budget.parse(raw)
    assert "budget=" in str(err.value)


def test_tokens_for_prompt():
    assert Budget.parse(128).tokens_for(1000) == 128
    assert Budget.parse(128).tokens_for(100) == 100  # never more than the prompt
    assert Budget.parse(0.2).tokens_for(1000) == 200
    assert Budget.parse(0.2).tokens_for(1003) == 201
    assert Budget.parse(None).tokens_for(77) == 77


# ---- a ratio resolves per prompt: the session refuses one that would compress a prompt below the method's minimum ----
def _generate(model, method, budget, lengths):
    from kvbench.engine import CompressionSession, greedy_generate
    from kvbench.methods import build_method

    b = Budget.parse(budget)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]
    with CompressionSession(model, build_method({"name": method}, b), b) as session:
        greedy_generate(model, prompts, 4, [255], 0)
    return session.stats


def test_a_ratio_below_the_minimum_on_a_prompt_raises(toy_llama):
    with pytest.raises(ConfigError, match=r"^budget=0.2 resolves to 20 tokens per layer for a prompt of 100 tokens, "
                                          r"below the minimum 33 tokens per layer of method 'snapkv' \(the observation "
                                          r"window of 32 tokens is part of the budget\)$"):
        _generate(toy_llama, "snapkv", 0.2, [100])
    with pytest.raises(ConfigError, match="resolves to 20 tokens per layer for a prompt of 100 tokens"):
        _generate(toy_llama, "snapkv", 0.2, [200, 100])  # each row of a batch: the short one is named
    # a prompt shorter than the minimum (5) that the ratio does not hold whole: StreamingLLM crashed on it before
    with pytest.raises(ConfigError, match="to 1 token per layer for a prompt of 4 tokens, below the minimum 5 "):
        _generate(toy_llama, "streamingllm", 0.2, [4])


def test_a_ratio_at_or_above_the_minimum_runs(toy_llama):
    assert _generate(toy_llama, "snapkv", 0.2, [200]).layer_entries_after_prefill == [40, 40, 40]
    assert _generate(toy_llama, "snapkv", 0.2, [165]).layer_entries_after_prefill == [33, 33, 33]  # exactly 33
    # a prompt the ratio holds whole is not compressed, however far below the minimum
    assert _generate(toy_llama, "snapkv", 0.99, [20]).layer_entries_after_prefill == [20, 20, 20]
    # FullKV's minimum is one token: any ratio
    assert _generate(toy_llama, "fullkv", 0.01, [100]).layer_entries_after_prefill == [100, 100, 100]
