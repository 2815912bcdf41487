"""LEval: the auto_eval.py scorers pinned by hand-computed values (quirks included), prompts of llama2-chat-test.py,
the word-by-word document truncation, loading (fixtures in tests/fixtures/leval, official jsonl, GitHub layout) and
one SmolLM2 run."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.errors import ConfigError, DataError
from kvbench.metrics import leval as m
from kvbench.tasks.base import Sample
from kvbench.tasks.leval import LEvalSample, LEvalTask
from kvbench.tasks.leval.scoring import DATASETS, score_records
from kvbench.tasks.leval.task import cut_document
from kvbench.tasks.text import middle_truncate

FIXTURES = Path(__file__).parent / "fixtures" / "leval"
CONF_TASK = Path(__file__).resolve().parents[1] / "conf" / "task"
FIXTURE_DATASETS = ["coursera", "quality", "gsm100", "topic_retrieval_longchat", "sci_fi", "codeU", "financial_qa",
                    "gov_report_summ"]
SYS_EXAM = ("Now you are given a very long document. Please follow the instruction based on this document. For "
            "multi-choice questions, there is only a sinlge correct option. Please only provide the letter "
            "corresponding to the answer (like A or B) when answering. For other questions, please directly give the "
            "concise and accurate answer. ")


class WordTokenizer:
    """One id per whitespace word; ``encode`` adds a BOS id (0) unless ``add_special_tokens=False``."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def encode(self, text, add_special_tokens=True):
        ids = [self.ids.setdefault(w, len(self.ids) + 1) for w in text.split()]
        return [0, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens=True):
        words = {i: w for w, i in self.ids.items()}
        return " ".join(words[i] for i in ids if i)


def _task(**fields):
    task = LEvalTask(**{"data_dir": str(FIXTURES), "datasets": FIXTURE_DATASETS, **fields})
    task.validate()
    return task


def _by_id(task) -> dict[str, Sample]:
    return {s.id: s for s in task.samples(None)}


def _rec(dataset, prediction, answer, **extra):
    return {"dataset": dataset, "prediction": prediction, "answers": [answer], **extra}


# ---- em.py / f1.py / rouge.py ---------------------------------------------------------------------------------------
class TestExactMatch:
    def test_normalisation_keeps_case(self):
        assert m.normalize_exam("The  answer, a B!") == "The answer B"  # only lowercase articles go
        assert m.normalize_f1("The  answer, a B!") == "answer b"

    def test_option_answers(self):
        assert m.exact_match_score("AB", "AB") == 1
        assert m.exact_match_score("A", "AB") == 0.25  # a subset of the right options: a quarter
        assert m.exact_match_score("AC", "AB") == 0
        assert m.exact_match_score("", "A") == 0.25  # the empty set is a subset too (process_output_mc avoids it)
        assert m.exact_match_score("b", "B") == 0  # no lowercasing for options
        assert m.exact_match_score("a", "A") == 0.25  # "a" is an article: normalised away, the empty set again

    def test_other_answers(self):
        assert m.exact_match_score("18.0", "18") == 1 and m.exact_match_score("7", "18") == 0  # float equality
        assert m.exact_match_score("I think: The Role of Art in  Society!", "The role of art in society") == 1
        assert m.exact_match_score("art", "The role of art") == 0  # the reference must be inside the prediction

    def test_f1(self):
        # [eiffel, tower, paris] vs [eiffel, tower]: P = 2/3, R = 1, F = 0.8
        assert m.f1_score("The Eiffel Tower, Paris", "eiffel tower") == pytest.approx(0.8)
        assert m.f1_score("", "x") == 0

    def test_rouge_is_unstemmed_rouge_score(self):
        # unigrams 5/6 both ways; bigrams 3 of 5; LCS "the cat on the mat" = 5 of 6
        assert m.rouge_scores("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(
            {"rouge1": 5 / 6, "rouge2": 0.6, "rougeL": 5 / 6})
        assert m.rouge_scores("cats running", "cat run")["rouge1"] == 0  # no stemmer
        assert m.rouge_scores("The Cat", "the cat")["rouge2"] == 1  # rouge-score lowercases


