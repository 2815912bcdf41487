"""kvbench.report: the papers' tables re-aggregated from their own cells, our numbers from a store, figures, the
one-line regeneration (deterministic) and the analysis notebook.

Expected values are computed here independently (csv module + plain arithmetic) or are the documented exceptions of
results/paper/NOTES.md, listed one by one.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from kvbench.analysis.layer_similarity import filter_similarity
from kvbench.errors import ConfigError
from kvbench.report import names
from kvbench.report.cli import main as report_main
from kvbench.report.cli import run_all
from kvbench.report.figures import nll_curve
from kvbench.report.ours import Lookup, Target
from kvbench.report.paper import load_raw
from kvbench.report.render import to_csv, to_frame, to_latex, to_markdown
from kvbench.report.runs import groups, length_drift, runs_table
from kvbench.report.similarity import filter_ability
from kvbench.report.specs import Derived, get_spec, load_specs, select_specs
from kvbench.report.store import load_runs, method_label, records
from kvbench.report.tables import build_table

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "results" / "paper"
FIXTURE = Path(__file__).parent / "fixtures" / "results"
LB16 = ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
        "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]

# ---- the printed numbers the papers' own rules do not reproduce, each with its reason -----------------------------
#: NOTES.md section 3, "true inconsistencies"
DOCUMENTED_MISPRINTS = {
    ("OmniKV", "Table 1", "Llama-3-8B-262K | OmniKV-exp | Mem=30%", "avg"): "Avg 38.3, mean of categories 36.33",
    ("OmniKV", "Table 1", "Yi-9B-200K | InfLLM | Mem=~30%", "avg"): "Avg 38.8, mean of categories 40.42",
    ("KVMerger", "Table 3", "Llama2-7B-chat | pivot=Random | 50%", "avg"): "avg 22.12, mean of 5 tasks 22.32",
    ("POD", "Table 4", "LLaMA3-8B-32K | POD", "summary:performance degradation (%)"): "2.8% printed, 1.08%",
    ("POD", "Table 4", "LLaMA3-8B-32K | POD+SnapKV", "summary:performance degradation (%)"): "3.1% printed, 2.87%",
    ("D2O", "Table 17", "Llama-2-7B | delta(D2O - best baseline) | rho=0.2", "samsum"): "1.79, computed 2.31",
    ("D2O", "Table 17", "Llama-2-7B | delta(D2O - best baseline) | rho=0.2", "lcc"): "2.31, computed 3.71",
}
#: NOTES.md documents these as agreeing only within a tolerance (not exactly)
WITHIN_DOCUMENTED_TOLERANCE = {
    ("D2O", "Table 17", "Llama-2-7B | delta(D2O - best baseline) | rho=0.2", "multifieldqa_en"): "within ±0.03",
    ("D2O", "Table 17", "Llama-2-7B | delta(D2O - best baseline) | rho=0.2", "2wikimqa"): "within ±0.03",
    ("D2O", "Table 17", "Llama-3-8B | delta(D2O - best baseline) | rho=0.2", "hotpotqa"): "within ±0.03",
    # OmniKV Table 1's category scores vs the truncated means of Tables 4/5 (NOTES.md section 2: 114 of 126 exact,
    # the rest within [-0.13, +0.03]; these are the 12)
    **{("OmniKV", "Table 1", row, col): "category vs truncated sub-task mean, NOTES.md section 2" for row, col in [
        ("Llama-3-8B-262K | H2O | Mem=30%", "Summarization"), ("Llama-3-8B-262K | H2O | Mem=30%", "Few-shot"),
        ("Llama-3-8B-262K | InfLLM | Mem=~30%", "Single-Doc QA"),
        ("Llama-3-8B-262K | OmniKV-uniform | Mem=30%", "Single-Doc QA"),
        ("Llama-3-8B-262K | OmniKV-exp | Mem=30%", "Code"), ("Yi-9B-200K | FullKV | full", "Summarization"),
        ("Yi-9B-200K | H2O | Mem=30%", "Single-Doc QA"), ("Yi-9B-200K | StreamingLLM | Mem=30%", "Summarization"),
        ("Yi-9B-200K | OmniKV-last | Mem=30%", "Single-Doc QA"),
        ("Yi-9B-200K | OmniKV-last | Mem=30%", "Summarization"), ("Yi-9B-200K | OmniKV-last | Mem=30%", "Code"),
        ("Llama-3.1-70B | FullKV | full", "Single-Doc QA")]},
}
#: below NOTES.md's 0.05 disagreement threshold, so not listed there; found by this exact check
FOUND_BELOW_NOTES_THRESHOLD = {
    ("KVMerger", "Table 1", "Llama2-7B-chat | H2O | 50%", "avg"): "34.00 printed, mean 33.9922",
    ("KVMerger", "Table 1", "Llama2-7B-chat | KVMerger | 50%", "avg"): "35.02 printed, mean 34.9967",
    ("KVMerger", "Table 1", "Llama2-13B-chat | H2O | 50%", "avg"): "32.40 printed, mean 32.4089",
    ("POD", "Table 1", "LLaMA3-8B-32K | FullKV | 32K", "leval_avg"): "27.45 printed, mean 27.4433",
}


@pytest.fixture(scope="module")
def paper_tables():
    return {spec.title: build_table(spec) for spec in load_specs()}


def test_every_printed_average_is_reproduced_except_the_listed_ones(paper_tables):
    failed = {(t.spec.paper, t.spec.table, c.row, c.column) for t in paper_tables.values() for c in t.checks
              if not c.ok}
    expected = set(DOCUMENTED_MISPRINTS) | set(WITHIN_DOCUMENTED_TOLERANCE) | set(FOUND_BELOW_NOTES_THRESHOLD)
    assert failed == expected
    for table in paper_tables.values():  # the small ones really are small
        for c in table.checks:
            key = (table.spec.paper, table.spec.table, c.row, c.column)
            if key in WITHIN_DOCUMENTED_TOLERANCE or key in FOUND_BELOW_NOTES_THRESHOLD:
                assert abs(c.printed - c.exact) < 0.15
    omnikv = paper_tables["OmniKV Table 1"]
    categories = [c for c in omnikv.checks if c.column != "avg"]
    assert len(categories) == 126 and sum(c.ok for c in categories) == 114  # as NOTES.md counts them


def test_every_table_with_an_average_column_is_checked_row_by_row(paper_tables):
    """Every printed "Avg." is recomputed, except DynamicKV Table 2's sizes 64/96/256/1024: the paper prints only
    their averages (no per-dataset numbers anywhere)."""
    printed = unchecked = 0
    for spec in load_specs():
        rows = list(csv.DictReader((PAPER / spec.file).open(encoding="utf-8")))
        averages = [r for r in rows if r["task"] in ("avg", "leval_avg") and r["value"]]
        table = paper_tables[spec.title]
        keys = {(c.row, c.column) for c in table.checks}
        cells = {(r.id, c.id) for r in table.rows for c in table.columns if c.id in ("avg", "leval_avg")
                 and table.cell(r.id, c.id).paper_num is not None}
        assert len(cells) == len(averages), spec.title
        missing = cells - keys
        if spec.title == "DynamicKV Table 2":
            assert {row.rsplit(" | ", 1)[1] for row, _ in missing} == {"64", "96", "256", "1024"}
            assert len(missing) == 16
        else:
            assert not missing, f"{spec.title}: printed averages without a recomputation: {sorted(missing)}"
        printed += len(cells)
        unchecked += len(missing)
    # DynamicKV 44 + 24, OmniKV 21 + 8 + 7 + 3 + 9, KVMerger 21 + 2 + 2 + 4 + 7, POD 24 + 10
    assert (printed, unchecked) == (186, 16)


def test_dynamickv_table1_average_by_hand(paper_tables):
    rows = list(csv.DictReader((PAPER / "dynamickv_table1_longbench.csv").open(encoding="utf-8")))
    table = paper_tables["DynamicKV Table 1"]
    groups: dict[tuple, dict[str, str]] = {}
    for r in rows:
        if r["method_label"] != "(avg length row)":
            groups.setdefault((r["model"], r["method_label"], r["budget"]), {})[r["task"]] = r["value"]
    assert len(groups) == 44
    for (model, label, budget), cells in groups.items():
        mean = sum(float(cells[d]) for d in LB16) / 16
        assert abs(float(cells["avg"]) - mean) <= 0.005 + 1e-9, (model, label, budget)
    row = next(r for r in table.rows if r.model == "Qwen2-7B-Instruct" and r.method == "FullKV")
    mean = sum(float(groups[("Qwen2-7B-Instruct", "- FullKV", "full")][d]) for d in LB16) / 16
    assert table.cell(row.id, "avg").recomputed == pytest.approx(math.floor(mean * 100 + 0.5) / 100)


def test_omnikv_categories_are_truncated_means_of_tables_4_and_5(paper_tables):
    values = {}
    for name in ("omnikv_table4_longbench_part1.csv", "omnikv_table5_longbench_part2.csv"):
        for r in csv.DictReader((PAPER / name).open(encoding="utf-8")):
            if r["model"] == "Yi-9B-200K" and r["method"] == "OmniKV-last":
                values[r["task"]] = float(r["value"])
    code = math.floor((values["lcc"] + values["repobench-p"]) / 2 * 10) / 10
    table = paper_tables["OmniKV Table 1"]
    row = "Yi-9B-200K | OmniKV-last | Mem=30%"
    assert table.cell(row, "Code").recomputed == pytest.approx(code) and table.cell(row, "Code").paper == "65.3"
    multi = math.floor(sum(values[t] for t in ("2wikimqa", "dureader", "hotpotqa", "musique")) / 4 * 10) / 10
    assert table.cell(row, "Multi-Doc QA").recomputed == pytest.approx(multi) == float(table.cell(row,
                                                                                                 "Multi-Doc QA").paper)


def test_retention_and_dynamickv_claims(paper_tables):
    """DynamicKV Sec. 5.2 says Qwen retains 78 % at 128; its Table 1 gives 35.82 / 40.71 = 88 % (NOTES.md)."""
    table = paper_tables["DynamicKV Table 2"]
    row = next(r for r in table.rows if r.model == "Qwen2-7B-Instruct" and r.budget == "128")
    assert table.cell(row.id, "avg %full").paper == f"{100 * 35.82 / 40.71:.1f}" == "88.0"
    t1 = paper_tables["DynamicKV Table 1"]  # Table 2's 128/512 rows are Table 1's DynamicKV averages
    for r in (r for r in table.rows if r.budget in ("128", "512")):
        mine = next(x for x in t1.rows if x.model == r.model and x.method == "DynamicKV" and x.budget == r.budget)
        assert table.cell(r.id, "avg").paper == t1.cell(mine.id, "avg").paper


def test_every_printed_cell_lands_in_its_table(paper_tables):
    """No printed number is lost or overwritten by the layout (D2O Table 3 prints its Full row twice, identically)."""
    for spec in load_specs():
        raw = load_raw(spec)
        table = paper_tables[spec.title]
        shown = sum(1 for r in table.rows for c in table.columns if not c.retained_of
                    and table.cell(r.id, c.id).paper not in (None, "OOM"))
        distinct = raw[raw["value"].notna()].drop_duplicates(
            ["model", "method", "method_label", "budget", "task", "category", "context_length", "metric", "value"])
        assert shown == len(distinct), spec.title
        text = to_markdown(table)
        assert text.count("\n| ") == len(table.rows) + 1 and to_latex(table).count("\\\\") >= len(table.rows)
        assert len(to_csv(table).splitlines()) == len(table.rows) + 1


def test_names_map_the_papers_to_kvbench():
    cases = {"full": "full", "32K": "full", "rho=0.2 (assumed)": "0.2", "Mem=30%": "0.3", "Mem=~20%": "0.2",
             "Mem=40.0%": "0.4", "50%": "0.5", "35%": "0.35", "128": "128", "256 (assumed)": "256", "4K": "4096",
             "16+4080": "4096", "96+4000": "4096", "16+4080+28K": "window16+4080", "not stated": None,
             "2048 tokens/sparse layer (per text)": "2048"}
    assert {k: names.budget_label(k) for k in cases} == cases
    assert names.model_name("mistralai/Mistral-7B-Instruct-v0.1 (paper says 'v1.0'; inferred)") == \
        "mistral-7b-instruct-v0.1"
    assert names.model_name("meta-llama/Meta-Llama-3-8B") == "llama3-8b"
    assert names.model_name("(not released) post-trained from meta-llama/Meta-Llama-3-8B") is None
    assert [names.clean_label(x) for x in ("$H_2O$", "H <sub>2</sub> O", "<i>KVMerger</i>", "- FullKV")] == \
        ["H2O", "H2O", "KVMerger", "FullKV"]
    assert Derived("avg", "all", "round", 2).candidates(44.756) == [44.76]
    assert Derived("avg", "all", "truncate", 2).candidates(44.756) == [44.75]
    assert Derived("avg", "all", "round_or_truncate", 1).candidates(36.35) == [36.3, 36.4]


def test_bad_specs_and_selections_fail_clearly():
    with pytest.raises(ConfigError, match="rounding='nearest'"):
        Derived("avg", "all", "nearest")
    with pytest.raises(ConfigError, match="DynamicKV"):
        select_specs(["Dynamo:1"])
    assert [s.id for s in select_specs(["dynamickv:2", "POD"])] == ["dynamickv_t2", "pod_t1", "pod_t2", "pod_t3",
                                                                     "pod_t4"]


# ---- our numbers from a hand-built store ------------------------------------------------------------------------
def write_job(root: Path, model: str, task: str, method: dict, budget: str, scores: dict, task_cfg: dict | None = None,
              recs: list[dict] | None = None) -> Path:
    key = {"model": {"name": model}, "method": method, "budget": budget, "task": {"task": task, **(task_cfg or {})}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = root / "runs" / model / task / method["name"] / budget / digest
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"key": key}))
    full = {"model": model, "task": task, "method": method["name"], "budget": budget, "metric": "longbench",
            "n_samples": 1, **scores}
    (path / "scores.json").write_text(json.dumps(full))
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs or []))
    return path


def h2o(**fields):
    return {"name": "h2o", "recent_ratio": 0.5, "window": 32, "variant": "paper", "group_agg": "mean", "chunk": 512,
            **fields}


def test_ours_and_delta_and_retention_from_a_store(tmp_path):
    full = {d: 30.0 + i for i, d in enumerate(LB16)}
    mine = {d: 20.0 + i / 3 for i, d in enumerate(LB16)}
    lb = {"variant": "longbench"}
    write_job(tmp_path, "toy", "longbench", {"name": "fullkv"}, "full", {"datasets": full, "score": 0}, lb)
    write_job(tmp_path, "toy", "longbench", h2o(variant="prefill_only"), "128", {"datasets": mine, "score": 0}, lb)
    write_job(tmp_path, "toy", "longbench", h2o(), "512", {"datasets": mine, "score": 0}, lb)  # decode-time H2O
    runs = load_runs(tmp_path)
    assert list(runs["method_label"]) == ["fullkv", "h2o", "h2o[variant=prefill_only]"]
    table = build_table(get_spec("DynamicKV", "Table 1"), runs, ours_models={"LlaMA-3-8B-Instruct": "toy"})
    llama = [r for r in table.rows if r.model == "LlaMA-3-8B-Instruct"]
    h2o_128 = next(r for r in llama if r.method == "H2O" and r.budget == "128")
    assert h2o_128.target.method == {"name": "h2o", "variant": "prefill_only"}
    cell = table.cell(h2o_128.id, "qasper")
    wanted = ("LlaMA-3-8B-Instruct", "H2O", "128", "qasper")
    printed = next(r["value"] for r in csv.DictReader((PAPER / "dynamickv_table1_longbench.csv").open())
                   if (r["model"], r["method"], r["budget"], r["task"]) == wanted)
    assert cell.paper == printed and cell.ours == pytest.approx(mine["qasper"])
    assert cell.delta == pytest.approx(mine["qasper"] - float(printed))
    expected_avg = math.floor(sum(mine.values()) / 16 * 100 + 0.5) / 100
    assert table.cell(h2o_128.id, "avg").ours == pytest.approx(expected_avg)
    full_avg = math.floor(sum(full.values()) / 16 * 100 + 0.5) / 100
    assert table.cell(h2o_128.id, "avg %full").ours == pytest.approx(round(100 * expected_avg / full_avg, 1))
    h2o_512 = next(r for r in llama if r.method == "H2O" and r.budget == "512")
    assert table.cell(h2o_512.id, "qasper").ours is None  # KVCache-Factory's H2O, not the decode-time one
    other_model = next(r for r in table.rows if r.model == "Qwen2-7B-Instruct" and r.method == "H2O")
    assert table.cell(other_model.id, "qasper").ours is None
    frame = to_frame(table)
    assert "HotpotQA ours" in frame.columns and "HotpotQA Δ" in frame.columns
    assert frame.loc[frame["Method"] == "FullKV", "kvbench"].iloc[0] == "fullkv @ full"
    # a POD row in a POD-adapted table says what it is
    pod = build_table(get_spec("POD", "Table 1"), runs)
    assert any("needs post-training; ours: POD-TF" in r.label for r in pod.rows)


def test_resident_kv_beside_our_numbers_in_every_table(tmp_path):
    lb = {"variant": "longbench"}
    mib = 2**20
    write_job(tmp_path, "toy", "longbench", {"name": "fullkv"}, "full",
              {"datasets": {"qasper": 30.0}, "score": 30.0, "resident_kv_bytes_mean": 64 * mib}, lb)
    write_job(tmp_path, "toy", "longbench", h2o(variant="prefill_only"), "128",
              {"datasets": {"qasper": 20.0}, "score": 20.0, "resident_kv_bytes_mean": 6 * mib}, lb)
    write_job(tmp_path, "toy", "pg19", {"name": "fullkv"}, "full",
              {"score": 23.0, "resident_kv_bytes_mean": 0.5 * mib, "resident_kv_bytes_final_mean": 45 * mib})
    runs = load_runs(tmp_path)
    frame = to_frame(build_table(get_spec("DynamicKV", "Table 1"), runs, ours_models={"LlaMA-3-8B-Instruct": "toy"}))
    llama = frame[frame["Model"] == "LlaMA-3-8B-Instruct"]
    kv = dict(zip(llama["kvbench"], llama["kvbench KV MiB"]))
    assert kv["fullkv @ full"] == "64.0" and kv["h2o[variant=prefill_only] @ 128"] == "6.0"
    assert frame.loc[frame["Model"] == "Qwen2-7B-Instruct", "kvbench KV MiB"].eq("").all()  # no run of ours
    pg19 = runs_table(runs, "toy", "pg19")  # PG-19 streams through decoding: the cache at the end is what it kept
    assert list(pg19.columns[-9:-4]) == ["KV MiB", "KV MiB at end", "prefill s", "decode ms/tok", "run"]
    assert list(pg19.columns[-4:]) == ["new tok", "len_vs_full", "decode ms/sample", "decode_vs_full"]  # appended
    assert list(pg19["KV MiB at end"]) == ["45.000"]
    assert "KV MiB at end" not in runs_table(runs, "toy", "longbench").columns


def _lengths(**by_id):
    return [{"id": i, "new_tokens": n, "score": 0.0} for i, n in by_id.items()]


def test_output_length_drift_pairs_samples_with_fullkv(tmp_path):
    """FullKV generated 10 tokens and the method 15 on the same samples: len_vs_full 1.50. Samples only one run has
    (FullKV's c, the method's d) are left out of the ratio; the implied decode time is ms/tok x mean new tokens."""
    write_job(tmp_path, "toy", "needle", {"name": "fullkv"}, "full", {"score": 1.0, "decode_ms_per_token": 20.0},
              recs=_lengths(a=10, b=10, c=100))
    write_job(tmp_path, "toy", "needle", {"name": "snapkv"}, "128", {"score": 0.5, "decode_ms_per_token": 10.0},
              recs=_lengths(a=15, b=15, d=1000))
    write_job(tmp_path, "toy", "needle", {"name": "streamingllm"}, "128", {"score": 0.5, "decode_ms_per_token": 10.0},
              recs=_lengths(x=7))  # no sample in common with FullKV
    write_job(tmp_path, "other", "needle", {"name": "snapkv"}, "128", {"score": 0.5, "decode_ms_per_token": 10.0},
              recs=_lengths(a=15))  # no FullKV run for this model
    runs = load_runs(tmp_path)
    table = runs_table(runs, "toy", "needle").set_index("method")
    assert table.loc["fullkv", "len_vs_full"] == "1.00" and table.loc["fullkv", "decode_vs_full"] == "1.00"
    assert table.loc["snapkv", "len_vs_full"] == "1.50"  # (15+15)/2 over (10+10)/2; with c and d it would be 8.58
    assert table.loc["snapkv", "new tok"] == "343.3"  # the run's own mean, every sample
    assert table.loc["snapkv", "decode ms/sample"] == f"{10.0 * (15 + 15 + 1000) / 3:.1f}"
    assert table.loc["snapkv", "decode_vs_full"] == "0.75"  # 1.5 x (10 ms/tok) / (20 ms/tok)
    assert table.loc["fullkv", "decode ms/sample"] == f"{20.0 * 120 / 3:.1f}"
    assert table.loc["streamingllm", "len_vs_full"] == "" and table.loc["streamingllm", "decode_vs_full"] == ""
    alone = runs_table(runs, "other", "needle")
    assert list(alone["len_vs_full"]) == [""] and list(alone["decode_vs_full"]) == [""]
    assert list(alone["decode ms/sample"]) == ["150.0"]
    assert length_drift({"a": 3.0}, {"a": 0.0}) is None and length_drift({"a": 3.0}, None) is None
    assert length_drift({"a": 3.0, "b": 1.0}, {"b": 2.0}) == 0.5
    # the report writes the columns in every format
    index = run_all(tmp_path, tmp_path / "report", {}, paper_tables="none")
    csv_text = (index.parent / "tables" / "runs_toy_needle.csv").read_text()
    header, full_row, snap_row = csv_text.splitlines()[:3]
    assert header.endswith("new tok,len_vs_full,decode ms/sample,decode_vs_full")
    assert snap_row.split(",")[-3] == "1.50"
    assert "len\\_vs\\_full" in (index.parent / "tables" / "runs_toy_needle.tex").read_text()
    assert "| len_vs_full |" in (index.parent / "tables" / "runs_toy_needle.md").read_text()


def test_runs_of_one_task_with_different_protocols_are_kept_apart(tmp_path):
    """needle and needle_chat are both task "needle": their tables and figures must not mix."""
    write_job(tmp_path, "m", "needle", {"name": "fullkv"}, "full", {"score": 1.0}, {"chat_template": True})
    write_job(tmp_path, "m", "needle", {"name": "fullkv"}, "full", {"score": 2.0}, {"chat_template": False})
    write_job(tmp_path, "m", "needle", {"name": "pod", "n_s": 16}, "window16+4080", {"score": 1.5},
              {"chat_template": False})
    runs = load_runs(tmp_path)
    assert sorted(groups(runs)) == [("m", "needle", "chat_template=False"), ("m", "needle", "chat_template=True")]
    table = runs_table(runs, "m", "needle", "chat_template=False")
    assert list(table["method"]) == ["fullkv", "POD-TF"] and list(table["% FullKV"]) == ["100.0", "75.0"]


def test_lookup_prefers_the_exact_variant_then_more_samples(tmp_path):
    lb = {"variant": "longbench"}
    write_job(tmp_path, "m", "longbench", h2o(chunk=256), "128", {"datasets": {"trec": 1.0}, "counts": {"trec": 9}}, lb)
    write_job(tmp_path, "m", "longbench", h2o(), "128", {"datasets": {"trec": 2.0}, "counts": {"trec": 3}}, lb)
    write_job(tmp_path, "m", "longbench", h2o(window=31), "128", {"datasets": {"trec": 3.0}, "counts": {"trec": 5}},
              {"variant": "longbench_e"})
    lookup = Lookup(load_runs(tmp_path))
    assert lookup.get(Target("m", {"name": "h2o"}, "128"), "trec")[0] == 2.0  # default fields beat chunk=256
    assert lookup.get(Target("m", {"name": "h2o", "chunk": 256}, "128"), "trec")[0] == 1.0
    write_job(tmp_path, "m", "longbench", h2o(group_agg="mean", recent_ratio=0.50000000001), "128",
              {"datasets": {"trec": 4.0}, "counts": {"trec": 7}}, lb)
    lookup = Lookup(load_runs(tmp_path))
    assert lookup.get(Target("m", {"name": "h2o"}, "128"), "trec")[0] == 4.0  # more samples among exact matches
    assert lookup.get(Target("m", {"name": "h2o"}, "64"), "trec") == (None, None)
    assert method_label(h2o(variant="prefill_only", chunk=512)) == "h2o[variant=prefill_only]"


def test_method_labels_compare_with_the_resolved_defaults():
    """A field whose default None resolves by variant is recorded resolved in a run's key: not a non-default field."""
    resolved = {"name": "dynamickv", "granularity": "kv_head", "count_remainder": False, "schedule": "paper",
                "score_dtype": "float32", "allocation_arithmetic": "exact"}
    assert method_label(resolved) == "dynamickv"
    assert method_label({**resolved, "schedule": "official_code"}) == "dynamickv[schedule=official_code]"
    old_d2o = {"name": "d2o", "allocation": "variance_softmax", "beta": 0.7, "variance_norm": "zscore"}
    assert method_label(old_d2o) == "d2o[allocation=variance_softmax,variance_norm=zscore]"


