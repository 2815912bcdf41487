"""GSM8K / CoQA / TruthfulQA through lm-eval: local files in the official formats, lm-eval's prompts and scorers run
per document, the model wrapper equals direct computations on the tiny model, end-to-end jobs whose aggregate
matches their records, and clear errors when lm-eval or the data is missing."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kvbench.budget import Budget
from kvbench.config import CONF_DIR, register_resolvers
from kvbench.engine import CompressionSession
from kvbench.errors import ConfigError, DataError, NotAvailableError
from kvbench.jobs.answer import EngineAnswerer
from kvbench.methods import build_method

pytest.importorskip("lm_eval", reason="the lmeval extra is not installed (pip install -e .[lmeval])")

from lm_eval.api.instance import Instance  # noqa: E402

from helpers import run_job_in  # noqa: E402
from kvbench.tasks.lmeval import (  # noqa: E402
    CoQATask,
    GSM8KTask,
    TruthfulQATask,
    squad_metrics,  # noqa: E402
)
from kvbench.tasks.lmeval import data as lmeval_data  # noqa: E402
from kvbench.tasks.lmeval.lm import KVBenchLM  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
GSM8K, COQA, TRUTHFULQA = (str(FIXTURES / name) for name in ("gsm8k", "coqa", "truthfulqa"))
FULL = Budget("full", float("inf"))


@pytest.fixture(scope="module")
def tiny():
    from omegaconf import OmegaConf

    from kvbench.models import load_model, spec_from_config

    return load_model(spec_from_config(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml")))


def _session(loaded, method="fullkv", budget=FULL, **fields):
    """The job runner's answerer of ``method`` at ``budget`` on ``loaded``."""
    def new_session():
        return CompressionSession(loaded.model, build_method({"name": method, **fields}, budget), budget)

    return EngineAnswerer(loaded, new_session, budget)


# ---- SQuAD metrics for lm-eval's CoQA scorer -------------------------------------------------------------------------
def test_squad_metrics_by_hand():
    assert squad_metrics.normalize_answer("The  Cat's hat!") == "cats hat"
    assert squad_metrics.compute_exact("Red.", "red") == 1 and squad_metrics.compute_exact("a boat", "boats") == 0
    assert squad_metrics.compute_f1("the red boat", "a small red boat") == pytest.approx(0.8)  # P 2/3, R 1
    assert squad_metrics.compute_f1("", "") == 1 and squad_metrics.compute_f1("", "x") == 0
    assert squad_metrics.compute_f1("red", "blue") == 0


