"""kvbench.report.claims: every claim kind on hand-built runs whose answer is known (per-sample records, paired on
the sample id), the verdict rules of the module docstring, the resident KV beside every comparison, the file."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvbench.report.claims import Evidence, claims_markdown, evaluate, load_claims, resident_kv_bytes, write_claims

N = 20  # samples per task
MIB = 2**20


def _run(task: str, method: str, budget: str, scores: list[float], kv: float = 4 * MIB, ids: list[str] | None = None,
         datasets: list[str] | None = None, label: str | None = None) -> dict:
    ids = ids or [f"{task}-{i}" for i in range(len(scores))]
    recs = [{"id": i, "score": s, **({"meta": {"dataset": d}} if datasets else {})}
            for i, s, d in zip(ids, scores, datasets or [None] * len(scores))]
    return {"model": "m", "task": task, "protocol": "", "method": method, "method_label": label or method,
            "budget": budget, "score": sum(scores) / len(scores), "path": "", "records": recs,
            "scores": {"resident_kv_bytes_mean": kv}}


def _evidence(*runs: dict) -> Evidence:
    return Evidence(pd.DataFrame(list(runs)), "m")


def _base() -> list[dict]:
    """FullKV solves both tasks (1.0 and 8.0 per sample); ``good`` equals it, ``bad`` scores 0, ``half`` gets every
    other sample, ``copy`` is ``half`` again, ``few`` beats ``bad`` on 3 samples only."""
    out = []
    for task, full in (("t1", 1.0), ("t2", 8.0)):
        out += [_run(task, "fullkv", "full", [full] * N, kv=32 * MIB),
                _run(task, "good", "64", [full] * N), _run(task, "bad", "64", [0.0] * N),
                _run(task, "half", "64", [full * (i % 2) for i in range(N)]),
                _run(task, "copy", "64", [full * (i % 2) for i in range(N)], kv=8 * MIB),
                _run(task, "few", "64", [full] * 3 * (task == "t1") + [0.0] * (N - 3 * (task == "t1")))]
    return out


def _one(claim: dict, *runs: dict, tasks=("t1", "t2")):
    (verdict,) = evaluate(claim, _evidence(*(runs or _base())), list(tasks))
    return verdict


def _p(text: str) -> float:
    return 0.0 if text == "<0.001" else float(text)


def test_clear_positive_held_identical_inconclusive_clear_negative_did_not_hold():
    held = _one({"kind": "compare", "budgets": [64], "better": "good", "than": ["bad"]})
    assert held.verdict == "held" and _p(held.rows[0].p) < 0.01
    assert held.rows[0].values == "100.0 [100.0, 100.0] vs 0.0 [0.0, 0.0]" and held.rows[0].delta.startswith("+100.0")
    same = _one({"kind": "compare", "budgets": [64], "better": "half", "than": ["copy"]})
    assert same.verdict == "inconclusive" and same.rows[0].p == "1.000" and same.rows[0].delta.startswith("0.0 ")
    worse = _one({"kind": "compare", "budgets": [64], "better": "bad", "than": ["good"]})
    assert worse.verdict == "did not hold" and _p(worse.rows[0].p) < 0.01
    assert worse.rows[0].n == "40 (2 tasks)"


def test_a_difference_on_three_samples_is_inconclusive():
    """``few`` beats ``bad`` on 3 of 40 samples, all in the same direction: mean +7.5 % of FullKV, but the exact
    sign-flip test gives p = 2 / 2**3 = 0.25 (a plain comparison of the means would have said "held")."""
    row = _one({"kind": "compare", "budgets": [64], "better": "few", "than": ["bad"]})
    assert row.verdict == "inconclusive" and row.rows[0].p == "0.250"
    assert row.rows[0].values.startswith("7.5 [")


def test_holm_over_the_rivals_and_the_combined_verdict():
    row = _one({"kind": "compare", "budgets": [64], "better": "half", "than": ["bad", "good", "copy"]})
    verdicts = [r.verdict for r in row.rows]
    assert verdicts == ["held", "did not hold", "inconclusive"] and row.verdict == "did not hold"
    # 20 non-zero differences of one sign each: Monte Carlo p = 1 / 10,001, times 3 and 2 by Holm
    assert [r.p for r in row.rows] == ["<0.001", "<0.001", "1.000"]
    assert _one({"kind": "compare", "budgets": [64], "better": "good", "than": ["bad", "half"]}).verdict == "held"


def test_lower_is_better_flips_the_direction():
    row = _one({"kind": "compare", "budgets": [64], "better": "bad", "than": ["good"], "lower_is_better": True})
    assert row.verdict == "held" and row.rows[0].summary.startswith("vs good +100.0 (p")


def test_resident_kv_beside_the_numbers_and_the_bytes_note():
    row = _one({"kind": "compare", "budgets": [64], "better": "copy", "than": ["bad"]})
    assert row.rows[0].kv == "8.0 vs 4.0" and row.rows[0].note == "keeps 2.0x bad's bytes"
    assert row.notes == ["copy keeps 2.0x bad's bytes"]
    assert _one({"kind": "compare", "budgets": [64], "better": "good", "than": ["copy"]}).rows[0].note == ""
    assert resident_kv_bytes({"resident_kv_bytes_mean": 1.0, "resident_kv_bytes_final_mean": 5.0}) == 5.0
    assert resident_kv_bytes({"resident_kv_bytes_mean": 3}) == 3.0 and resident_kv_bytes({}) is None


def test_near_full_compares_the_interval_with_the_threshold():
    claim = {"kind": "near_full", "budgets": [64], "at_least": 95}
    good = _one({**claim, "method": "good"})
    assert good.verdict == "held" and good.rows[0].values == "100.0 [100.0, 100.0]"
    assert good.rows[0].note == "keeps 12 % of FullKV's bytes"
    assert _one({**claim, "method": "half"}).verdict == "did not hold"
    noisy = [_run("t1", "fullkv", "full", [1.0] * N), _run("t1", "m9", "64", [1.0] * (N - 1) + [0.0])]
    near = _one({**claim, "method": "m9"}, *noisy, tasks=["t1"])  # 95 %: the interval straddles the threshold
    assert near.verdict == "inconclusive" and near.rows[0].values.startswith("95.0 [")


def test_monotone():
    runs = [_run("t1", "fullkv", "full", [1.0] * N),
            *[_run("t1", "up", b, [1.0] * k + [0.0] * (N - k)) for b, k in (("64", 0), ("128", 10), ("512", 20))],
            *[_run("t1", "flat", b, [1.0] * 10 + [0.0] * 10) for b in ("64", "128", "512")],
            *[_run("t1", "down", b, [1.0] * k + [0.0] * (N - k)) for b, k in (("64", 0), ("128", 20), ("512", 0))]]
    claim = {"kind": "monotone", "budgets": [64, 128, 512], "methods": ["up", "flat", "down"]}
    up, flat, down = evaluate(claim, _evidence(*runs), ["t1"])
    assert (up.budget, up.verdict) == ("up 64/128/512", "held")
    assert up.rows[0].values == "0.0 [0.0, 0.0] -> 50.0 [30.0, 70.0] -> 100.0 [100.0, 100.0]"
    assert flat.verdict == "inconclusive" and flat.rows[0].p == "1.000; steps 1.000, 1.000"
    assert down.verdict == "did not hold"  # +100 then -100: a significant decrease at the larger budget


def test_pairing_on_sample_ids_and_dataset_strata():
    # the method lacks sample 0: only the 19 shared samples count
    runs = [_run("t1", "fullkv", "full", [1.0] * N), _run("t1", "a", "64", [1.0] * N),
            _run("t1", "b", "64", [0.0] * (N - 1), ids=[f"t1-{i}" for i in range(1, N)])]
    row = _one({"kind": "compare", "budgets": [64], "better": "a", "than": ["b"]}, *runs, tasks=["t1"])
    assert row.rows[0].n == "19 (1 task)"
    # a benchmark of two datasets (4 and 16 samples) is the mean of the datasets' means
    ds = ["x"] * 4 + ["y"] * 16
    runs = [_run("lb", "fullkv", "full", [2.0] * 4 + [1.0] * 16, datasets=ds),
            _run("lb", "a", "64", [2.0] * 4 + [0.0] * 16, datasets=ds), _run("lb", "b", "64", [0.0] * N, datasets=ds)]
    evidence = _evidence(*runs)
    assert evidence.full["lb"] == pytest.approx(1.5)
    row = _one({"kind": "compare", "budgets": [64], "better": "a", "than": ["b"]}, *runs, tasks=["lb"])
    assert row.rows[0].values.startswith("66.7 [")  # (100 % on x + 0 % on y of FullKV's 1.5) = (2/1.5)/2


def test_missing_runs_and_fullkv_solves():
    assert _one({"kind": "compare", "budgets": [512], "better": "good", "than": ["bad"]}).verdict == "not run"
    runs = [*_base(), _run("retr", "fullkv", "full", [0.0] * 6)]
    (solves,) = evaluate({"kind": "fullkv_solves", "tasks": ["retr"], "at_least": 50}, _evidence(*runs), [])
    assert solves.verdict == "not testable here" and solves.rows[0].values == "FullKV retr = 0.00 (needs >= 50)"
    # a task whose FullKV scores 0 is left out of every comparison
    row = _one({"kind": "compare", "budgets": [64], "better": "good", "than": ["bad"]}, *runs,
               tasks=["t1", "t2", "retr"])
    assert row.rows[0].n == "40 (2 tasks)"


def test_templated_labels_pod_window():
    runs = [_run("t1", "fullkv", "full", [1.0] * N), _run("t1", "pod", "window16+48", [1.0] * N),
            _run("t1", "a", "64", [0.0] * N)]
    row = _one({"kind": "compare", "budgets": [64], "better": "pod@window16+{r}", "than": ["a"]}, *runs,
               tasks=["t1"])
    assert row.verdict == "held" and row.rows[0].compared == "pod vs a"


def test_a_configuration_named_exactly():
    """``d2o`` is the first run in load order (the default sorts first); ``d2o[allocation=paper_literal]`` is that
    configuration's run, in comparisons, ratio budgets and the summary; the plain name never falls back to it."""
    runs = [_run("t1", "fullkv", "full", [1.0] * N, kv=32 * MIB),
            _run("t1", "d2o", "64", [1.0] * N),
            _run("t1", "d2o", "64", [0.0] * N, label="d2o[allocation=paper_literal]"),
            _run("t1", "d2o", "0.5", [1.0] * N, kv=16 * MIB, label="d2o[allocation=paper_literal]"),
            _run("t1", "h2o", "64", [0.5] * N), _run("t1", "h2o", "0.5", [0.0] * N, kv=16 * MIB),
            _run("t1", "pod", "window16+48", [1.0] * N, kv=22 * MIB, label="POD-TF[n_r=48]"),
            _run("t1", "streamingllm", "0.7", [0.0] * N, kv=22 * MIB)]
    official = _one({"kind": "compare", "budgets": [64], "better": "d2o", "than": ["h2o"]}, *runs, tasks=["t1"])
    literal = _one({"kind": "compare", "budgets": [64], "better": "d2o[allocation=paper_literal]", "than": ["h2o"]},
                   *runs, tasks=["t1"])
    assert official.verdict == "held" and literal.verdict == "did not hold"
    assert literal.rows[0].compared == "d2o[allocation=paper_literal] vs h2o"
    ratio = _one({"kind": "compare", "budgets": [0.5], "better": "d2o[allocation=paper_literal]", "than": ["h2o"]},
                 *runs, tasks=["t1"])
    assert ratio.budget == "0.5" and ratio.verdict == "held" and ratio.rows[0].kv == "16.0 vs 16.0"
    # where only another configuration ran, the plain name is that run (the first in load order) and the report
    # names it under the table; the exact name of a configuration that did not run is "not run"
    assert _one({"kind": "compare", "budgets": [0.5], "better": "d2o", "than": ["h2o"]}, *runs,
                tasks=["t1"]).verdict == "held"
    assert _one({"kind": "compare", "budgets": [0.5], "better": "d2o[allocation=uniform]", "than": ["h2o"]}, *runs,
                tasks=["t1"]).verdict == "not run"
    # POD at StreamingLLM's bytes: a ratio-budget rival named by its label; POD's display name does not matter
    pod = _one({"kind": "compare", "budgets": [64], "better": "pod@window16+{r}", "than": ["streamingllm@0.7"]},
               *runs, tasks=["t1"])
    assert pod.verdict == "held" and pod.rows[0].kv == "22.0 vs 22.0" and not pod.rows[0].note
    spec = {"model": "m", "tasks": ["t1"], "claims": [
        {"paper": "D2O", "claim": "x", "kind": "compare", "budgets": [64, 0.5],
         "better": "d2o[allocation=paper_literal]", "than": ["h2o"]},
        {"paper": "all", "claim": "y", "kind": "monotone", "budgets": [64, 0.5],
         "methods": ["d2o[allocation=paper_literal]"]}]}
    text = claims_markdown(spec, _evidence(*runs))
    assert "| d2o[allocation=paper_literal] | 0.0 [0.0, 0.0] · 4.0 | 100.0 [100.0, 100.0] · 16.0 |  |" in text
    assert "| d2o | 100.0 [100.0, 100.0] · 4.0 |  |  |" in text
    assert "| method | 64 | 0.5 | 0.7 |" in text and "Budgets below 1 are ratios of each prompt." in text
    assert "| streamingllm |  |  | 0.0 [0.0, 0.0] · 22.0 |" in text
    assert "not the method's current default" not in text  # an exactly named configuration is not flagged
    spec["claims"][0]["better"] = "d2o"
    assert "`d2o` = `d2o[allocation=paper_literal]`" in claims_markdown(spec, _evidence(*runs))
    # a plain name read from another configuration's runs says so in the verdict (the row and the README bullet)
    stale = _one({"kind": "compare", "budgets": [0.5], "better": "d2o", "than": ["h2o"]}, *runs, tasks=["t1"])
    assert stale.ran_as == "d2o[allocation=paper_literal]" and stale.notes[0] == "ran as d2o[allocation=paper_literal]"
    assert official.ran_as == "" and literal.ran_as == "" and pod.ran_as == ""  # default / named / display name


