"""Every paper table kvbench can regenerate has conf/experiment/<paper>_table<n>.yaml, and planning it (the real
configs, composed by the sweeper's planner; nothing loaded) gives exactly that table's cells of
eval_matrix_cells.csv (a copy of the shared reference): same count, same (model, method + variant, budget, task)
identities. The expected jobs are derived here from the CSV's labels, independently of the experiment files.
"""

from __future__ import annotations

import csv
import functools
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from kvbench.config import CONF_DIR, register_resolvers

CELLS = Path(__file__).parent / "fixtures" / "eval_matrix_cells.csv"
PAPERS = {"D2O": "d2o", "DynamicKV": "dynamickv", "OmniKV": "omnikv", "KVMerger": "kvmerger", "POD": "pod"}

#: Tables with no experiment, and why (everything else in the CSV must have one).
NOT_REGENERATED = {
    ("D2O", "Table 5"): "throughput / max batch: efficiency bench (issue #7), not a sweep",
    ("D2O", "Table 12"): "latency breakdown: efficiency bench (issue #7)",
    ("D2O", "Table 13"): "latency: efficiency bench (issue #7)",
    ("D2O", "Table 14"): "latency vs model size: efficiency bench (issue #7); no 70B config",
    ("OmniKV", "Table 7"): "context selector / bank ablation: latency; 'w/o CS' has no kvbench switch",
    ("OmniKV", "Table 9"): "Llama-3.1-405B: no model config",
    ("OmniKV", "Table 10"): "LightLLM latency, tensor parallel",
    ("OmniKV", "Table 11"): "LightLLM throughput, tensor parallel",
    ("OmniKV", "Table 12"): "tp=8 vs tp=1 in LightLLM",
    ("OmniKV", "Table 13"): "OmniKV-prefill / MInference prefill latency: no such methods",
    ("OmniKV", "Table 14"): "OmniKV-prefill / MInference: no such methods",
    ("KVMerger", "Table 2"): "memory at 3900 + 1024 tokens: efficiency bench (issue #7)",
    ("POD", "Table 2"): "max batch size: efficiency bench (issue #7)",
    ("POD", "Table 4"): "a summary computed from Table 1's results",
}

#: Cells of regenerated tables that no kvbench job can produce, and why (the experiment files say so too).
EXCLUDED = {
    ("D2O", "Table 6", "w.o. EMA-Threshold"): "D2O has no switch that drops the EMA-gated merging",
    ("D2O", "Table 6", "w.o. Both"): "same",
    ("POD", "*", "WindowAttention+CPT"): "continued pre-training",
    ("POD", "*", "POD+SnapKV"): "no composition of the two in kvbench",
    ("OmniKV", "Table 6", "cot:2wikimqa"): "OmniKV's CoT prompts for LongBench are not in kvbench",
    ("OmniKV", "Table 6", "cot:hotpotqa"): "same",
}

LB16 = ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
        "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