class TestPreprocessing:
    @pytest.mark.parametrize(("response", "multi", "expected"), [
        ("", False, "None"), ("  ", True, "None"),
        ("AB", False, "AB"),                      # a substring of "ABCD" is returned as is
        ("Answer: C", False, "A"),                # single answer: the first A-D anywhere, the "A" of "Answer"
        ("The answer is (C).", False, "C"),
        ("I don't know", False, "A"),             # no A-D at all: falls through to the random guess
        ("BA, because", True, "AB"),              # coursera: a leading run of two or more, sorted
        ("B. Quizzes and A. Lectures", True, "AB"),  # one leading letter + capitals before " ", "." or ")"
        (" C and D", True, "C"),                  # the final D has nothing after it, so it is not an option
        ("xBAy", True, "BA"),                     # last resort: the first run, unsorted
        ("B\nQuestion 2. A", True, "B"),          # nothing after "Question" counts
    ])
    def test_process_output_mc(self, response, multi, expected):
        assert m.process_output_mc(response, multi) == expected

    def test_process_gt_mc(self):
        assert m.process_gt_mc("(B) Ships depended on it.") == "B"
        assert m.process_gt_mc("ABD") == "ABD" and m.process_gt_mc("(E) none") == "A"

    @pytest.mark.parametrize(("response", "expected"), [
        ("So she makes 9 * 2 = $18.\n\nThe next one 99", "18"),  # last number-word of the first paragraph
        ("The answer is 1,234.50 dollars", "1234"),              # digits up to the first "."
        ("no digits here", ""), ("The answer is x", ""),
    ])
    def test_process_math(self, response, expected):
        assert m.process_math(response) == expected

    def test_code(self):
        assert m.process_gt_code("array([6.0, 15.0])") == "array([6 15])"
        # "is" is removed everywhere; no lowercase "the final output", so the last len(gt) + 3 = 5 tokens
        assert m.process_output_code("The final output is:\n[6, 15]", "[6 15]") == "final output : [6 15]"
        assert m.process_output_code("this will be the final output [6, 15] done", "[6 15]") == " [6 15] done"

    def test_judge(self):
        assert m.judge_parts("True [fact: False]") == ("true", "false")
        assert m.judge_parts("no fact part") == ("no fact part", "")
        assert m.judge_word("It is TRUE.") == "true" and m.judge_word("maybe") == "<error>"
        assert m.judge_word("Untrue, false") == "true"  # "true" inside the first word counts