def _write_store(root: Path) -> None:
    for run in _base():
        path = root / "runs" / "m" / run["task"] / run["method"] / run["budget"] / "abc"
        path.mkdir(parents=True)
        (path / "config.yaml").write_text(yaml.safe_dump({"key": {"method": {"name": run["method"]}}}))
        (path / "scores.json").write_text(json.dumps({**run["scores"], "model": "m", "task": run["task"],
                                                      "method": run["method"], "budget": run["budget"],
                                                      "score": run["score"], "n_samples": N}))
        (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["records"]))


def test_markdown_and_file(tmp_path):
    from kvbench.report.store import load_runs

    _write_store(tmp_path)
    (tmp_path / "claims.yaml").write_text(
        "model: m\ntasks: [t1, t2]\nclaims:\n"
        "  - {paper: P, claim: good beats bad, kind: compare, budgets: [64], better: good, than: [bad]}\n"
        "  - {paper: P, claim: few beats bad, kind: compare, budgets: [64], better: few, than: [bad]}\n")
    runs = load_runs(tmp_path)
    path = write_claims(tmp_path, runs, tmp_path / "report")
    text = path.read_text()
    assert "| P | good beats bad |  | 64 | vs bad +100.0 (p <0.001) | **held** |" in text
    assert "| P | few beats bad |  | 64 | vs bad +7.5 (p 0.250) | **inconclusive** |" in text
    assert "| P | 64 | good vs bad | 100.0 [100.0, 100.0] vs 0.0 [0.0, 0.0] | +100.0 [+100.0, +100.0] | <0.001 | " \
           "40 (2 tasks) | 4.0 vs 4.0 | held |" in text
    assert "Verdicts: held 1, inconclusive 1." in text
    # the summary: % FullKV [interval] · resident MiB per method and budget
    assert "| good | 100.0 [100.0, 100.0] · 4.0 |" in text and "FullKV keeps 32.0 MiB" in text
    spec = load_claims(tmp_path / "claims.yaml")
    assert text == claims_markdown(spec, Evidence(runs, "m", tmp_path))  # deterministic
    assert write_claims(tmp_path / "report", runs, tmp_path / "x") is None  # no claims.yaml: nothing


def test_unknown_kind_names_the_valid_ones(tmp_path):
    (tmp_path / "claims.yaml").write_text("model: m\nclaims:\n  - {claim: x, kind: better}\n")
    with pytest.raises(ValueError, match=r"kind='better'.*compare, near_full, monotone, fullkv_solves"):
        load_claims(tmp_path / "claims.yaml")
