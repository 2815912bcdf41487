"""How the papers name things, and what kvbench calls them: models, methods, budgets, tasks (data, not logic).

* models: the papers' ``model_hf`` (the HF id the extraction gives, with "(inferred)" remarks) is matched to the
  ``path`` of a ``conf/model/*.yaml``; models without a config (POD's unreleased LLaMA3-8B-32K, Llama-3.1-405B,
  Llama-3-70B) have no kvbench counterpart;
* methods: the papers' canonical method ids (``results/paper``'s ``method`` column) map to a kvbench method name
  plus the fields that make it the paper's variant; a table spec may override this per method id or row label
  (KVCache-Factory's prefill-only H2O in DynamicKV Table 1, D2O's ablation rows);
* budgets: the papers' budget strings map to kvbench budget labels (``128``, ``0.2``, ``full``, POD's
  ``window16+4080``);
* tasks: a paper column id maps to the kvbench task whose ``scores.json`` holds it and where.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import yaml

from kvbench.config import CONF_DIR

#: paper method id -> kvbench method (``name`` + fields that select the paper's variant). Methods kvbench does not
#: implement yet keep their registry name, so their rows fill in once they land.
METHODS: dict[str, dict] = {
    "FullKV": {"name": "fullkv"},
    "H2O": {"name": "h2o"},
    "StreamingLLM": {"name": "streamingllm"},
    "SnapKV": {"name": "snapkv"},
    "PyramidKV": {"name": "pyramidkv"},
    "DynamicKV": {"name": "dynamickv"},
    "D2O": {"name": "d2o"},
    "D2O (assumed)": {"name": "d2o"},
    "KVMerger": {"name": "kvmerger"},
    "OmniKV": {"name": "omnikv"},
    "OmniKV-last": {"name": "omnikv", "selector": "last"},
    "OmniKV-last (assumed)": {"name": "omnikv", "selector": "last"},
    "OmniKV-last (assumed selector)": {"name": "omnikv", "selector": "last"},
    "OmniKV-uniform": {"name": "omnikv", "selector": "uniform"},
    "OmniKV-exp": {"name": "omnikv", "selector": "exp"},
    "POD": {"name": "pod"},
    "LocalWindow": {"name": "local"},
    "CaM": {"name": "cam"},
    "RoCo": {"name": "roco"},
    "Quest": {"name": "quest"},
    "InfLLM": {"name": "infllm"},
    "LM-Infinite": {"name": "lminfinite"},
    "PyramidInfer": {"name": "pyramidinfer"},
    "SirLLM": {"name": "sirllm"},
    "LoCoco": {"name": "lococo"},
    "CLA": {"name": "cla"},
}

#: paper method id -> the label kvbench's tables print for the kvbench method (POD without its post-training)
OUR_LABELS: dict[str, str] = {"pod": "POD-TF"}

#: models whose POD numbers come from POD's post-training (paper 004 Sec. 4.1): kvbench's training-free POD on
#: other weights is not the paper's PoD, and its rows say so.
POD_ADAPTED_MODELS = ("LLaMA3-8B-32K", "LLaMA3.1-8B")
POD_POST_TRAINING = "needs post-training"

#: the LongBench datasets (kvbench task ``longbench``, ``scores.json`` ``datasets.<id>``)
LONGBENCH = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique", "dureader",
    "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht", "passage_count",
    "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)
#: InfiniteBench tasks (kvbench task ``infinitebench``, ``datasets.<id>``)
INFINITEBENCH = (
    "passkey", "number_string", "kv_retrieval", "longbook_sum_eng", "longbook_choice_eng", "longbook_qa_eng",
    "longbook_qa_chn", "longdialogue_qa_eng", "math_find", "math_calc", "code_run", "code_debug",
)


def task_source(column: str) -> tuple[str, tuple[str, ...]] | None:
    """Where a paper column's number lives in kvbench's store: ``(task name, path into scores.json)``, or None."""
    if column in LONGBENCH:
        return "longbench", ("datasets", column)
    if column in INFINITEBENCH:
        return "infinitebench", ("datasets", column)
    if column == "2stageretr":
        return "2stageretr", ("score",)
    return None


def hf_id(model_hf: str | None) -> str | None:
    """``"meta-llama/Llama-3.1-8B (base vs Instruct not stated)"`` -> ``"meta-llama/Llama-3.1-8B"``."""
    if not model_hf or not isinstance(model_hf, str):
        return None
    match = re.match(r"([\w.-]+/[\w.-]+)", model_hf.strip())
    return match.group(1) if match else None


@lru_cache(maxsize=4)
def model_configs(conf_dir: str = str(CONF_DIR)) -> dict[str, str]:
    """``{hf id: conf/model name}`` from ``conf/model/*.yaml`` (``source: hf`` configs)."""
    out = {}
    for path in sorted(Path(conf_dir, "model").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text()) or {}
        if cfg.get("path"):
            out[str(cfg["path"])] = str(cfg.get("name", path.stem))
    return out


def model_name(model_hf: str | None) -> str | None:
    """kvbench's model name for a paper's model, or None when kvbench has no config for it."""
    hf = hf_id(model_hf)
    return model_configs().get(hf) if hf else None


_POD_WINDOW = re.compile(r"^(\d+)\+(\d+)\+\d+K$")


def budget_label(budget: str | None) -> str | None:
    """kvbench's budget label for a paper's budget string, or None when it has none (``not stated``).

    ``full``/``32K``/``128K`` (a dense model's window) -> ``full``; ``rho=0.2`` -> ``0.2``; ``Mem=30%`` (OmniKV) and
    ``50%`` (KVMerger) -> ``0.3``/``0.5``; ``128`` -> ``128``; ``4K`` -> ``4096``; ``16+4080`` (sink + recent) and
    ``96+4000`` (heavy + recent) -> ``4096`` (the split is a method field); ``16+4080+28K`` (PoD) ->
    ``window16+4080``; ``2048 tokens/sparse layer`` -> ``2048``.
    """
    if budget is None or not isinstance(budget, str):
        return None
    text = re.sub(r"\s*\((assumed|inferred)\)", "", budget.strip())
    if text in ("full", "32K", "128K"):
        return "full"
    pod = _POD_WINDOW.match(text)
    if pod:
        return f"window{pod.group(1)}+{pod.group(2)}"
    match = re.fullmatch(r"(?:rho=|Mem=~?)?(\d+(?:\.\d+)?)(%?)", text)
    if match:
        value = float(match.group(1))
        if match.group(2) == "%" or text.startswith("Mem"):
            return f"{value / 100:g}"
        return f"{value:g}" if "." in match.group(1) else str(int(value))
    match = re.fullmatch(r"(\d+)K", text)
    if match:
        return str(int(match.group(1)) * 1024)
    match = re.fullmatch(r"(\d+)\+(\d+)", text)
    if match:
        return str(int(match.group(1)) + int(match.group(2)))
    match = re.fullmatch(r"(\d+) tokens/sparse layer.*", text)
    if match:
        return match.group(1)
    return None


def _math(segment: str) -> str:
    text = re.sub(r"\\math(?:bf|cal|rm)\{([^}]*)\}", r"\1", segment).replace("\\kappa", "K")
    return re.sub(r"[_{}\\\s]", "", text)


def clean_label(label: str | None) -> str:
    """A paper's row label without its typesetting: ``$H_2O$``, ``H <sub>2</sub> O`` -> ``H2O``."""
    if not isinstance(label, str):
        return ""
    text = re.sub(r"\$([^$]*)\$", lambda m: _math(m.group(1)), label)
    text = re.sub(r"\s*<sub>\s*(\w+)\s*</sub>\s*", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"\s+", " ", text).strip().lstrip("- ").strip()