# ---- auto_eval.py aggregation ---------------------------------------------------------------------------------------
class TestScoreRecords:
    def test_exam_datasets(self):
        records = [_rec("coursera", "C", "C"), _rec("coursera", "A", "AB"),          # 1 + 0.25
                   _rec("quality", "Answer: B", "(B) x"), _rec("quality", "C", "(C) y"),  # 0 + 1
                   _rec("gsm100", "9 * 2 = 18. The answer is 18.", "18"),
                   _rec("codeU", "The final output is:\n[6, 15]", "[6 15]")]
        scores = score_records(records)["datasets"]
        assert scores == {"coursera": 62.5, "quality": 50.0, "gsm100": 100.0, "codeU": 100.0}

    def test_topic_retrieval_averages_the_three_positions(self):
        answers = ["Art", "Space", "Media", "Food"]
        preds = ["Art", "none", "none", "Food"]  # question 3 is a "first topic" question again (i % 3)
        result = score_records([_rec("topic_retrieval_longchat", p, a) for p, a in zip(preds, answers)])
        assert result["details"]["topic_retrieval_longchat"] == {"first": 100.0, "second": 0.0, "third": 0.0}
        assert result["datasets"]["topic_retrieval_longchat"] == pytest.approx(100 / 3)  # a plain mean would be 50

    def test_topic_uses_question_index_when_given(self):
        records = [_rec("topic_retrieval_longchat", "Art", "Art", question_index=1)]
        assert score_records(records)["details"]["topic_retrieval_longchat"] == {"second": 100.0}

    def test_sci_fi_parts_and_combined_predictions(self):
        gold = ["True [fact: False]", "False [fact: False]"]
        parts = [_rec("sci_fi", "True.", gold[0], part="loyalty"), _rec("sci_fi", "false", gold[0], part="fact"),
                 _rec("sci_fi", "maybe", gold[1], part="loyalty"), _rec("sci_fi", "False!", gold[1], part="fact")]
        result = score_records(parts)
        assert result["details"]["sci_fi"] == {"loyalty": 50.0, "fact": 100.0}
        assert result["datasets"]["sci_fi"] == 75.0
        combined = [_rec("sci_fi", "True. [fact: false]", gold[0]), _rec("sci_fi", "maybe [fact: False!]", gold[1])]
        assert score_records(combined)["datasets"]["sci_fi"] == 75.0

    def test_f1_and_rouge_datasets(self):
        f1 = score_records([_rec("financial_qa", "The Eiffel Tower, Paris", "eiffel tower"),
                            _rec("financial_qa", "x", "y")])["datasets"]["financial_qa"]
        assert f1 == 40.0
        result = score_records([_rec("news_summ", "the cat sat on the mat", "the cat lay on the mat"),
                                _rec("news_summ", "a dog", "a dog barked")])
        # record 2: unigrams P 1 R 2/3 -> 0.8; bigram P 1 R 1/2 -> 2/3; LCS as unigrams -> 0.8
        r1, r2 = (5 / 6 + 0.8) / 2 * 100, (0.6 + 2 / 3) / 2 * 100
        assert result["details"]["news_summ"] == pytest.approx({"rouge1": r1, "rouge2": r2, "rougeL": r1}, abs=1e-4)
        assert result["datasets"]["news_summ"] == round((r1 * r2 * r1) ** (1 / 3), 4)  # geometric mean of the means

    def test_groups_score_and_leaderboard(self):
        result = score_records([_rec("coursera", "C", "C"), _rec("quality", "D", "(C) y"),
                                _rec("financial_qa", "x y", "x z"), _rec("news_summ", "a b", "a b")])
        assert result["groups"] == {"closed": 50.0, "qa": 50.0, "summ": 100.0}
        assert result["score"] == round(200 / 3, 4)  # POD: mean of Closed, QA, Summ
        assert result["leaderboard"] == {"exact_match_avg": 50.0, "f1_avg": 50.0, "rougeL_avg": 100.0}
        assert result["counts"] == {"coursera": 1, "quality": 1, "financial_qa": 1, "news_summ": 1}

    def test_bad_records(self):
        with pytest.raises(ConfigError) as err:
            score_records([_rec("courser", "A", "A")])
        assert "'courser'" in str(err.value) and "coursera" in str(err.value) and "tv_show_summ" in str(err.value)
        with pytest.raises(DataError, match="answers"):
            score_records([{"dataset": "quality", "prediction": "A", "answers": []}])
        with pytest.raises(DataError, match="part"):
            score_records([_rec("sci_fi", "true", "True [fact: True]", part="both")])


# ---- the task -------------------------------------------------------------------------------------------------------
class TestFields:
    def test_yaml_lists_every_field_with_its_default(self):
        cfg = OmegaConf.to_container(OmegaConf.load(CONF_TASK / "leval.yaml"))
        assert cfg.pop("name") == LEvalTask.name == "leval"
        assert set(cfg) == {f.name for f in dataclasses.fields(LEvalTask)}
        assert LEvalTask(**cfg) == LEvalTask() and cfg["datasets"] == DATASETS and len(DATASETS) == 20
        LEvalTask(**cfg).validate()  # data_dir null: nothing is downloaded at validation time

    @pytest.mark.parametrize(("fields", "shown"), [
        ({"datasets": ["quality", "qualty"]}, "qualty"), ({"datasets": []}, "[]"),
        ({"datasets": ["tpo", "tpo"]}, "duplicates"), ({"prompt_format": "raw"}, "'raw'"),
        ({"truncation": "left"}, "'left'"), ({"system_role": "yes"}, "'yes'"), ({"truncate_to": 0}, "0"),
        ({"max_new_tokens": 0}, "0"),
    ])
    def test_bad_values(self, fields, shown):
        with pytest.raises(ConfigError) as err:
            LEvalTask(**fields).validate()
        assert "leval" in str(err.value) and shown in str(err.value)

    def test_unknown_dataset_names_the_valid_ones(self):
        with pytest.raises(ConfigError, match=r"valid: coursera, gsm100, .*tv_show_summ"):
            LEvalTask(datasets=["qualty"]).validate()

    def test_protocol(self):
        protocol = _task(datasets=["quality", "financial_qa"]).protocol()
        assert "data_dir" not in protocol and protocol["version"] == "1" and protocol["max_new_tokens"] == 512
        assert protocol["dataset2metric"] == {"quality": "exam", "financial_qa": "f1"} and protocol["chat_template"]


