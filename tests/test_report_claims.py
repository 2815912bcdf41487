"""kvbench.report.claims: each claim kind on a hand-built set of runs, verdicts and numbers computed by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench.report.claims import claims_markdown, evaluate, load_claims, pct_fullkv, write_claims

# (task, method, budget, score); FullKV: needle 10, passkey 80 (so % FullKV = score * 10 and score * 1.25)
RUNS = [
    ("needle", "fullkv", "full", 10.0), ("passkey", "fullkv", "full", 80.0),
    ("needle", "a", "64", 5.0), ("needle", "a", "128", 8.0),
    ("passkey", "a", "64", 40.0), ("passkey", "a", "128", 80.0),
    ("needle", "b", "64", 6.0), ("needle", "b", "128", 7.0),
    ("passkey", "b", "64", 20.0), ("passkey", "b", "128", 72.0),
    ("needle", "pod", "window16+48", 9.0), ("passkey", "pod", "window16+48", 60.0),
    ("2stageretr", "fullkv", "full", 0.0),
]


def _runs() -> pd.DataFrame:
    return pd.DataFrame([{"model": "m", "task": t, "protocol": "", "method": m, "budget": b, "score": s}
                         for t, m, b, s in RUNS])


def test_pct_fullkv_skips_tasks_without_a_positive_fullkv():
    table = pct_fullkv(_runs(), "m")
    assert table[("needle", "a", "64")] == 50.0 and table[("passkey", "b", "128")] == 90.0
    assert not any(task == "2stageretr" for task, _, _ in table)


def test_compare_per_budget_with_the_mean_over_tasks():
    claim = {"kind": "compare", "budgets": [64, 128, 512], "better": "a", "than": ["b"]}
    r64, r128, r512 = evaluate(claim, _runs(), "m", ["needle", "passkey"])
    # 64: a = (50 + 50) / 2 = 50, b = (60 + 25) / 2 = 42.5; a loses on needle alone
    assert r64 == {"budget": 64, "numbers": "a 50.0 vs b 42.5", "tasks": "1/2", "verdict": "held"}
    # 128: a = (80 + 100) / 2 = 90, b = (70 + 90) / 2 = 80
    assert r128["numbers"] == "a 90.0 vs b 80.0" and r128["tasks"] == "2/2" and r128["verdict"] == "held"
    assert r512["verdict"] == "not run"
    reverse = evaluate({**claim, "better": "b", "than": ["a"], "budgets": [64]}, _runs(), "m", ["needle", "passkey"])
    assert reverse[0]["verdict"] == "did not hold" and reverse[0]["tasks"] == "1/2"
    lower = evaluate({**claim, "better": "b", "than": ["a"], "budgets": [64], "lower_is_better": True}, _runs(), "m",
                     ["needle", "passkey"])  # perplexity-like: b's 42.5 % of FullKV is "better" than a's 50 %
    assert lower[0]["verdict"] == "held" and lower[0]["tasks"] == "1/2"


def test_templated_labels_pod_window():
    claim = {"kind": "compare", "budgets": [64], "better": "pod@window16+{r}", "than": ["a"]}
    (row,) = evaluate(claim, _runs(), "m", ["needle", "passkey"])
    assert row["numbers"] == "pod 82.5 vs a 50.0" and row["verdict"] == "held"  # (90 + 75) / 2


def test_near_full_monotone_and_fullkv_solves():
    near = evaluate({"kind": "near_full", "budgets": [128], "method": "b", "at_least": 85}, _runs(), "m",
                    ["needle", "passkey"])
    assert near[0]["numbers"] == "b 80.0 % (>= 85)" and near[0]["tasks"] == "1/2"
    assert near[0]["verdict"] == "did not hold"
    mono = evaluate({"kind": "monotone", "budgets": [64, 128], "methods": ["a", "b"]}, _runs(), "m", ["needle"])
    assert [r["numbers"] for r in mono] == ["50.0 -> 80.0", "60.0 -> 70.0"] and {r["verdict"] for r in mono} == {"held"}
    (solves,) = evaluate({"kind": "fullkv_solves", "tasks": ["2stageretr"], "at_least": 50}, _runs(), "m", [])
    assert solves["verdict"] == "not testable here" and solves["numbers"] == "FullKV 2stageretr = 0.00"


def test_markdown_and_file(tmp_path):
    (tmp_path / "claims.yaml").write_text(
        "model: m\ntasks: [needle, passkey]\nclaims:\n"
        "  - {paper: P, claim: a beats b, kind: compare, budgets: [64, 128], better: a, than: [b]}\n")
    path = write_claims(tmp_path, _runs(), tmp_path / "report")
    text = path.read_text()
    assert "| P | a beats b |  | 64 | a 50.0 vs b 42.5 | 1/2 | **held** |" in text
    assert "|  |  |  | 128 |" in text and "Rows: held 2." in text
    # the summary: % FullKV averaged over needle and passkey; POD's window16+48 is its 64-token column
    assert "| method | 64 | 128 |" in text and "| a | 50.0 | 90.0 |" in text and "| pod | 82.5 |  |" in text
    assert text == claims_markdown(load_claims(tmp_path / "claims.yaml"), _runs())
    assert write_claims(tmp_path / "report", _runs(), tmp_path / "x") is None  # no claims.yaml: nothing


def test_unknown_kind_names_the_valid_ones(tmp_path):
    (tmp_path / "claims.yaml").write_text("model: m\nclaims:\n  - {claim: x, kind: better}\n")
    with pytest.raises(ValueError, match=r"kind='better'.*compare, near_full, monotone, fullkv_solves"):
        load_claims(tmp_path / "claims.yaml")