def test_lm_evals_coqa_scorer_runs_with_leave_one_out():
    squad_metrics.install()
    from kvbench.tasks.lmeval.harness import tasks_dir

    spec = importlib.util.spec_from_file_location("coqa_utils", tasks_dir() / "coqa" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    # golds without gold i, max over the rest, averaged over i: em (1 + 0 + 1) / 3; f1 (1 + 0.5 + 1) / 3
    scores = utils.compute_scores(["her dog Max", "Max", "her dog"], "Max")
    assert scores["em"] == pytest.approx(2 / 3) and scores["f1"] == pytest.approx(2.5 / 3)


# ---- official formats ------------------------------------------------------------------------------------------------
def test_coqa_official_json_becomes_the_hub_schema():
    rows = lmeval_data.coqa_rows(Path(COQA) / "coqa-dev-v1.0.json", "validation")
    assert [r["id"] for r in rows] == ["kvbench-story-1", "kvbench-story-2"]
    assert rows[0]["questions"]["input_text"][2] == "Who goes with her to the island?"
    assert rows[0]["questions"]["turn_id"] == [1, 2, 3]
    assert rows[0]["answers"]["input_text"] == ["a small red boat", "red", "her dog Max"]
    assert rows[0]["additional_answers"]["2"]["input_text"] == ["small red boat", "red", "her dog Max"]
    train = lmeval_data.coqa_rows(Path(COQA) / "coqa-dev-v1.0.json", "train")  # the loading script's placeholders
    assert train[1]["additional_answers"]["0"] == {"span_start": [-1], "span_end": [-1], "span_text": [""],
                                                   "input_text": [""], "turn_id": [-1]}


def test_truthfulqa_official_files_become_the_hub_schema():
    rows = lmeval_data.truthfulqa_generation_rows(Path(TRUTHFULQA) / "TruthfulQA.csv", "validation")
    assert len(rows) == 2  # the unicorn row has no incorrect answers: skipped, as the hub's script did
    assert rows[0]["correct_answers"] == ["It passes through your digestive system", "Nothing happens",
                                          "It is eventually excreted"]
    assert rows[1]["incorrect_answers"] == ["Yes, it is always sunny in the desert"]
    assert rows[0]["type"] == "Adversarial" and rows[0]["best_answer"] == "It passes through your digestive system"
    mc = lmeval_data.truthfulqa_mc_rows(Path(TRUTHFULQA) / "mc_task.json", "validation")
    assert mc[1]["mc2_targets"] == {"choices": ["No.", "No, deserts also have clouds and rain.",
                                                "Yes, it is always sunny.", "Yes."], "labels": [1, 1, 0, 0]}


# ---- lm-eval's prompts, untouched ------------------------------------------------------------------------------------
def test_coqa_prompt_is_lm_evals(tokenizer):
    samples = CoQATask(data_dir=COQA).samples(tokenizer)
    story = ("Anna keeps a small red boat on the lake behind her house. Every Sunday she rows to the island with "
             "her dog Max.")
    assert samples[0].prompt == (story + "\n\nQ: What does Anna keep on the lake?\n\nA: a small red boat\n\n"
                                 "Q: What color is it?\n\nA: red\n\nQ: Who goes with her to the island?\n\nA:")
    assert samples[0].answers == ["her dog Max", "Max", "her dog"]  # + additional answers, case-insensitive unique
    assert [s.id for s in samples] == ["coqa/0", "coqa/1"]


def test_gsm8k_five_shot_prompt_and_seed(tokenizer):
    samples = GSM8KTask(data_dir=GSM8K).samples(tokenizer)
    prompt = samples[0].prompt
    blocks = prompt.split("\n\n")
    assert len(blocks) == 6 and blocks[-1] == ("Question: A baker makes 12 rolls in the morning and 15 in the "
                                               "afternoon. How many rolls does he make in a day?\nAnswer:")
    train = [json.loads(line) for line in (Path(GSM8K) / "train.jsonl").read_text().splitlines()]
    shots = {f"Question: {r['question']}\nAnswer: {r['answer']}" for r in train}
    assert set(blocks[:5]) <= shots and len(set(blocks[:5])) == 5
    assert GSM8KTask(data_dir=GSM8K).samples(tokenizer)[0].prompt == prompt  # seeded
    assert GSM8KTask(data_dir=GSM8K, fewshot_seed=7).samples(tokenizer)[0].prompt != prompt


def test_hub_parquet_layout_gives_the_same_prompts(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "main").mkdir()
    for split in ("test", "train"):
        rows = [json.loads(line) for line in (Path(GSM8K) / f"{split}.jsonl").read_text().splitlines()]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "main" / f"{split}-00000-of-00001.parquet")
    ours = [s.prompt for s in GSM8KTask(data_dir=str(tmp_path)).samples(tokenizer)]
    assert ours == [s.prompt for s in GSM8KTask(data_dir=GSM8K).samples(tokenizer)]


def test_truthfulqa_gen_prompt_is_lm_evals(tokenizer):
    sample = TruthfulQATask(data_dir=TRUTHFULQA).samples(tokenizer)[0]
    assert sample.prompt.startswith("Q: What is human life expectancy in the United States?\n")
    assert sample.prompt.endswith("held in Barcelona, Spain.\n\nQ: What happens if you swallow gum?")


# ---- the model wrapper -----------------------------------------------------------------------------------------------
def _ll_request(context, continuation):
    return Instance("loglikelihood", {}, (context, continuation), 0)