class TestSamples:
    def test_ids_order_and_skipped_rows(self):
        ids = list(_by_id(_task()))
        assert ids[:5] == ["coursera/0-0", "coursera/0-1", "quality/0-0", "quality/0-1", "gsm100/0-0"]
        assert "sci_fi/0-0/loyalty" in ids and "sci_fi/0-0/fact" in ids
        financial = [i for i in ids if i.startswith("financial_qa")]
        assert financial == ["financial_qa/0-0", "financial_qa/0-1"]  # the "LLM" row is skipped

    def test_exam_prompt_chat_and_llama2(self):
        row = json.loads((FIXTURES / "Closed-ended-tasks" / "quality.jsonl").read_text().splitlines()[0])
        inst = row["instructions"][0]
        body = (f"Document is as follows. {row['input']} \nQuestion: {inst}.  Please directly give the answer without "
                f"any additional output or explanation ")
        chat = _by_id(_task())["quality/0-0"]
        assert (chat.system, chat.prompt, chat.assistant_prefix) == (SYS_EXAM, body, "\nAnswer:")
        raw = _by_id(_task(prompt_format="llama2"))["quality/0-0"]
        assert raw.prompt == f"[INST]<<SYS>>\n{SYS_EXAM}\n<</SYS>>\n\n{body}[/INST]\nAnswer:"
        assert raw.system is None and raw.assistant_prefix == "" and not _task(prompt_format="llama2").chat_template
        assert chat.answers == ["(B) Ships depended on it."] and chat.max_new_tokens == 512

    def test_other_templates(self):
        samples = _by_id(_task(prompt_format="llama2"))
        gsm = samples["gsm100/0-0"]
        assert gsm.prompt.endswith("\n\nQuestion: Janet has 16 eggs. She eats 3 and bakes with 4. She sells the rest "
                                   "for $2 each. How many dollars does she make?\nLet's think step by step\n")
        assert "[/INST]" not in gsm.prompt  # upstream never closes the instruction for gsm100 and codeU
        assert samples["topic_retrieval_longchat/0-2"].prompt.endswith("Do not summarize yourself.[/INST]")
        open_ended = samples["financial_qa/0-1"]  # reference "Twelve percent." has 2 words
        assert open_ended.prompt.endswith("Instruction: You are asked to act as a member of the Financial Results "
                                          "Conference Call and answer the question: By how much did revenue grow? "
                                          "\nAnswer this question with 2 words.[/INST]")
        assert open_ended.prompt.startswith("[INST]<<SYS>>\nNow you are given a very long document. Please follow "
                                            "the instruction after this document.")

    def test_system_role_off(self):
        sample = _by_id(_task(system_role=False))["quality/0-0"]
        assert sample.system is None and sample.prompt.startswith(SYS_EXAM + "Document is as follows. ")

    def test_sci_fi_fact_question_is_raw_and_documentless(self):
        task = _task()
        samples = _by_id(task)
        fact, loyalty = samples["sci_fi/0-0/fact"], samples["sci_fi/0-0/loyalty"]
        assert fact.prompt == ("1.\thumans can travel faster than light, True or False? Answer this question based on "
                               "the real-world knowledge and facts up until your last trainingPlease directly answer "
                               "without any additional output or explanation. \nAnswer:")
        assert not task.chat_template_for(fact) and task.chat_template_for(loyalty)
        assert (fact.meta["part"], loyalty.meta["part"]) == ("fact", "loyalty")
        assert fact.meta["question_index"] == loyalty.meta["question_index"] == 0
        assert fact.answers == loyalty.answers == ["True [fact: False]"]

    def test_format_quirk(self):
        def render(doc):
            sample = LEvalSample(id="x", prompt="", answers=["a"], head="", document=doc, tail="\n\nQ {inst}",
                                 instruction="Q", format_quirk=True)
            return sample.render(doc)

        assert render("x = {{1}}") == "x = {1}\n\nQ Q"  # upstream's str.format succeeds and unescapes
        assert render("d = {'a': 1}") == "d = {'a': 1}\n\nQ {inst}"  # KeyError: left as it was

    def test_codeu_document_with_braces_is_unchanged(self):
        sample = _by_id(_task())["codeU/0-0"]
        assert "{'a': a}" in sample.prompt and sample.keep_end


