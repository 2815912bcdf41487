import math
import re

import pytest
import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError, NotAvailableError


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


# ---- parsed once at the edge, checked in one place (issue #39 item 3) ----------------------------------------------
@pytest.mark.parametrize("raw", ["abc", 0, -3, 1.0, 1.5, "1.0", True, [1], float("nan")])
def test_every_refusal_names_the_value_and_the_valid_forms(raw):
    from kvbench.budget import VALID_FORMS, parse_budget

    with pytest.raises(ConfigError) as err:
        parse_budget(raw)
    message = str(err.value)
    assert message.startswith("budget=") and message.endswith(VALID_FORMS) and "\n" not in message
    assert "128" in VALID_FORMS and "(0, 1)" in VALID_FORMS and "full" in VALID_FORMS


def test_fullkv_keeps_everything_but_a_malformed_value_is_still_refused():
    from kvbench.budget import parse_budget

    assert parse_budget(128, "fullkv") == Budget.full() == parse_budget("full") == parse_budget(None)
    assert parse_budget(128, "snapkv") == Budget("tokens", 128) and parse_budget("0.2") == Budget("ratio", 0.2)
    with pytest.raises(ConfigError, match="budget='abc' is not a number"):
        parse_budget("abc", "fullkv")


def test_check_budget_is_every_minimum_rule():
    """Tokens: at least the method's minimum; a ratio: on a given prompt, unless it holds that prompt whole; full:
    anything. ``Method.validate`` is this same check (no prompt)."""
    from kvbench.budget import check_budget
    from kvbench.methods import build_method

    snapkv = build_method({"name": "snapkv"}, Budget.full())  # minimum 33 (window 32 + 1)
    check_budget(Budget.full(), snapkv, 4)
    check_budget(Budget("tokens", 33), snapkv)
    with pytest.raises(ConfigError, match=r"^budget=32 is below the minimum 33 tokens per layer of method 'snapkv' "
                                          r"\(the observation window of 32 tokens is part of the budget\)$"):
        check_budget(Budget("tokens", 32), snapkv, 10_000)
    with pytest.raises(ConfigError, match="^budget=32 is below the minimum 33"):
        snapkv.validate(Budget("tokens", 32))
    check_budget(Budget("ratio", 0.01), snapkv)  # no prompt yet: a ratio resolves per prompt
    check_budget(Budget("ratio", 0.2), snapkv, 165)  # exactly 33
    check_budget(Budget("ratio", 0.99), snapkv, 20)  # holds the prompt whole: 20 >= 20
    with pytest.raises(ConfigError, match=r"^budget=0.2 resolves to 32 tokens per layer for x, below the minimum 33 "):
        check_budget(Budget("ratio", 0.2), snapkv, 160, "for x")
    with pytest.raises(ConfigError, match="resolves to 1 token per layer"):
        check_budget(Budget("ratio", 0.2), snapkv, 4)


def _calls_in(path, name):
    """Lines of ``path`` that call ``name`` (``parse_budget``) or ``Budget.<name>`` (``parse``; a bare ``parse(...)``
    is another library's, math-verify's in the math tasks' grader)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == name and name != "parse") or (
                    isinstance(f, ast.Attribute) and f.attr == name and (name != "parse" or (
                        isinstance(f.value, ast.Name) and f.value.id == "Budget"))):
                found.append(node.lineno)
    return found


#: the edges that read a budget as written: the command line's check, the job plan, the sweep plan (a refused job's
#: label), the bench's grids (and stored rows) and its probe's request
EDGES = {"kvbench/overrides.py", "kvbench/jobs/plan.py", "kvbench/sweep/plan.py", "kvbench/bench/run.py",
         "kvbench/bench/probe.py"}


def test_only_the_edges_parse_a_budget_and_only_check_budget_holds_the_minimum():
    """No layer below the plan parses a raw budget or reads ``cfg.budget``; the minimum rule (a comparison with
    ``min_budget_tokens()``) is ``check_budget``'s alone outside the methods' own files."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    parse, edge, reads, minimum = {}, {}, {}, {}
    for path in sorted((root / "kvbench").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _calls_in(path, "parse"):
            parse[rel] = _calls_in(path, "parse")
        if _calls_in(path, "parse_budget"):
            edge[rel] = _calls_in(path, "parse_budget")
        if _calls_in(path, "min_budget_tokens") and not rel.startswith("kvbench/methods/"):
            minimum[rel] = _calls_in(path, "min_budget_tokens")
        for node in ast.walk(ast.parse(path.read_text())):
            raw = (isinstance(node, ast.Attribute) and node.attr == "budget" and isinstance(node.value, ast.Name)
                   and node.value.id == "cfg") or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "cfg"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "budget")
            if raw:
                reads.setdefault(rel, []).append(node.lineno)
    assert set(parse) == {"kvbench/budget.py"}, parse  # Budget.parse: only parse_budget calls it
    assert set(edge) == EDGES, edge
    assert set(reads) <= {"kvbench/jobs/plan.py", "kvbench/sweep/plan.py"}, reads
    assert set(minimum) == {"kvbench/budget.py"}, minimum
    base = (root / "kvbench" / "methods" / "base.py").read_text()
    assert "check_resolved_budget" not in base and "below the minimum" not in base