OMNIKV17 = ["multifieldqa_en", "narrativeqa", "qasper", "2wikimqa", "dureader", "hotpotqa", "musique", "gov_report",
            "qmsum", "vcsum", "lsht", "trec", "triviaqa", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
ZEROSCROLLS = {"gov_report": "gov_report", "summscreenfd": "summ_screen_fd", "qmsum": "qmsum",
               "squality": "squality", "qasper": "qasper", "narrativeqa": "narrative_qa",
               "booksumsort": "book_sum_sort"}
#: POD's LLaMA3-8B-32K is unreleased: its training-free rows run on this substitute (methods.md A5.7 d).
SUBSTITUTE_MODEL = "llama3.1-8b"

METHODS = {
    "FullKV": "fullkv", "LocalWindow": "local", "WindowAttention": "local", "StreamingLLM": "streamingllm",
    "H2O": "h2o", "H2O+(chunked)": "h2o", "RoCo": "roco", "CaM": "cam", "D2O": "d2o", "D2O-ablation": "d2o",
    "SnapKV": "snapkv", "PyramidKV": "pyramidkv", "DynamicKV": "dynamickv", "PyramidInfer": "pyramidinfer",
    "SirLLM": "sirllm", "LoCoco": "lococo", "KVMerger": "kvmerger", "InfLLM": "infllm", "Quest": "quest",
    "LM-Infinite": "lminfinite", "CLA": "cla", "POD": "pod", "OmniKV-last": "omnikv", "OmniKV-uniform": "omnikv",
    "OmniKV-exp": "omnikv", "OmniKV-last (assumed selector)": "omnikv",
}


# ---- the CSV, read into expected jobs -------------------------------------------------------------------------------
def _rows():
    with open(CELLS, newline="") as fh:
        return list(csv.DictReader(fh))


@functools.cache
def _model_names() -> dict[str, str]:
    """HF id -> conf/model name, from the model configs' ``path``."""
    names = {}
    for path in (CONF_DIR / "model").glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        if spec.get("path"):
            names[spec["path"]] = spec["name"]
    return names


def _method(row) -> tuple[str, dict]:
    label, variant = row["method"], row["variant"]
    name = METHODS[label]
    fields: dict = {}
    if label.startswith("OmniKV-"):
        fields["selector"] = label.split("-")[1].split()[0]
    if match := re.fullmatch(r"allocation=(.*)", variant):
        fields["allocation"] = {"Exponential Decay": "exponential_decay", "Uniform Allocation": "uniform",
                                "Reciprocal of Variance": "reciprocal_variance",
                                "Inverse Variance Softmax (Ours)": "official_code"}[match[1]]
    elif variant.startswith("similarity_feature="):
        fields["similarity_feature"] = {r"$\kappa$": "key", r"$\mathcal{V}$": "value",
                                        r"$\mathcal{K}/\mathcal{V}$": "key_value"}[variant.split("=", 1)[1]]
    elif variant.startswith("merge="):
        fields["merge_weights"] = {"Average": "average", "Weighted average": "weighted"}[variant.split("=")[1]]
    elif match := re.fullmatch(r"N:M=(\d):(\d)", variant):
        fields["recent_fraction"] = int(match[2]) / (int(match[1]) + int(match[2]))  # M / (N + M)
    elif match := re.fullmatch(r"beta=([\d.]+)", variant):
        fields["beta"] = float(match[1])
    elif variant == "w.o. Layer Operation":
        fields["allocation"] = "uniform"
    elif variant.startswith("pivot="):
        fields["pivot"] = {"Ours": "max_attention", "Random": "random"}[variant.split("=")[1]]
    elif variant.startswith("merge_weights="):
        fields["merge_weights"] = variant.split("=")[1].lower()
    elif match := re.fullmatch(r"sigma=(\w+)", variant):
        fields.update({"sigma_mode": "mean_l2"} if match[1] == "ours" else {"sigma_mode": "fixed",
                                                                             "sigma": float(match[1])})
    elif match := re.fullmatch(r"filter layers \{([\d,]+)\}", variant):
        fields["filter_layers"] = tuple(int(x) for x in match[1].split(","))
    if name == "d2o" and not fields and variant.startswith("w.o."):
        raise KeyError(variant)
    return name, fields


def _budget(row, method: str) -> str:
    raw = row["budget"].split(" (")[0].replace("~", "")
    if method == "fullkv":
        return "full"
    if method == "pod":
        return "window16+4080"  # 16 sinks + 4080 recent; POD's jobs are named by their window
    if method == "cla":
        return "0.5"  # sharing factor 2
    if raw.startswith("rho="):
        return f"{float(raw[4:]):g}"
    if raw.startswith("Mem="):
        return f"{float(raw[4:].rstrip('%')) / 100:g}"
    if raw.endswith("%"):
        return f"{float(raw[:-1]) / 100:g}"
    if raw in ("4K", "16+4080", "96+4000"):
        return "4096"
    return str(int(raw))


def _lengths(text: str) -> list[int]:
    return sorted(int(x[:-1]) * 1024 for x in re.findall(r"\d+K", text))


def _tasks(row) -> list[tuple[str, dict, str]]:
    """(task, identity fields, cell label for EXCLUDED) for each job a row's task column needs."""
    text, ctx, table = row["tasks"], row["context_lengths"], (row["paper"], row["table"])
    if table in {("OmniKV", "Table 4"), ("OmniKV", "Table 5")}:  # Table 1's jobs, seen per dataset
        datasets = text.split(": ")[1].split(",")
        assert set(datasets) <= set(OMNIKV17)
        return [("longbench", {"datasets": frozenset(OMNIKV17)}, "")]
    if text.startswith("LongBench(17"):
        return [("longbench", {"datasets": frozenset(OMNIKV17)}, "")]
    if text.startswith("avg(LongBench (16"):
        return [("longbench", {"datasets": frozenset(LB16)}, "")]
    if text.startswith("LongBench-EN(14)"):
        lb14 = frozenset(LB16) - {"passage_count", "passage_retrieval_en"}
        return [("longbench", {"datasets": lb14}, ""), ("leval", {}, "")]
    if match := re.match(r"LongBench\[\d+\]: ([\w,-]+)", text):
        task = "longbench_e" if ctx == ">8k subset" else "longbench"
        return [(task, {"datasets": frozenset(match[1].split(","))}, "")]
    if text == "needle_in_a_haystack":  # D2O Table 3, the only needle table: the Retrieval-Head protocol
        return [("needle_retrieval_head", {"context_lengths": frozenset(int(x[:-1]) * 1000 for x in ctx.split())}, "")]
    if text == "RULER:ruler":
        return [("ruler", {"context_lengths": frozenset(_lengths(ctx))}, "")]
    parts = [p.strip() for p in text.split(";") if p.strip() and not p.strip().startswith("avg(")]
    if parts[0].startswith("InfiniteBench:"):
        datasets = frozenset(p.split(":")[1] for p in parts if "latency" not in p)  # latency: the job's timings
        if "32K" in ctx:  # POD Table 3: one job per truncation length
            return [("infinitebench", {"datasets": datasets, "truncate_to": n}, "") for n in _lengths(ctx)]
        return [("infinitebench", {"datasets": datasets}, "")]
    if parts[0].startswith("ZeroScrolls:"):
        return [("zeroscrolls", {"datasets": frozenset(ZEROSCROLLS[p.split("_", 1)[1]] for p in parts)}, "")]
    jobs = []
    for part in parts:
        kind, _, name = part.rpartition(":")
        if kind == "LM-Eval":
            jobs.append((name, {}, ""))
        elif kind == "LongBench Few-shot":
            jobs.append(("longbench", {"datasets": frozenset([name])}, ""))
        elif kind.startswith("multi-step reasoning"):
            if name == "2stageretr":
                cots = (False, True) if row["method"] == "FullKV" else (True,)  # Full: without and with CoT
                jobs += [("2stageretr", {"cot": cot}, "") for cot in cots]
            else:
                jobs.append(("longbench", {"datasets": frozenset([name])}, f"cot:{name}"))
        else:
            raise KeyError(part)
    return jobs


def _excluded(row, cell: str) -> bool:
    for paper, table, what in EXCLUDED:
        if paper == row["paper"] and table in ("*", row["table"]) and what in (row["variant"], row["method"], cell):
            return True
    return False


def expected_jobs(rows) -> Counter:
    models = _model_names()
    cells = []
    for row in rows:
        if _excluded(row, ""):
            continue
        hf = row["model_hf"].split(" (")[0].split()[0]
        model = SUBSTITUTE_MODEL if row["model_hf"].startswith("(not released)") else models[hf]
        method, fields = _method(row)
        for task, task_fields, cell in _tasks(row):
            if not _excluded(row, cell):
                cells.append((model, method, fields, _budget(row, method), task, task_fields))
    # A row without a variant (the paper's own setting) has the defaults of the fields its siblings vary.
    varied: dict[str, set] = {}
    for _, method, fields, *_ in cells:
        varied.setdefault(method, set()).update(fields)
    jobs = Counter()
    for model, method, fields, budget, task, task_fields in cells:
        defaults = {k: _method_default(method, k) for k in varied[method] - set(fields)}
        jobs[(model, method, _freeze({**defaults, **fields}), budget, task, _freeze(task_fields))] = 1
    return jobs


def _method_default(method: str, field: str):
    return yaml.safe_load((CONF_DIR / "method" / f"{method}.yaml").read_text())[field]


def _freeze(fields: dict) -> tuple:
    return tuple(sorted((k, _norm(v)) for k, v in fields.items()))


def _norm(value):
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, (list, tuple)):
        return tuple(_norm(v) for v in value)
    return value