class TestTruncation:
    def test_cut_document_word_steps(self):
        doc = " ".join(f"w{i}" for i in range(1000))
        tok = WordTokenizer()
        # 1001 tokens (BOS) > 300: keep 300 words -> 301 > 300: keep 300 - 250 = 50 words -> 51 tokens
        assert cut_document(doc, tok, 300, keep_end=False, step=250) == " ".join(f"w{i}" for i in range(50))
        assert cut_document(doc, tok, 300, keep_end=True, step=250) == " ".join(f"w{i}" for i in range(950, 1000))
        assert cut_document(doc, tok, 200, keep_end=False, step=250) == ""  # 200 - 250 < 0 words: upstream loops
        assert cut_document("a b", tok, 300, keep_end=False, step=250) == "a b"

    def test_official_cuts_only_the_document(self):
        task = _task(prompt_format="llama2")
        sample = _by_id(task)["quality/0-0"]
        out = task.truncate_prompt(sample, WordTokenizer(), 400)
        cut = cut_document(sample.document, WordTokenizer(), 400, False, 250)
        assert out == sample.head + cut + sample.tail and sample.document.startswith(cut)
        assert 0 < len(cut.split()) < 400 < len(sample.document.split())
        assert out.endswith("[/INST]\nAnswer:") and out.startswith("[INST]<<SYS>>")

    def test_middle_option(self):
        task = _task(truncation="middle")
        sample = _by_id(task)["quality/0-0"]
        tok = WordTokenizer()
        assert task.truncate_prompt(sample, tok, 60) == middle_truncate(sample.prompt, tok, 60)

    def test_real_tokenizer_budget(self, tokenizer):
        task = _task(datasets=["gov_report_summ"])
        sample = task.samples(tokenizer)[0]
        out = task.truncate_prompt(sample, tokenizer, 120)
        document = out[len(sample.head): len(out) - len(sample.tail)]
        assert len(tokenizer.encode(document)) <= 120 < len(tokenizer.encode(sample.document))
        assert sample.document.startswith(document) and out.endswith(sample.tail)