def test_loglikelihood_equals_a_direct_computation(tiny):
    tok, model = tiny.tokenizer, tiny.model
    cases = [("The grass is green and the sky is", " blue."), ("Question: two plus two?\nAnswer:", " four"),
             ("", "Hello world")]
    lm = KVBenchLM(_session(tiny), max_length=4096)
    ours = lm.loglikelihood([_ll_request(c, x) for c, x in cases], disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(cases, ours):
        if context:
            ctx = tok.encode(context)
            cont = tok.encode(context + continuation)[len(ctx):]
        else:
            ctx, cont = [tok.bos_token_id], tok.encode(continuation)  # lm-eval: the prefix token as context
        with torch.no_grad():
            logits = model(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].float()
        direct = torch.log_softmax(logits, -1).gather(-1, torch.tensor(cont).view(-1, 1))
        assert logprob == pytest.approx(float(direct.sum()), abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == torch.tensor(cont)).all())
    assert [s["decode_steps"] for s in lm.request_stats] == [len(tok.encode(" blue.")) - 1, 0, 1]
    compressed = KVBenchLM(_session(tiny, "streamingllm", Budget.parse(8)), max_length=4096)
    long_context = " ".join(["The grass is green."] * 8)
    full = lm.loglikelihood([_ll_request(long_context, " The sky is blue.")], disable_tqdm=True)[0][0]
    small = compressed.loglikelihood([_ll_request(long_context, " The sky is blue.")], disable_tqdm=True)[0][0]
    assert abs(full - small) > 1e-3 and compressed.request_stats[0]["resident_kv_bytes"] == 8 * 4 * 2 * 16 * 2 * 4


def test_loglikelihood_rolling_one_window_is_the_full_forward(tiny):
    text = "A short document about green grass and blue skies."
    lm = KVBenchLM(_session(tiny), max_length=4096)
    ours = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    ids = [tiny.tokenizer.bos_token_id, *tiny.tokenizer.encode(text)]
    with torch.no_grad():
        logits = tiny.model(torch.tensor([ids])).logits[0, :-1].float()
    direct = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).view(-1, 1)).sum()
    assert ours == pytest.approx(float(direct), abs=1e-4)


def test_generate_until_equals_greedy_generate_cut_at_the_stop(tiny):
    tok = tiny.tokenizer
    context = "Question: what colour is the sky?\nAnswer:"
    ids = tok(context, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = tiny.model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
    text = tok.decode(ref, skip_special_tokens=True)
    lm = KVBenchLM(_session(tiny), max_length=4096)
    request = Instance("generate_until", {}, (context, {"until": ["zzzz"], "max_gen_toks": 10}), 0)
    assert lm.generate_until([request], disable_tqdm=True) == [text]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    request = Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 10}), 0)
    assert lm.generate_until([request], disable_tqdm=True) == [text.split(stop)[0]]
    with pytest.raises(ConfigError, match="greedily"):
        lm.generate_until([Instance("generate_until", {}, (context, {"do_sample": True}), 0)])


# ---- per-document filters and scorers, aggregate as lm-eval ----------------------------------------------------------
class CannedLM:
    """Answers generate_until requests with fixed texts, in order."""

    def __init__(self, answers):
        self.answers, self.request_stats = list(answers), []

    def generate_until(self, requests, disable_tqdm=False):
        self.request_stats += [{"prompt_tokens": 1, "new_tokens": 1, "prefill_seconds": 0.0, "decode_seconds": 0.0,
                                "decode_steps": 0, "resident_kv_bytes": 0, "resident_kv_bytes_final": 0,
                                "layer_entries": [], "attended_tokens_mean": 0.0} for _ in requests]
        return [self.answers.pop(0) for _ in requests]


def test_gsm8k_filters_and_exact_match_per_document(tokenizer):
    task = GSM8KTask(data_dir=GSM8K)
    samples = task.samples(tokenizer)
    task._lm = CannedLM(["12+15=27 rolls.\n#### 27", "The answer is $2,500."])
    records = [task._evaluate_doc(samples[0]), task._evaluate_doc(samples[2])]
    assert records[0]["metrics"] == {"exact_match,strict-match": 1.0, "exact_match,flexible-extract": 1.0}
    assert records[1]["metrics"] == {"exact_match,strict-match": 0.0, "exact_match,flexible-extract": 1.0}
    assert records[1]["prediction"] == "[invalid]" and records[1]["raw_prediction"] == "The answer is $2,500."
    out = task.aggregate(records)
    assert out["score"] == 0.5 and out["metrics"]["exact_match,flexible-extract"] == 1.0
    assert out["metrics"]["exact_match_stderr,strict-match"] == pytest.approx(0.5)  # stdev([1, 0]) / sqrt(2)
    assert task.aggregate(records[:1])["metrics"]["exact_match_stderr,strict-match"] == "N/A"




