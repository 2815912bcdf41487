"""ZeroSCROLLS: the section 3.3 metrics pinned by hand-computed values (quirks included), the chat and completion
prompts and the head-cut truncation of tau-nlp/zero_scrolls, loading the validation split (fixtures in
tests/fixtures/zeroscrolls, official row format) and one SmolLM2 run."""

from __future__ import annotations

import dataclasses
import json
import sys
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from scipy.stats import kendalltau

from kvbench.errors import ConfigError, DataError, NotAvailableError
from kvbench.metrics import zeroscrolls as m
from kvbench.tasks.text import middle_truncate
from kvbench.tasks.zeroscrolls import ZeroScrollsTask
from kvbench.tasks.zeroscrolls.scoring import DATASETS, score_records

FIXTURES = Path(__file__).parent / "fixtures" / "zeroscrolls"
CONF_TASK = Path(__file__).resolve().parents[1] / "conf" / "task"
FIXTURE_DATASETS = ["gov_report", "qmsum", "qasper", "quality", "space_digest", "book_sum_sort"]
REQUEST = "Do not provide any explanation."


class WordTokenizer:
    """One id per whitespace word (no special tokens)."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text, add_special_tokens=True):
        return [self.ids.setdefault(w, len(self.ids) + 1) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        words = {i: w for w, i in self.ids.items()}
        return " ".join(words[i] for i in ids)


def _task(**fields):
    task = ZeroScrollsTask(**{"data_dir": str(FIXTURES), "datasets": FIXTURE_DATASETS, **fields})
    task.validate()
    return task


def _rows(dataset):
    return [json.loads(line) for line in (FIXTURES / dataset / "validation.jsonl").read_text().splitlines()]


def _rec(dataset, prediction, *answers):
    return {"dataset": dataset, "prediction": prediction, "answers": list(answers)}


# ---- metrics --------------------------------------------------------------------------------------------------------
class TestMetrics:
    def test_f1_normalisation_transliterates_last(self):
        assert m.normalize_answer("Café — The Naïve!") == "cafe -- naive"  # "—" is not ASCII punctuation: "--"
        assert m.f1_score("Café", "cafe") == 1.0
        # the curly apostrophe survives punctuation removal and becomes "'": "don't" vs "dont"
        assert m.normalize_answer("don’t") == "don't" and m.f1_score("don’t", "don't") == 0.0
        # [penn, treebank, dataset] vs [penn, treebank]: P = 2/3, R = 1, F = 0.8
        assert m.f1_score("The Penn Treebank dataset", "Penn Treebank") == pytest.approx(0.8)

    def test_accuracy_first_standalone_letter(self):
        assert m.accuracy_score("The answer is B.", "(B) Ships") == 1.0
        assert m.accuracy_score("A: B", "(B) Ships") == 0.0  # the first letter is the A of "A:"
        assert m.accuracy_score("ABC", "(A) x") == 0.0  # no standalone letter
        with pytest.raises(DataError, match="no option letter"):
            m.accuracy_score("A", "none of them")

    def test_exp_similarity(self):
        assert m.exp_similarity_score("40%", "60%") == 0.25  # 20 points off: halved twice
        text = "Out of 50 reviews, 20 are positive, so 40% of them are positive and 60% negative."
        assert m.exp_similarity_score(text, "40%") == 1.0  # the first percentage counts
        assert m.exp_similarity_score("45.5%", "40%") == pytest.approx(0.5 ** 0.55)
        assert m.exp_similarity_score("forty percent", "40%") == 0.0
        assert m.exp_similarity_score("10%", "40") == 0.5  # a reference without "%" counts as 0 %

    @pytest.mark.parametrize(("prediction", "expected"), [
        ("3, 1, 2", 1.0), ("Order: 2, 1, 3.", 0.0), ("1, 3, 2", 2 / 3), ("1, 2", 0.0), ("3, 1, 2, 2", 0.0),
        ("Summary 3, Summary 1, Summary 2", 1.0),
    ])
    def test_concordance_index(self, prediction, expected):
        assert m.concordance_index_score(prediction, "3, 1, 2") == pytest.approx(expected)

    def test_concordance_index_is_kendall_rescaled(self):
        gold, pred = [5, 2, 7, 1, 3, 6, 4], [2, 5, 1, 7, 3, 4, 6]
        tau = kendalltau([gold.index(i) for i in range(1, 8)], [pred.index(i) for i in range(1, 8)]).statistic
        score = m.concordance_index_score(", ".join(map(str, pred)), ", ".join(map(str, gold)))
        assert score == pytest.approx((tau + 1) / 2)
        with pytest.raises(DataError, match="permutation"):
            m.concordance_index_score("1, 1", "1, 1")


class TestScoreRecords:
    def test_rouge_instance_and_corpus(self):
        records = [_rec("gov_report", "the cat sat on the mat", "the cat lay on the mat"),
                   _rec("gov_report", "a dog", "a dog barked")]
        g1, g2 = (5 / 6 * 0.6 * 5 / 6) ** (1 / 3), (0.8 * (2 / 3) * 0.8) ** (1 / 3)
        assert score_records(records)["datasets"]["gov_report"] == round(100 * (g1 + g2) / 2, 4)
        r1, r2 = (5 / 6 + 0.8) / 2, (0.6 + 2 / 3) / 2
        corpus = score_records(records, rouge_aggregation="corpus")
        assert corpus["datasets"]["gov_report"] == round(100 * (r1 * r2 * r1) ** (1 / 3), 4)
        assert corpus["rouge_aggregation"] == "corpus"

    def test_rouge_max_per_type_over_references(self):
        # "a b" vs "b a": R1 1, R2 0, RL 1/2; vs "a b c d": R1 2/3, R2 1/2, RL 2/3. Per type: 1, 1/2, 2/3
        score = score_records([_rec("squality", "a b", "b a", "a b c d")])["datasets"]["squality"]
        assert score == round(100 * (1 * 0.5 * 2 / 3) ** (1 / 3), 4)  # the best single reference gives (2/9)^(1/3)

    def test_other_datasets_and_mean(self):
        result = score_records([
            _rec("qasper", "the Penn Treebank", "Penn Treebank", "the Penn Treebank dataset"),  # max(1, 0.8)
            _rec("qasper", "yes", "unanswerable"),
            _rec("quality", "B", "(B) x"), _rec("space_digest", "50%", "70%"),
            _rec("book_sum_sort", "1, 3, 2", "3, 1, 2"),
        ])
        assert result["datasets"] == {"qasper": 50.0, "quality": 100.0, "space_digest": 25.0,
                                      "book_sum_sort": round(200 / 3, 4)}
        assert result["score"] == round((50 + 100 + 25 + 200 / 3) / 4, 4) and result["counts"]["qasper"] == 2
        assert list(result["datasets"]) == [d for d in DATASETS if d in result["datasets"]]

    def test_bad_records(self):
        with pytest.raises(ConfigError) as err:
            score_records([_rec("gov_reports", "x", "y")])
        assert "'gov_reports'" in str(err.value) and "book_sum_sort" in str(err.value)
        with pytest.raises(DataError, match="unlabeled"):
            score_records([{"dataset": "qasper", "prediction": "x", "answers": []}])
        with pytest.raises(ConfigError, match="rouge_aggregation"):
            score_records([], rouge_aggregation="mean")


# ---- the task -------------------------------------------------------------------------------------------------------
class TestFields:
    def test_yaml_lists_every_field_with_its_default(self):
        cfg = OmegaConf.to_container(OmegaConf.load(CONF_TASK / "zeroscrolls.yaml"))
        assert cfg.pop("name") == ZeroScrollsTask.name == "zeroscrolls"
        assert set(cfg) == {f.name for f in dataclasses.fields(ZeroScrollsTask)}
        assert ZeroScrollsTask(**cfg) == ZeroScrollsTask() and cfg["datasets"] == DATASETS and len(DATASETS) == 10
        ZeroScrollsTask(**cfg).validate()

    @pytest.mark.parametrize(("fields", "shown"), [
        ({"datasets": ["qasper", "qsper"]}, "qsper"), ({"datasets": []}, "[]"),
        ({"datasets": ["quality", "quality"]}, "duplicates"), ({"prompt_format": "instruct"}, "'instruct'"),
        ({"truncation": "left"}, "'left'"), ({"rouge_aggregation": "mean"}, "'mean'"), ({"truncate_to": 0}, "0"),
    ])
    def test_bad_values(self, fields, shown):
        with pytest.raises(ConfigError) as err:
            ZeroScrollsTask(**fields).validate()
        assert "zeroscrolls" in str(err.value) and shown in str(err.value)

    def test_unknown_dataset_names_the_valid_ones(self):
        with pytest.raises(ConfigError, match=r"valid: gov_report, summ_screen_fd, .*book_sum_sort"):
            ZeroScrollsTask(datasets=["qsper"]).validate()

    def test_missing_unidecode_fails_before_the_model(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "unidecode", None)
        m._unidecode.cache_clear()
        try:
            with pytest.raises(NotAvailableError, match=r"kvbench\[zeroscrolls\]"):
                ZeroScrollsTask(datasets=["qasper"]).validate()
            ZeroScrollsTask(datasets=["gov_report", "quality"]).validate()  # no F1 task: not needed
        finally:
            m._unidecode.cache_clear()

    def test_generation_budgets(self):
        task = _task()
        assert task.max_new_tokens == 1024 and ZeroScrollsTask(datasets=["quality", "musique"]).max_new_tokens == 32
        budgets = {s.meta["dataset"]: s.max_new_tokens for s in task.samples(None)}
        assert budgets == {"gov_report": 1024, "qmsum": 512, "qasper": 128, "quality": 10, "space_digest": 36,
                           "book_sum_sort": 256}
        protocol = task.protocol()
        assert "data_dir" not in protocol and protocol["split"] == "validation" and protocol["chat_template"]


class TestSamples:
    def test_references_merged_by_id(self):
        samples = {s.id: s for s in _task().samples(None)}
        assert list(samples)[:3] == ["gov_report/gr1", "gov_report/gr2", "qmsum/qm1"]
        assert samples["qasper/qs1"].answers == ["Penn Treebank", "the Penn Treebank dataset"]
        assert samples["qasper/qs2"].answers == ["unanswerable"] and len(samples) == 9

    def test_completion_prompt_is_the_input(self):
        row = _rows("qasper")[0]
        sample = _task(prompt_format="completion").samples(None)[3]
        assert sample.prompt == row["input"] and sample.prompt.endswith("\n\nAnswer:\n")
        assert sample.query == row["input"][row["query_start_index"]:] and sample.query.startswith("Question:\n")
        assert not _task(prompt_format="completion").chat_template

    def test_chat_prompt(self):
        row = _rows("qasper")[0]
        text, cut = row["input"], row["input"].find("\n\n")
        expected = text[:cut] + " " + REQUEST + text[cut:row["query_end_index"]]
        sample = {s.id: s for s in _task().samples(None)}["qasper/qs1"]
        assert sample.prompt == expected and sample.prompt.endswith("Which dataset do they evaluate on?")
        assert sample.query == "Question:\nWhich dataset do they evaluate on?"
        gov = _rows("gov_report")[0]  # summarisation: no format request, still no response header
        assert _task().samples(None)[0].prompt == gov["input"][:gov["query_end_index"]]
        assert REQUEST not in _task().samples(None)[0].prompt

    def test_official_truncation(self):
        task = _task(prompt_format="completion")
        sample = task.samples(None)[3]  # qasper/qs1
        tok = WordTokenizer()
        assert task.truncate_prompt(sample, tok, 10_000) == sample.prompt  # fits: unchanged
        suffix = sample.separator + sample.query
        budget = 60
        out = task.truncate_prompt(sample, tok, budget)
        keep = budget - len(suffix.split())
        assert out == " ".join(sample.head.split()[:keep]) + suffix
        assert out.startswith("You are given a scientific article") and out.endswith("\n\nAnswer:\n")
        assert "... [The rest of the article is omitted]\n\nQuestion:\nWhich dataset" in out
        assert task.truncate_prompt(sample, tok, 3) == suffix  # no room for the head

    def test_middle_option(self):
        task = _task(truncation="middle")
        sample = task.samples(None)[0]
        assert task.truncate_prompt(sample, WordTokenizer(), 30) == middle_truncate(sample.prompt, WordTokenizer(), 30)

    def test_real_tokenizer(self, tokenizer):
        task = _task(datasets=["quality"])
        sample = task.samples(tokenizer)[0]
        out = task.truncate_prompt(sample, tokenizer, 100)
        assert len(tokenizer.encode(out, add_special_tokens=False)) <= 102  # re-encoding the joint may differ by 1-2
        assert out.endswith(sample.separator + sample.query) and sample.head.startswith(out[:40])


class TestData:
    def test_zip_source(self, tmp_path):
        with zipfile.ZipFile(tmp_path / "qasper.zip", "w") as zf:
            zf.write(FIXTURES / "qasper" / "validation.jsonl", "qasper/validation.jsonl")
            zf.writestr("qasper/test.jsonl", json.dumps({**_rows("qasper")[0], "output": None}) + "\n")
        task = ZeroScrollsTask(data_dir=str(tmp_path), datasets=["qasper"])
        task.validate()
        assert [s.answers for s in task.samples(None)] == [["Penn Treebank", "the Penn Treebank dataset"],
                                                           ["unanswerable"]]

    def test_missing(self, tmp_path):
        with pytest.raises(DataError, match=r"data_dir=.*nowhere.*not a directory"):
            ZeroScrollsTask(data_dir=str(tmp_path / "nowhere")).validate()
        with pytest.raises(DataError) as err:
            ZeroScrollsTask(data_dir=str(FIXTURES), datasets=["quality", "musique"]).validate()
        message = str(err.value)
        assert "musique/validation.jsonl" in message and "musique.zip" in message and "\n" not in message

    @pytest.mark.parametrize(("change", "shown"), [
        ({"output": None}, "unlabeled"), ({"truncation_seperator": ...}, r"no field\(s\) truncation_seperator"),
    ])
    def test_malformed_rows(self, tmp_path, change, shown):
        row = {**_rows("quality")[0], **change}
        row = {k: v for k, v in row.items() if v is not ...}
        (tmp_path / "quality").mkdir()
        (tmp_path / "quality" / "validation.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
        with pytest.raises(DataError, match=shown):
            ZeroScrollsTask(data_dir=str(tmp_path), datasets=["quality"]).samples(None)

    def test_hub(self, tmp_path, monkeypatch):
        import huggingface_hub

        archive = tmp_path / "quality.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.write(FIXTURES / "quality" / "validation.jsonl", "quality/validation.jsonl")
        calls = []
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kw: calls.append(kw) or str(archive))
        task = ZeroScrollsTask(datasets=["quality"])
        assert len(task.samples(None)) == 2
        assert calls == [{"repo_id": "tau/zero_scrolls", "filename": "quality.zip", "repo_type": "dataset",
                          "local_files_only": True}]  # in the hub cache: no network

    def test_offline_hub_is_one_clear_line(self, monkeypatch):
        import huggingface_hub

        def offline(**kwargs):
            raise OSError("We couldn't connect to 'https://huggingface.co'\nto load this file.")

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
        monkeypatch.setattr("kvbench.hub.hub_unreachable", lambda: None)  # reachable, the download itself fails
        task = ZeroScrollsTask(datasets=["quality"])
        task.validate()
        with pytest.raises(DataError) as err:
            task.prepare_data()
        message = str(err.value)
        assert "\n" not in message and "task.data_dir" in message and "tau/zero_scrolls" in message
        assert "OSError: We couldn't connect" in message

    def test_unreachable_hub_is_one_line_without_a_network_call(self, monkeypatch):
        from helpers import UNREACHABLE, hub_without_network

        network = hub_without_network(monkeypatch)
        task = ZeroScrollsTask(datasets=["quality"])
        task.validate()
        with pytest.raises(DataError) as err:
            task.prepare_data()
        assert str(err.value) == (
            f"task 'zeroscrolls': could not download quality.zip of the hub dataset tau/zero_scrolls ({UNREACHABLE}); "
            "put the official zips (or their unpacked folders) in a directory and set task.data_dir=<that directory>")
        assert network == []  # refused before huggingface_hub's retries


def test_aggregate_equals_score_records():
    task = _task(datasets=["qasper", "quality", "book_sum_sort"])
    samples = task.samples(None)
    predictions = ["Penn Treebank", "no", "B", "The keeper (A)", "3, 2, 1"]
    records = [{"id": s.id, "prediction": p, "answers": s.answers, "meta": s.meta, "score": task.score(p, s)}
               for s, p in zip(samples, predictions)]
    result = task.aggregate(records)
    flat = [{"dataset": s.meta["dataset"], "prediction": p, "answers": s.answers} for s, p in zip(samples, predictions)]
    assert {k: v for k, v in result.items() if k != "n"} == score_records(flat)
    # 3,2,1 vs 3,1,2: only the pair (1, 2) is reversed -> 2/3
    assert result["datasets"] == {"qasper": 50.0, "quality": 100.0, "book_sum_sort": round(200 / 3, 4)}
    assert [r["score"] for r in records] == [1.0, 0.0, 1.0, 1.0, pytest.approx(2 / 3)]


@pytest.mark.slow
def test_smollm2_run_on_fixtures(tmp_path):
    """A real job: SmolLM2, SnapKV, ZeroSCROLLS fixtures (quality, space_digest), prompts cut to 150 tokens."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import run_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "task=zeroscrolls", f"task.data_dir={FIXTURES}", "task.datasets=[quality,space_digest]",
            "task.truncate_to=150", "method=snapkv", "budget=64", "limit=3", "print_table=false",
            f"paths.results_dir={tmp_path}"])
    scores = run_job(cfg)
    (job,) = sorted((tmp_path / "runs").glob("*/*/*/*/*"))
    records = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["quality/ql1", "quality/ql2", "space_digest/sd1"]
    assert [r["new_tokens"] <= n for r, n in zip(records, (10, 10, 36))] == [True] * 3
    assert all(r["prompt_tokens"] <= 150 + 40 for r in records)  # budget + chat template tokens
    assert set(scores["datasets"]) == {"quality", "space_digest"} and scores["n_samples"] == 3
