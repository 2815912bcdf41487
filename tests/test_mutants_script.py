"""scripts/mutants.py: the mutant list is well formed and current, and a stale entry is refused (the mutants
themselves run with ``python scripts/mutants.py``, minutes, not in the test suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mutants():
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_list_is_well_formed(mutants):
    ids = [m.id for m in mutants.MUTANTS]
    assert len(ids) == len(set(ids))
    assert {m.method for m in mutants.MUTANTS} == {"omnikv", "kvmerger", "pod", "d2o", "dynamickv", "snapkv",
                                                   "pyramidkv", "h2o", "streamingllm", "cam", "think", "kvzip",
                                                   "knorm", "keydiff", "tova", "expected_attention", "adakv",
                                                   "chunkkv", "lminfinite", "pyramidinfer", "engine", "quest", "rkv",
                                                   "triattention"}
    for m in mutants.MUTANTS:
        assert m.original != m.mutated and m.tests, m.id
        assert all((ROOT / t).is_file() for t in m.tests if t.endswith(".py")), m.id
    # the four gaps of the audit stay on the list
    assert {"omnikv-softmax-range", "kvmerger-theta-strict", "kvmerger-heavy-outside-recent",
            "pod-shared-distant-only"} <= set(ids)


def test_originals_occur_exactly_once(mutants):
    """Every entry matches today's files: the list follows the code it guards."""
    assert mutants.stale(mutants.MUTANTS, ROOT) == []


def test_stale_entries_are_reported(mutants, tmp_path):
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    twice = mutants.Mutant("twice", "pod", "a.py", "x = 1", "x = 2", ["t.py"])
    missing = mutants.Mutant("missing", "pod", "a.py", "y = 1", "y = 2", ["t.py"])
    gone = mutants.Mutant("gone", "pod", "b.py", "y = 1", "y = 2", ["t.py"])
    lines = mutants.stale([twice, missing, gone], tmp_path)
    assert [line.split(":")[0] for line in lines] == ["twice", "missing", "gone"]
    assert "occurs 2 times" in lines[0] and "occurs 0 times" in lines[1] and "missing file" in lines[2]
    assert mutants.main(["--only", "no-such-mutant"]) == 2