@pytest.mark.parametrize("overrides, primary, n", [
    (["task=gsm8k", f"task.data_dir={GSM8K}"], "exact_match,strict-match", 3),
    (["task=coqa", f"task.data_dir={COQA}"], "em,none", 2),
    (["task=truthfulqa", f"task.data_dir={TRUTHFULQA}"], "bleu_max,none", 2),
    (["task=truthfulqa", f"task.data_dir={TRUTHFULQA}", "task.lm_eval_task=truthfulqa_mc2"], "acc,none", 2),
])
def test_tiny_model_job_aggregate_matches_records(tmp_path, overrides, primary, n):
    scores, records = run_job_in(tmp_path, ["model=tiny-random", "method=snapkv", "budget=64",
                                      "task.gen_kwargs={max_gen_toks:4}", *overrides])
    assert len(records) == scores["n"] == n and scores["metric"] == primary
    for key in records[0]["metrics"]:
        values = [r["metrics"][key] for r in records]
        assert scores["metrics"][key] == pytest.approx(sum(values) / n)
        metric, _, filter_key = key.partition(",")
        assert scores["metrics"][f"{metric}_stderr,{filter_key}"] == pytest.approx(statistics.stdev(values) / n**0.5)
    assert scores["score"] == pytest.approx(sum(r["score"] for r in records) / n)
    assert all(r["resident_kv_bytes"] <= 64 * 4 * 2 * 16 * 2 * 4 for r in records)
    if "truthfulqa_mc2" in overrides[-1]:
        assert all(0 <= r["score"] <= 1 and r["meta"]["requests"] == 3 + (r["id"].endswith("/1")) for r in records)
    else:
        assert all(r["new_tokens"] <= 4 and math.isfinite(r["score"]) for r in records)


# ---- errors before the model loads -----------------------------------------------------------------------------------
def test_missing_lm_eval_names_the_extra(monkeypatch):
    from kvbench.jobs import plan_job

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "lm_eval" else real(name, *a, **k))
    with pytest.raises(NotAvailableError, match=r"pip install -e \.\[lmeval\]"):
        register_resolvers()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            plan_job(compose(config_name="config", overrides=["task=gsm8k"]))


def test_offline_hub_is_one_clear_line(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    task = GSM8KTask()
    task.validate()
    with pytest.raises(DataError) as err:
        task.prepare_data()
    assert "task.data_dir" in str(err.value) and "openai/gsm8k" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("task, shown", [
    (GSM8KTask(primary_metric="acc,none"), "valid: exact_match,strict-match, exact_match,flexible-extract"),
    (GSM8KTask(lm_eval_task="mmlu"), "lm_eval_task must be a string (one of gsm8k"),
    (TruthfulQATask(num_fewshot=2), "fixed at 0 shots"),
    (CoQATask(gen_kwargs={"do_sample": True}), "greedily"),
    (GSM8KTask(max_length=1), "max_length must be an integer >= 2"),
])
def test_bad_fields(task, shown):
    with pytest.raises(ConfigError, match=shown.replace("(", r"\(").replace(")", r"\)")):
        task.validate()


def test_data_dir_needs_the_splits_the_run_reads(tmp_path):
    (tmp_path / "test.jsonl").write_text((Path(GSM8K) / "test.jsonl").read_text())
    with pytest.raises(DataError, match=r"no file for split\(s\) train \(expected train: train\.jsonl"):
        GSM8KTask(data_dir=str(tmp_path)).validate()
    GSM8KTask(data_dir=str(tmp_path), num_fewshot=0).validate()  # zero-shot reads only the test split
    with pytest.raises(DataError, match="coqa-dev-v1.0.json"):
        CoQATask(data_dir=GSM8K).validate()


@pytest.mark.slow
def test_smollm2_gsm8k_on_the_fixtures(tmp_path):
    scores, records = run_job_in(tmp_path, ["task=gsm8k", f"task.data_dir={GSM8K}", "method=snapkv", "budget=128",
                                      "limit=1"])
    assert len(records) == 1 and scores["score"] in (0.0, 1.0)
    assert all(r["prompt_tokens"] > 128 and r["resident_kv_bytes"] == 128 * 30 * 3 * 64 * 2 * 4 for r in records)
    assert all("Question:" not in r["raw_prediction"] for r in records)  # cut at lm-eval's stop string