# ---- runs that never compressed (the transformers 5.24 rename ran every method as FullKV) ---------------------------
def write_measured_job(root: Path, method: str, budget: str, kept: int, transformers: str = "5.24.0") -> Path:
    """A job whose two records kept ``kept`` of their 300 prompt tokens in every layer, with its meta.json."""
    recs = [{"id": f"s{i}", "prompt_tokens": 300, "layer_entries": [kept] * 4, "attended_tokens_mean": kept + 2.0,
             "resident_kv_bytes": kept * 1024, "score": 1.0} for i in range(2)]
    path = write_job(root, "toy", "passkey", {"name": method}, budget, {"score": 1.0}, recs=recs)
    kind, value = ("full", float("inf")) if budget == "full" else ("tokens", int(budget))
    meta = {"versions": {"transformers": transformers}, "method": {"name": method}, "model": {"layers": 4},
            "budget": {"kind": kind, "value": value, "label": budget}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def uncompressed_store(root: Path) -> Path:
    """FullKV, a SnapKV run that compressed, and an H2O run that kept the whole prompt (the one to leave out)."""
    write_measured_job(root, "fullkv", "full", 300)
    write_measured_job(root, "snapkv", "64", 64)
    return write_measured_job(root, "h2o", "64", 300)


def test_load_runs_leaves_out_uncompressed_runs_unless_asked(tmp_path, capsys):
    skipped = uncompressed_store(tmp_path).relative_to(tmp_path).as_posix()
    assert list(load_runs(tmp_path)["method"]) == ["fullkv", "snapkv"]
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: skipping {skipped}: h2o at budget 64 kept every prompt token in every layer")
    assert "(transformers 5.24.0)" in warning and warning.endswith("(--include-uncompressed keeps it)")
    assert list(load_runs(tmp_path, include_uncompressed=True)["method"]) == ["fullkv", "h2o", "snapkv"]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ["tables", "figures", "all"])