def tables():
    by_table: dict[tuple[str, str], list] = {}
    for row in _rows():
        by_table.setdefault((row["paper"], row["table"]), []).append(row)
    return by_table


def experiment_name(paper: str, table: str) -> str:
    return f"{PAPERS[paper]}_table{table.split()[1]}"


REGENERATED = sorted((k for k in tables() if k not in NOT_REGENERATED), key=lambda k: (k[0], int(k[1].split()[1])))


# ---- tests ----------------------------------------------------------------------------------------------------------
def test_every_table_has_an_experiment_or_a_reason():
    files = {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml") if p.stem.split("_")[0] in PAPERS.values()}
    wanted = {experiment_name(*k) for k in REGENERATED}
    assert files == wanted, (sorted(files - wanted), sorted(wanted - files))
    assert set(NOT_REGENERATED) <= set(tables())
    assert len(REGENERATED) == 33


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    """One Hydra context and one planner (Composer) for every experiment; the store is an empty directory."""
    import os

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kvbench.sweep.pending import register_pending_placeholders
    from kvbench.sweep.plan import Composer

    register_resolvers()
    register_pending_placeholders()
    old = os.environ.get("KVBENCH_RESULTS_DIR")
    os.environ["KVBENCH_RESULTS_DIR"] = str(tmp_path_factory.mktemp("store"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield Composer(GlobalHydra.instance().config_loader(), "config")
    if old is None:
        os.environ.pop("KVBENCH_RESULTS_DIR")
    else:
        os.environ["KVBENCH_RESULTS_DIR"] = old


_PLANS: dict[str, list] = {}


def plan_experiment(composer, name: str):
    if name not in _PLANS:
        _PLANS[name] = _plan_experiment(composer, name)
    return _PLANS[name]


def _plan_experiment(composer, name: str):
    from kvbench.sweep.plan import expand, plan_sweep

    frame = [f"+experiment={name}"]
    sweeper = composer.full_config(frame).hydra.sweeper
    return plan_sweep(composer, expand(sweeper.params, sweeper.blocks, frame, composer.parser), name)


def planned_identities(jobs, expected: Counter) -> Counter:
    """The planned jobs in the expected identities' terms: the method and task fields the CSV names."""
    method_fields: dict[str, set] = {}
    task_fields: dict[str, set] = {}
    for _, method, mf, _, task, tf in expected:
        method_fields.setdefault(method, set()).update(k for k, _ in mf)
        task_fields.setdefault(task, set()).update(k for k, _ in tf)
    out = Counter()
    for job in jobs:
        method_cfg = OmegaConf.to_container(job.cfg.method, resolve=True)
        task_cfg = OmegaConf.to_container(job.cfg.task, resolve=True)
        method = {k: method_cfg.get(k) for k in method_fields.get(job.method, ())}
        task = {k: task_cfg.get(k) for k in task_fields.get(job.task, ())}
        for key in ("datasets", "context_lengths"):
            if task.get(key) is not None:
                task[key] = frozenset(task[key])
        out[(job.model, job.method, _freeze(method), job.budget, job.task, _freeze(task))] += 1
    return out


@pytest.mark.parametrize("table", REGENERATED, ids=[experiment_name(*k) for k in REGENERATED])
def test_experiment_plans_exactly_the_tables_cells(planner, table):
    name = experiment_name(*table)
    jobs = plan_experiment(planner, name)
    invalid = [f"{j.label}: {j.detail}" for j in jobs if j.status == "invalid"]
    assert not invalid, invalid
    assert {j.status for j in jobs} <= {"missing", "unavailable"}  # an empty store
    expected = expected_jobs(tables()[table])
    planned = planned_identities(jobs, expected)
    assert len(jobs) == sum(expected.values()), (name, len(jobs), sum(expected.values()))
    assert planned == expected, {"not planned": sorted(expected - planned),
                                 "not in the table": sorted(planned - expected)}
    unavailable = {j.method if j.method in _refusing() else j.task for j in jobs if j.status == "unavailable"}
    assert unavailable <= _refusing() | _pending("task"), unavailable


def _refusing() -> set[str]:
    """Methods that plan as "not available": pending ones and those that need training (CLA, LoCoCo) or CUDA."""
    from kvbench.methods import METHODS

    flagged = {n for n in METHODS.names()
               if getattr(METHODS.get_class(n), "requires_training", False)
               or getattr(METHODS.get_class(n), "requires_cuda", False)}
    return _pending("method") | flagged


def _pending(kind: str) -> set[str]:
    from kvbench.methods import METHODS
    from kvbench.tasks import TASKS

    return set((METHODS if kind == "method" else TASKS).pending)


def test_paper_settings_that_the_csv_does_not_name(planner):
    """Settings a table depends on beyond its cells: KVCache-Factory's baseline variants and DynamicKV's pooling
    per model (DynamicKV Table 1), OmniKV's filter layers per model and raw prompts (OmniKV Table 1)."""
    by_key = {(j.model, j.method, j.budget): j.cfg for j in plan_experiment(planner, "dynamickv_table1")}
    assert by_key[("llama3-8b-instruct", "streamingllm", "128")].method.variant == "kvfactory"
    assert by_key[("llama3-8b-instruct", "streamingllm", "128")].method.window == 32
    assert by_key[("qwen2-7b-instruct", "h2o", "512")].method.variant == "kvfactory_2406"
    assert by_key[("mistral-7b-instruct-v0.2", "snapkv", "128")].method.kernel == 7
    assert by_key[("mistral-7b-instruct-v0.2", "snapkv", "128")].method.window == 32
    assert by_key[("internlm2.5-7b-chat-1m", "pyramidkv", "512")].method.schedule == "kvfactory_2406"
    assert {by_key[(m, b, "128")].method.granularity for m in ("llama3-8b-instruct", "qwen2-7b-instruct")
            for b in ("streamingllm", "h2o", "snapkv", "pyramidkv")} == {"query_head"}
    t21 = {(j.model, j.method, j.budget): j.cfg for j in plan_experiment(planner, "d2o_table21")}
    assert t21[("llama3-8b-instruct", "streamingllm", "64")].method.window is None  # 4 sinks + C - 4 recent
    assert t21[("llama3-8b-instruct", "snapkv", "64")].method.window == 8
    assert t21[("mistral-7b-instruct-v0.2", "pyramidkv", "2048")].method.schedule == "kvfactory_2406"
    t18 = {j.method: j.cfg for j in plan_experiment(planner, "d2o_table18")}
    assert t18["pyramidkv"].method.schedule == "kvfactory_2409" and t18["snapkv"].method.window == 8
    pooling = {m: by_key[(m, "dynamickv", "128")].method.pooling for m in
               ("llama3-8b-instruct", "internlm2.5-7b-chat-1m", "mistral-7b-instruct-v0.2", "qwen2-7b-instruct")}
    assert pooling == {"llama3-8b-instruct": "avg", "internlm2.5-7b-chat-1m": "avg",
                       "mistral-7b-instruct-v0.2": "max", "qwen2-7b-instruct": "max"}
    omni = {(j.model, j.method, j.cfg.method.get("selector")): j.cfg for j in plan_experiment(planner, "omnikv_table1")}
    assert list(omni[("yi-9b-200k", "omnikv", "last")].method.filter_layers) == [6, 11, 30]
    assert list(omni[("llama3.1-70b-instruct", "omnikv", "exp")].method.filter_layers) == [4, 19, 41]
    assert omni[("yi-9b-200k", "h2o", None)].method.group_agg == "max"
    assert omni[("yi-9b-200k", "fullkv", None)].task.chat_template is False


def test_the_csv_mapping_can_fail():
    """The expected jobs really depend on the CSV: dropping one row changes them."""
    rows = tables()[("DynamicKV", "Table 1")]
    assert sum(expected_jobs(rows).values()) == 44
    assert sum(expected_jobs(rows[1:]).values()) == 43
    assert sum(expected_jobs(tables()[("D2O", "Table 3")]).values()) == 11


#: NVIDIA/kvpress@8bb29b9 evaluation/leaderboard.sh: compression_ratio = fraction of the KV cache REMOVED
KVPRESS_LEADERBOARD_RATIOS = {0.25, 0.5, 0.75, 0.875}


#: the presses of the preset (kvbench names) and the kvpress reading each must run with
KVPRESS_LEADERBOARD_METHODS = {"snapkv", "streamingllm", "h2o", "knorm", "keydiff", "tova", "expected_attention",
                               "adakv", "chunkkv", "kvzip", "think"}


def test_kvpress_leaderboard_preset_is_ruler_4k_at_the_leaderboards_ratios(planner):
    """conf/experiment/kvpress_leaderboard.yaml composes, and its budgets are the leaderboard's ratios as kept
    fractions (kvbench's ratio budget keeps, kvpress's compression_ratio removes): budget = 1 - r; every press runs
    with the question compressed (the query-aware rows) and after compression (the leaderboard's main rows)."""
    jobs = plan_experiment(planner, "kvpress_leaderboard")
    invalid = [f"{j.label}: {j.detail}" for j in jobs if j.status == "invalid"]
    assert not invalid, invalid
    assert {j.model for j in jobs} == {"llama3.1-8b-instruct"} and {j.task for j in jobs} == {"ruler"}
    assert all(list(j.cfg.task.context_lengths) == [4096] for j in jobs)
    assert sorted((j.method, j.cfg.question) for j in jobs if j.budget == "full") == [
        ("fullkv", "after_compression"), ("fullkv", "with_context")]
    compressed = [j for j in jobs if j.method != "fullkv"]
    names = {j.cfg.method.name for j in compressed}
    assert names == KVPRESS_LEADERBOARD_METHODS and len(compressed) == 2 * 4 * len(KVPRESS_LEADERBOARD_METHODS)
    for method in KVPRESS_LEADERBOARD_METHODS:
        for question in ("with_context", "after_compression"):
            kept = {float(j.budget) for j in compressed if j.cfg.method.name == method and j.cfg.question == question}
            assert {round(1 - b, 6) for b in kept} == KVPRESS_LEADERBOARD_RATIOS, (method, question, kept)
    by_method = {j.cfg.method.name: j.cfg.method for j in compressed}
    assert by_method["snapkv"].window == 64 and by_method["snapkv"].kernel == 5
    assert by_method["streamingllm"].variant == "kvfactory" and by_method["streamingllm"].window is None
    assert by_method["h2o"].variant == "prefill_only"
    assert by_method["keydiff"].mode == "whole_prompt" and by_method["tova"].variant == "kvpress_prefill"
    for wrapper in ("adakv", "chunkkv"):  # AdaKVPress(SnapKVPress()), ChunkKVPress(SnapKVPress(), 20)
        cfg = by_method[wrapper]
        assert cfg.scorer == "snapkv" and dict(cfg.scorer_fields) == {"window": 64, "kernel": 5}, wrapper
    assert by_method["adakv"].layout == "kvpress_mask"
    assert by_method["chunkkv"].variant == "kvpress" and by_method["chunkkv"].chunk_length == 20
    think = by_method["think"]  # kvpress snap_think: ComposedPress([SnapKVPress(), ThinKPress()])
    assert think.storage == "kvpress_zero" and think.inner.name == "snapkv" and think.inner.window == 64
    assert think.inner.kernel == 5


def test_cpu_query_agnostic_presets_plan_after_compression(planner):
    """The miniature's query-agnostic column plans the miniature's budget-128 needle_chat / passkey jobs with the
    question after compression (OmniKV and POD, which refuse it, are left out), on the miniature's task protocol (its
    with_context runs pair with these); the new-methods group plans every
    method in both placements at both ratios, FullKV once per task and placement."""
    qa = plan_experiment(planner, "cpu_miniature_query_agnostic")
    assert not [j.label for j in qa if j.status == "invalid"]
    after = [j for j in qa if j.cfg.question == "after_compression"]
    assert len(after) == 14 == len(qa)
    mini = {j.task: OmegaConf.to_container(j.cfg.task, resolve=True)
            for j in plan_experiment(planner, "cpu_miniature") if j.task in ("needle", "passkey")}
    assert all(OmegaConf.to_container(j.cfg.task, resolve=True) == mini[j.task] for j in qa)
    assert {j.method for j in after} == {"fullkv", "snapkv", "h2o", "streamingllm", "d2o", "dynamickv", "kvmerger"}
    assert {j.budget for j in qa} == {"128", "full"} and {j.task for j in qa} == {"needle", "passkey"}
    new = plan_experiment(planner, "cpu_new_methods")
    assert not [f"{j.label}: {j.detail}" for j in new if j.status == "invalid"]
    assert len(new) == 3 * 2 * (1 + 9 * 2)
    assert {j.cfg.method.name for j in new} == {"fullkv", "snapkv", "knorm", "keydiff", "tova", "expected_attention",
                                                "adakv", "chunkkv", "kvzip", "think"}
    for question in ("with_context", "after_compression"):
        mine = [j for j in new if j.cfg.question == question]
        assert {j.budget for j in mine} == {"0.25", "0.5", "full"} and len(mine) == 57, question


# ---- the CPU miniature (issue #20): enough samples for every claim, each paper in its own regime ------------------
MINIATURE_CLAIMS = CONF_DIR.parent / "results" / "cpu_miniature" / "claims.yaml"
#: samples per job the claims engine needs to decide; PG-19's documents are the exception (a 1024-token essay costs
#: about 40 s of streaming; 8 documents let the exact sign-flip test reach p = 2 / 2**8)
MINIATURE_MIN_SAMPLES = 40
MINIATURE_MIN_DOCUMENTS = 8


def miniature_samples(task: dict) -> int:
    """Samples of one job of the miniature's tasks, from the task fields alone (nothing generated)."""
    name = task["name"]
    if name in ("needle", "passkey"):
        depths = len(task["depths"]) if task.get("depths") is not None else task["n_depths"]
        return len(task["context_lengths"]) * depths * int(task.get("repeats") or 1)
    if name == "ruler":
        return len(task["tasks"]) * len(task["context_lengths"]) * task["num_samples"]
    if name == "2stageretr":
        return task["num_samples"]
    if name == "pg19":
        return task["n_books"]
    raise AssertionError(f"the miniature has no sample count for task {name!r}")


def miniature_cells(jobs) -> dict[tuple[str, str, str], object]:
    """(task, method as claims.yaml names it, budget label) -> planned job: ``d2o`` for the default configuration,
    ``d2o[allocation=paper_literal]`` for another (kvbench.report.claims.configured_name)."""
    from kvbench.jobs.plan import plan_job
    from kvbench.report.claims import configured_name
    from kvbench.report.store import method_label

    cells = {}
    for job in jobs:
        name = configured_name(job.method, method_label(plan_job(job.cfg).key["method"]))
        assert (job.task, name, job.budget) not in cells, f"two jobs of one cell: {job.label}"
        cells[(job.task, name, job.budget)] = job
        if job.method == "pod":  # POD's configuration (block map, window) is in its budget label already
            cells[(job.task, "pod", job.budget)] = job
    return cells


def test_cpu_miniature_plans_enough_samples_for_every_claim(planner):
    """conf/experiment/cpu_miniature.yaml plans every cell results/cpu_miniature/claims.yaml compares, each with at
    least 40 samples (PG-19: at least 8 essays), one task protocol per task (the claims pair runs on sample ids),
    KVMerger and D2O at their papers' ratio budgets 0.5 and 0.35 as well as the token budgets, D2O under both
    allocations, and StreamingLLM at POD's resident bytes (the arithmetic of the experiment file's header)."""
    from kvbench.report.claims import _ref, claim_methods

    jobs = plan_experiment(planner, "cpu_miniature")
    assert not [f"{j.label}: {j.detail}" for j in jobs if j.status in ("invalid", "unavailable")]
    protocols: dict[str, set[str]] = {}
    for job in jobs:
        task = OmegaConf.to_container(job.cfg.task, resolve=True)
        protocols.setdefault(job.task, set()).add(repr(sorted(task.items())))
        floor = MINIATURE_MIN_DOCUMENTS if job.task == "pg19" else MINIATURE_MIN_SAMPLES
        assert miniature_samples(task) >= floor, (job.label, miniature_samples(task))
    assert {t: len(p) for t, p in protocols.items()} == {t: 1 for t in protocols}, "one task protocol per task"
    cells = miniature_cells(jobs)
    spec = yaml.safe_load(MINIATURE_CLAIMS.read_text())
    missing = []
    for claim in spec["claims"]:
        tasks = claim.get("tasks") or spec["tasks"]
        if claim["kind"] == "fullkv_solves":
            missing += [(t, "fullkv") for t in tasks if (t, "fullkv", "full") not in cells]
            continue
        for name in claim_methods(claim):
            for budget in claim["budgets"]:
                ref = _ref(name, budget)
                missing += [(t, *ref) for t in tasks if (t, *ref) not in cells or (t, "fullkv", "full") not in cells]
    assert not missing, f"claims.yaml compares cells the experiment does not run: {missing}"
    # each paper in its own regime, and what is compared where
    for name in ("kvmerger", "d2o", "d2o[allocation=paper_literal]", "h2o", "cam", "streamingllm"):
        for budget in ("0.5", "0.35", "64", "128", "512"):
            assert all((t, name, budget) in cells for t in ("needle", "passkey", "ruler")), (name, budget)
    assert cells[("needle", "d2o", "128")].cfg.method.allocation == "official_code"
    assert cells[("needle", "d2o[allocation=paper_literal]", "128")].cfg.method.allocation == "paper_literal"
    assert ("pg19", "d2o[allocation=paper_literal]", "128") in cells
    # POD never evicts a value: with SmolLM2's block map (L layers, one lowest layer per block) a prompt of T tokens
    # leaves POD (L V + n_low K) T + (L - n_low) (w - 1) K of FullKV's 2 L T entries; StreamingLLM at ratio r keeps r
    # of them. Each equal-bytes claim's ratio is POD's share at its window within 0.03 over T = 1000 ... 2000.
    block_map = json.loads((CONF_DIR.parent / "results" / "pod" / "smollm2-135m-layer.json").read_text())
    layers, lowest = block_map["num_layers"], len(block_map["blocks"])
    equal_bytes = [c for c in spec["claims"] if c.get("better", "").startswith("pod@")
                   and any("@" in t for t in c["than"])]
    assert sorted(b for c in equal_bytes for b in c["budgets"]) == [64, 128, 512]
    for claim in equal_bytes:
        (rival,) = claim["than"]
        ratio = float(rival.split("@")[1])
        for budget in claim["budgets"]:
            job = cells[("needle", *_ref(claim["better"], budget))]
            window = job.cfg.method.n_s + job.cfg.method.n_r
            assert window == budget
            share = [(layers + lowest) / (2 * layers) + (layers - lowest) * (window - 1) / (2 * layers * t)
                     for t in (1000, 2000)]
            assert abs(sum(share) / 2 - ratio) <= 0.03, (budget, share, ratio)
            assert min(share) > 512 / 1000  # above any token budget's share here: no window matches StreamingLLM's


def test_reasoning_math_plans_both_models_tasks_and_decode_compressing_methods(planner):
    """conf/experiment/reasoning_math.yaml (issue #40): MATH-500 and AIME25 on DeepSeek-R1-Distill-Qwen-7B and
    Qwen3-8B, sampled as TriAttention samples (temperature 0.6, top-p 0.95, each model's top-k, n = 8 for AIME and 1
    for MATH-500); every compressing job compresses during decode every 128 tokens at budgets 1024-4096 (and two
    ratios for SnapKV and K-norm); FullKV once per model and task."""
    jobs = plan_experiment(planner, "reasoning_math")
    invalid = [f"{j.label}: {j.detail}" for j in jobs if j.status == "invalid"]
    assert not invalid, invalid
    assert len(jobs) == 116
    assert {j.model for j in jobs} == {"deepseek-r1-distill-qwen-7b", "qwen3-8b"}
    assert {j.task for j in jobs} == {"math500", "aime25"}
    for job in jobs:
        top_k = {"deepseek-r1-distill-qwen-7b": 50, "qwen3-8b": 20}[job.model]
        assert job.cfg.sampling.top_k == top_k
        task = job.cfg.task
        assert (task.sampling.temperature, task.sampling.top_p, task.sampling.n) == (
            0.6, 0.95, 8 if job.task == "aime25" else 1)
        if job.method == "fullkv":
            assert job.budget == "full"
            continue
        if job.method == "triattention":  # its own schedule; one kept set per sequence; the authors' file
            model = {"deepseek-r1-distill-qwen-7b": "ds_qwen7b", "qwen3-8b": "qwen3_8b"}[job.model]
            assert job.cfg.method.stats_path == f"authors:for_aime25_experiment/{model}", job.label
            assert job.cfg.batch_size == 1 and job.budget in {"1024", "2048", "4096"}, job.label
            assert job.cfg.method.divide_length == 128 and job.cfg.method.use_slack_trigger, job.label
            continue
        assert job.cfg.method.decode_compression.interval == 128, job.label
        assert job.budget in ({"1024", "2048", "4096", "0.25", "0.5"} if job.cfg.method.name in ("snapkv", "knorm")
                              else {"1024", "2048", "4096"}), job.label
    assert sum(j.method == "fullkv" for j in jobs) == 4
    assert {j.cfg.method.decode_compression.query_buffer for j in jobs if j.method == "rkv"} == {8}
    assert sum(j.method == "triattention" for j in jobs) == 12
    assert sum(j.method == "expected_attention" for j in jobs) == 12