def test_the_budget_is_parsed_once_per_job_on_the_way_to_the_session(tmp_path, monkeypatch):
    """From the composed config to the session: the plan parses ``budget`` once (the run's own plan), and the session
    gets that typed value; the runner, the task and the engine parse nothing. The command line's check parses each
    value written there once."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.engine.session import CompressionSession
    from kvbench.jobs import run_job
    from kvbench.overrides import precheck_overrides

    calls, sessions = [], []
    original = Budget.parse

    def counting(cls, raw):
        calls.append(raw)
        return original(raw)

    monkeypatch.setattr(Budget, "parse", classmethod(counting))
    init = CompressionSession.__init__

    def recording(self, model, method, budget, *args, **kwargs):
        sessions.append(budget)
        init(self, model, method, budget, *args, **kwargs)

    monkeypatch.setattr(CompressionSession, "__init__", recording)
    precheck_overrides(["-m", "budget=64,0.5,full"])
    assert calls == ["64", "0.5", "full"]  # each value written, once
    calls.clear()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=tiny-random", "task=passkey", "task.context_lengths=[128]", "task.depths=[10,90]", "method=snapkv",
            "budget=40", "task.max_new_tokens=2", "print_table=false", f"paths.results_dir={tmp_path}"])
    run_job(cfg)
    assert calls == [40]  # one job, two samples: one parse
    assert sessions and all(b == Budget("tokens", 40) for b in sessions), sessions
    assert len(list(tmp_path.rglob("samples.jsonl"))) == 1


#: every registered method that can be configured so that its own fields, not the budget, set what it keeps
#: (``Method.budget_label`` not None: its results are filed under that label), in such a configuration
OWN_SIZES = {"pod": {}, "pyramidinfer": {"allocation": "paper"}, "cla": {"allow_untrained": True}, "offload": {},
             "infllm": {"n_init": 4, "n_local": 512, "topk": 2}}
#: fields the others need to build at all
NEEDS = {"triattention": {"stats_path": "tests/fixtures/triattention/smollm2-135m.pt"}}


def test_a_full_budget_is_refused_where_the_method_does_not_use_the_budget():
    """``budget=full`` keeps everything: the engine runs no method at a full budget (prefill, the host-driven decode
    step and the captured one alike: FullKV). For a method whose own fields set what it keeps, that would file
    FullKV's numbers under the method's own label (POD's ``window16+4080``: its host-driven decode still ran POD's
    attention while its prefill and captured step were FullKV's), so such a budget is refused in one line naming the
    value and what to give; every other method at a full budget is FullKV, under ``full``."""
    from kvbench.budget import check_budget
    from kvbench.methods import METHODS, build_method

    refused = set()
    for name in METHODS.names():
        try:
            method = build_method({"name": name, **OWN_SIZES.get(name, NEEDS.get(name, {}))}, Budget("tokens", 128))
        except NotAvailableError:  # (LoCoCo: no kernels; refused at any budget)
            continue
        label = method.budget_label(Budget.full()) if name != "fullkv" else None
        if label is None:
            check_budget(Budget.full(), method, 1000)
            continue
        refused.add(name)
        filed = re.escape(label)
        with pytest.raises(ConfigError, match=rf"^budget=full switches method '{name}' off \(full keeps everything: "
                                              rf"FullKV\), but this method does not use the budget \(its fields set "
                                              rf"what it keeps; results filed as '{filed}'\): give any budget, e\.g\. "
                                              rf"budget=128 \(unused\), or method=fullkv$"):
            build_method({"name": name, **OWN_SIZES.get(name, {})}, Budget.full())
    assert refused == set(OWN_SIZES)