def test_report_commands_leave_out_uncompressed_runs_unless_asked(tmp_path, capsys, command):
    store, out = tmp_path / "store", tmp_path / "out"
    uncompressed_store(store)
    argv = [command, "--results", str(store), "--out", str(out)]
    argv += {"tables": ["--tables", "DynamicKV:1"], "all": ["--paper-tables", "none"]}.get(command, [])
    assert report_main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) == 1 and "h2o at budget 64" in warnings[0]
    if command == "all":
        assert "2 finished runs." in (out / "README.md").read_text()
        assert "h2o" not in (out / "tables" / "runs_toy_passkey.csv").read_text()
    assert report_main([*argv, "--include-uncompressed"]) == 0
    assert "warning: skipping" not in capsys.readouterr().err
    if command == "all":
        index = (out / "README.md").read_text()
        assert "3 finished runs." in index and "--paper-tables none --include-uncompressed`" in index
        assert "h2o" in (out / "tables" / "runs_toy_passkey.csv").read_text()


# ---- the committed fixture store (tiny-random runs: scripts/make_report_fixture.py) -----------------------------
@pytest.fixture(scope="module")
def fixture_runs():
    return load_runs(FIXTURE)


def test_all_regenerated_in_place_drops_what_a_deleted_run_drew(tmp_path, fixture_runs):
    """In place, ``all`` equals a report written into an empty directory: a deleted run's figure and table rows go,
    an old claims.md without claims.yaml goes, and files that are not the report's stay."""
    results = tmp_path / "results"
    shutil.copytree(FIXTURE, results)
    out = results / "report"
    run_all(results, out, {}, paper_tables="none")
    assert (out / "figures" / "ratios_tiny-random_kvmerger_0.5.png").is_file()
    (out / "claims.md").write_text("an old claim\n")
    (out / "notes.txt").write_text("mine\n")
    (out / "figures" / "mine.txt").write_text("mine\n")
    kvmerger = fixture_runs[fixture_runs["method"] == "kvmerger"]["path"]
    for path in kvmerger:
        shutil.rmtree(results / path)  # relative to the results directory
    run_all(results, out, {}, paper_tables="none")
    fresh = tmp_path / "fresh"
    run_all(results, fresh, {}, paper_tables="none")
    ours = {"notes.txt", "figures/mine.txt"}
    in_place = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = {p.relative_to(fresh).as_posix(): p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
    assert ours <= set(in_place)
    assert sorted(set(in_place) - ours) == sorted(again)
    assert "figures/ratios_tiny-random_kvmerger_0.5.png" not in in_place and "claims.md" not in in_place
    for rel in again:
        assert in_place[rel] == again[rel], rel


def test_fixture_store_reads_and_method_stats_are_recorded(fixture_runs):
    runs = fixture_runs
    assert set(runs["task"]) == {"needle", "longbench"} and len(runs) == 14
    d2o = runs[(runs["method"] == "d2o") & (runs["budget"] == "0.2")].iloc[0]
    for rec in records(FIXTURE, d2o["path"]):
        stats = rec["method_stats"]
        assert len(stats["layer_variance"]) == 4 and stats["layer_allocation"] == rec["layer_entries"]
    dyn = runs[(runs["method"] == "dynamickv") & (runs["task"] == "needle")].iloc[0]
    for rec in records(FIXTURE, dyn["path"]):
        assert rec["method_stats"]["layer_allocation"] == rec["layer_entries"]
        assert sum(rec["layer_entries"]) == 4 * int(dyn["budget"])  # layers average exactly the budget
    kvm = runs[runs["method"] == "kvmerger"].iloc[0]
    rec = records(FIXTURE, kvm["path"])[0]
    assert rec["method_stats"]["layer_ratio"] == pytest.approx([e / rec["prompt_tokens"] for e in rec["layer_entries"]],
                                                               abs=0.01)


def test_all_regenerates_identically(tmp_path, fixture_runs):
    out = tmp_path / "report"
    a = run_all(FIXTURE, out, {"*": "tiny-random"})
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    shutil.rmtree(out)
    run_all(FIXTURE, out, {"*": "tiny-random"})
    second = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert sorted(first) == sorted(second)
    for rel in first:  # Markdown, CSV, LaTeX, PNG and PDF alike
        assert first[rel] == second[rel], rel
    files_a = sorted(first)
    names_ = {p.name for p in files_a}
    for expected in ("runs_tiny-random_needle.md", "runs_tiny-random_longbench.csv", "dynamickv_t1.tex",
                     "needle_tiny-random_needle.png", "budget_tiny-random_needle_tokens.pdf",
                     "layers_tiny-random_needle_64.png", "layers_by_task_tiny-random_dynamickv_64.png",
                     "variance_tiny-random_needle_0.2.png", "ratios_tiny-random_kvmerger_0.5.png",
                     "similarity_tiny-random.png"):
        assert expected in names_, expected
    index = a.read_text()
    assert "![needle_tiny-random_needle](figures/needle_tiny-random_needle.png)" in index
    needle = (out / "tables" / "runs_tiny-random_needle.csv").read_text().splitlines()
    assert needle[0].startswith("method,budget,rouge1_f_x10,% FullKV,len=400,len=600,n,") and len(needle) == 12
    longbench = list(csv.DictReader((out / "tables" / "runs_tiny-random_longbench.csv").open()))
    assert [r["method"] for r in longbench] == ["fullkv", "dynamickv", "snapkv"]
    for row in longbench:  # score = plain mean of the datasets; % of FullKV from the unrounded scores
        assert float(row["longbench"]) == pytest.approx((float(row["hotpotqa"]) + float(row["lcc"])
                                                         + float(row["trec"])) / 3, abs=0.006)
    full_score = float(fixture_runs[(fixture_runs["method"] == "fullkv") & (fixture_runs["task"] == "longbench")]
                       ["score"].iloc[0])
    for row, run in zip(longbench, ("fullkv", "dynamickv", "snapkv")):
        score = float(fixture_runs[(fixture_runs["method"] == run) & (fixture_runs["task"] == "longbench")]
                      ["score"].iloc[0])
        assert row["% FullKV"] == f"{100 * score / full_score:.1f}"
    table = (out / "tables" / "dynamickv_t1.csv").read_text()
    full = fixture_runs[(fixture_runs["method"] == "fullkv") & (fixture_runs["task"] == "longbench")].iloc[0]
    assert f"{full['scores']['datasets']['hotpotqa']:.2f}" in table


def test_cli_writes_tables_and_rejects_bad_names(tmp_path, capsys):
    assert report_main(["tables", "--paper-only", "--tables", "DynamicKV:2", "--results", str(tmp_path), "--out",
                        str(tmp_path / "t")]) == 0
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["dynamickv_t2.csv", "dynamickv_t2.md",
                                                                  "dynamickv_t2.tex"]
    assert report_main(["--tables", "Nope"]) == 2
    assert "--tables 'Nope' names no table" in capsys.readouterr().err


def test_nll_curve_contract():
    recs = [{"meta": {"nll_curve": [[1, 4.0], [10, 3.0]]}}, {"meta": {"nll_curve": [[1, 2.0]]}},
            {"curve": {"positions": [1, 10], "cum_nll": [3.0, 5.0]}}]
    assert nll_curve({}, recs) == [(1, 3.0), (10, 4.0)]
    assert nll_curve({"curve": {"positions": [5], "cum_nll": [1.5]}}, recs) == [(5, 1.5)]


def test_filter_similarity_against_a_slow_reference():
    torch.manual_seed(0)
    attn = torch.softmax(torch.randn(3, 4, 2, 7), -1)  # (L, Hq, q, n)
    sim = filter_similarity(attn, top_k=3)
    for i in range(3):
        for j in range(3):
            total = 0.0
            for r in range(2):
                best = sorted(range(7), key=lambda t: -max(float(attn[i, h, r, t]) for h in range(4)))[:3]
                total += sum(sum(float(attn[j, h, r, t]) for t in best) for h in range(4)) / 4
            assert sim[i, j] == pytest.approx(total / 2)
    assert filter_ability(sim, 2) == pytest.approx([float(sim[0, 1:3].mean()), float(sim[1, 2]), None][:2] + [None])


def test_a_live_tiny_job_is_read_by_the_report(tmp_path):
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR
    from kvbench.jobs import run_job

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny-random", "method=dynamickv", "budget=48", "task=2stageretr",
                                           "limit=1", "task.max_new_tokens=2", "print_table=false",
                                           f"paths.results_dir={tmp_path}"])
    run_job(cfg)
    runs = load_runs(tmp_path)
    assert list(runs[["model", "task", "method_label", "budget"]].iloc[0]) == ["tiny-random", "2stageretr",
                                                                             "dynamickv", "48"]
    (rec,) = records(tmp_path, runs["path"].iloc[0])
    assert rec["method_stats"]["layer_allocation"] == rec["layer_entries"]


def test_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    work = tmp_path / "notebooks"
    work.mkdir()
    shutil.copy(ROOT / "notebooks" / "analysis.ipynb", work / "analysis.ipynb")
    monkeypatch.setenv("KVBENCH_RESULTS_DIR", str(FIXTURE))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    scratch = tmp_path / "tmpdir"  # the kernel's TMPDIR: the notebook must not leave its figures behind
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    nb = nbformat.read(work / "analysis.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(work)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "14 finished runs" in outputs and "printed derived numbers reproduced" in outputs
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    images = [o for o in outs if "image/png" in o.get("data", {})]
    assert len(images) >= 8
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("kvbench-")]
