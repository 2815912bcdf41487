import math

import pytest

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