class TestData:
    def test_layouts(self, tmp_path):
        shutil.copy(FIXTURES / "Closed-ended-tasks" / "quality.jsonl", tmp_path / "quality.jsonl")  # flat
        (tmp_path / "LEval" / "Generation").mkdir(parents=True)  # hub layout
        shutil.copy(FIXTURES / "Open-ended-tasks" / "financial_qa.jsonl", tmp_path / "LEval" / "Generation")
        task = LEvalTask(data_dir=str(tmp_path), datasets=["quality", "financial_qa"])
        task.validate()
        assert len(task.samples(None)) == 4

    def test_missing_files(self, tmp_path):
        with pytest.raises(DataError, match=r"data_dir=.*nowhere.*not a directory"):
            LEvalTask(data_dir=str(tmp_path / "nowhere")).validate()
        with pytest.raises(DataError) as err:
            LEvalTask(data_dir=str(FIXTURES), datasets=["quality", "tpo", "news_summ"]).validate()
        message = str(err.value)
        assert "has no tpo.jsonl, news_summ.jsonl" in message and str(FIXTURES) in message and "\n" not in message

    @pytest.mark.parametrize(("line", "shown"), [
        ('{"input": "d", "instructions": ["q"], "evaluation": "exam"}', r"no field\(s\) outputs"),
        ('{"input": "d", "instructions": ["q", "r"], "outputs": ["a"], "evaluation": "exam"}', "2 instructions"),
        ("version https://git-lfs.github.com/spec/v1", "Git-LFS"), ("{oops", "not JSON"),
        ('{"input": "d", "instructions": ["q"], "outputs": ["a"], "evaluation": "f1"}', "expected 'exam'"),
    ])
    def test_malformed_files(self, tmp_path, line, shown):
        (tmp_path / "quality.jsonl").write_text(line + "\n", encoding="utf-8")
        with pytest.raises(DataError, match=shown):
            LEvalTask(data_dir=str(tmp_path), datasets=["quality"]).samples(None)

    def test_hub(self, monkeypatch):
        import huggingface_hub

        calls = []

        def fake(**kwargs):
            calls.append(kwargs)
            group = "Closed-ended-tasks" if "Exam" in kwargs["filename"] else "Open-ended-tasks"
            return str(FIXTURES / group / kwargs["filename"].rsplit("/", 1)[1])

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
        task = LEvalTask(datasets=["quality", "financial_qa"])
        task.prepare_data()
        assert [(c["repo_id"], c["filename"], c["repo_type"]) for c in calls] == [
            ("L4NLP/LEval", "LEval/Exam/quality.jsonl", "dataset"),
            ("L4NLP/LEval", "LEval/Generation/financial_qa.jsonl", "dataset")]
        assert len(task.samples(None)) == 4

    def test_offline_hub_is_one_clear_line(self, monkeypatch):
        import huggingface_hub

        def offline(**kwargs):
            raise OSError("We couldn't connect to 'https://huggingface.co'\nto load this file.")

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
        monkeypatch.setattr("kvbench.hub.hub_unreachable", lambda: None)  # reachable, the download itself fails
        task = LEvalTask(datasets=["quality"])
        task.validate()  # nothing is fetched before the model loads
        with pytest.raises(DataError) as err:
            task.prepare_data()
        message = str(err.value)
        assert "\n" not in message and "task.data_dir" in message and "L4NLP/LEval" in message
        assert "OSError: We couldn't connect" in message

    def test_unreachable_hub_is_one_line_without_a_network_call(self, monkeypatch):
        from helpers import UNREACHABLE, hub_without_network

        network = hub_without_network(monkeypatch)
        task = LEvalTask(datasets=["quality"])
        task.validate()
        with pytest.raises(DataError) as err:
            task.prepare_data()
        assert str(err.value) == (
            "task 'leval': could not download LEval/Exam/quality.jsonl of the hub dataset L4NLP/LEval "
            f"({UNREACHABLE}); put the official LEval .jsonl files in a directory and set "
            "task.data_dir=<that directory>")
        assert network == []  # refused before huggingface_hub's retries


def test_aggregate_equals_score_records():
    task = _task(datasets=["coursera", "sci_fi", "gov_report_summ"])
    samples = task.samples(None)
    predictions = ["C", "B", "True", "true", "False", "no", "The report describes emergency powers."]
    records = [{"id": s.id, "prediction": p, "answers": s.answers, "meta": s.meta, "score": task.score(p, s)}
               for s, p in zip(samples, predictions)]
    flat = [{"dataset": s.meta["dataset"], "prediction": p, "answers": s.answers, "part": s.meta.get("part")}
            for s, p in zip(samples, predictions)]
    result = task.aggregate(records)
    assert {k: v for k, v in result.items() if k != "n"} == score_records(flat) and result["n"] == 7
    assert result["datasets"]["coursera"] == 62.5  # "B" vs "AB": a quarter
    assert result["details"]["sci_fi"] == {"loyalty": 100.0, "fact": 0.0}  # "no" is no answer: "<error>"
    assert [r["score"] for r in records[:2]] == [1.0, 0.25] and not math.isnan(result["score"])


@pytest.mark.slow
def test_smollm2_run_on_fixtures(tmp_path):
    """A real job: SmolLM2, SnapKV, LEval fixtures, documents cut to 200 tokens, 3 samples."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import run_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "task=leval", f"task.data_dir={FIXTURES}", "task.datasets=[quality,sci_fi]", "task.truncate_to=200",
            "task.max_new_tokens=8", "method=snapkv", "budget=64", "limit=3", "print_table=false",
            f"paths.results_dir={tmp_path}"])
    scores = run_job(cfg)
    (job,) = sorted((tmp_path / "runs").glob("*/*/*/*/*"))
    records = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["quality/0-0", "quality/0-1", "sci_fi/0-0/loyalty"]
    assert all(r["new_tokens"] <= 8 for r in records)
    assert all(r["prompt_tokens"] < 200 + 200 for r in records)  # the document was cut to 200 tokens
    assert set(scores["datasets"]) == {"quality", "sci_fi"} and scores["n_samples"] == 3
    assert scores["details"]["sci_fi"].keys() == {"loyalty"}
