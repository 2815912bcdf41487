"""InfiniteBench: the official scorers pinned by hand-computed values (every quirk of compute_scores.py and the
label types), the official templates, per-task generation lengths, truncation, aggregation, data files and the
offline hub download (fixtures in tests/fixtures/infinitebench, the hub's raw jsonl format), and a short SmolLM2 run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.errors import ConfigError, DataError
from kvbench.metrics import infinitebench as ib
from kvbench.models.spec import ModelSpec
from kvbench.tasks import build_task
from kvbench.tasks.encoding import prompt_token_budget, render_prompt
from kvbench.tasks.infinitebench import InfiniteBenchTask
from kvbench.tasks.infinitebench.scoring import score_records
from kvbench.tasks.infinitebench.task import TASKS

FIXTURES = Path(__file__).parent / "fixtures" / "infinitebench"
CONF_TASK = Path(__file__).resolve().parents[1] / "conf" / "task"
ROOT = Path(__file__).resolve().parents[1]
# eval_utils.DATA_NAME_TO_MAX_NEW_TOKENS, written out independently of prompts.json
OFFICIAL_MAX_NEW = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200,
                    "longbook_choice_eng": 40, "longbook_qa_eng": 40, "longbook_qa_chn": 40, "longdialogue_qa_eng": 40,
                    "math_find": 3, "math_calc": 30000, "code_run": 5, "code_debug": 5}


def _task(**fields) -> InfiniteBenchTask:
    task = InfiniteBenchTask(**{"data_dir": str(FIXTURES), **fields})
    task.validate()
    return task


def _rows(task: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


def _first(task: str, **fields):
    return _task(datasets=[task], **fields).samples(None)[0]


# ---- scorers (compute_scores.py) ------------------------------------------------------------------------------------
class TestRetrievalScorers:
    def test_passkey_first_digit_run_as_string(self):
        assert ib.passkey_score("71432.", "71432") == 1.0
        assert ib.passkey_score("The pass key is 71432 and 5", "71432") == 1.0
        assert ib.passkey_score("-71432", "71432") == 1.0  # the sign is not a digit
        assert ib.passkey_score("071432", "71432") == 0.0  # compared as strings
        assert ib.passkey_score("5297", "05297") == 0.0 and ib.passkey_score("05297", "05297") == 1.0
        assert ib.passkey_score("714.32", "71432") == 0.0  # the run stops at the point

    def test_kv_retrieval_whole_word_after_punctuation(self):
        uuid = "d1ff29be-4e2a-4208-a182-0cea716be3d4"
        assert ib.kv_retrieval_score(f'"{uuid}".', uuid) == 1.0  # quotes and the period become spaces
        assert ib.kv_retrieval_score(f"value:{uuid}\n", uuid) == 1.0
        assert ib.kv_retrieval_score(f"x{uuid}", uuid) == 0.0  # substring only
        assert ib.kv_retrieval_score(uuid[:-1], uuid) == 0.0


class TestCodeScorers:
    def test_code_run_last_word_as_int(self):
        assert ib.code_run_score("The value is 14.", 14) == 1.0
        assert ib.code_run_score("14 is the value", 14) == 0.0  # the *last* word
        assert ib.code_run_score("It returns -13", -13) == 1.0
        assert ib.code_run_score("13.0", 13) == 0.0  # "." becomes a space: the last word is "0"
        assert ib.code_run_score("", 13) == 0.0

    def test_code_run_label_type_pitfall(self):
        assert ib.code_run_score("14", "14") == 0.0  # int("14") != "14": string labels never match upstream
        assert ib.official_label("code_run", ["14"]) == 14  # so kvbench restores the int
        assert ib.official_label("code_run", [14]) == 14 and ib.official_label("code_run", 14) == 14

    def test_code_debug(self):
        label = ["repack_carchive", "B"]
        assert ib.code_debug_score("B. repack_carchive", label) == 1.0
        assert ib.code_debug_score("  B: it crashes", label) == 1.0
        assert ib.code_debug_score("The answer is: B", label) == 1.0
        assert ib.code_debug_score("The answer is: repack_carchive", label) == 1.0
        assert ib.code_debug_score("The correct option is: B", label) == 1.0  # "is:" matches inside it
        assert ib.code_debug_score("A. foo", label) == 0.0
        # prefixes are tried in list order, not text order: "is:" decides before "answer:" is looked at
        assert ib.code_debug_score("It is: A, the answer: B", label) == 0.0
        assert ib.code_debug_score("This is: wrong. The answer is: B", label) == 1.0
        assert ib.code_debug_score("B", label) == 0.0  # a bare letter has neither "." nor ":" nor a prefix
        assert ib.code_debug_score("The answer is:", label) == 0.0  # ends with the prefix

    def test_code_debug_option_word_is_removed(self):
        # "Option" is replaced by a space before the prefix search: "answer is: Option B" -> "answer is: B"
        assert ib.code_debug_score("My answer is: Option B", ["f", "B"]) == 1.0


class TestMathScorers:
    def test_math_find_types(self):
        assert ib.math_find_score("88", 88) == 1.0
        assert ib.math_find_score("The answer is 88, not 3", 88) == 1.0
        assert ib.math_find_score("-88", 88) == 1.0  # no sign in the regex
        assert ib.math_find_score("88.5", 88) == 0.0  # upstream int("88.5") raises; kvbench scores 0
        assert ib.math_find_score("88.0", 88) == 0.0  # the same: an int label is compared with int(), not float()
        assert ib.math_find_score("3.0", 3.0) == 1.0 and ib.math_find_score("3", 3.0) == 1.0
        assert ib.math_find_score("3.5", 3.0) == 0.0 and ib.math_find_score("none", 3) == 0.0

    def test_math_find_label_types(self):
        assert ib.official_label("math_find", [88]) == 88
        assert type(ib.official_label("math_find", ["88"])) is int  # upstream: TypeError on a str label
        assert ib.official_label("math_find", ["3.5"]) == 3.5
        assert type(ib.official_label("math_find", [3.0])) is float

    def test_math_calc_prefix_fraction(self):
        assert ib.math_calc_score("[35, 47, 39]", [35, 47, 39]) == 1.0
        assert ib.math_calc_score("[35, 47, 40, 39]", [35, 47, 39]) == pytest.approx(2 / 3)
        assert ib.math_calc_score("[35, 99, 39]", [35, 47, 39]) == pytest.approx(1 / 3)  # stops at the mismatch
        assert ib.math_calc_score("35 47", [35, 47, 39]) == pytest.approx(2 / 3)
        assert ib.math_calc_score("", [35, 47, 39]) == 0.0
        # signs are lost: "-4" reads 4, so a negative intermediate never matches
        assert ib.math_calc_score("[5, -4, -2, 8]", [5, -4, -2, 8]) == 0.25

    def test_math_calc_gpt4_drops_the_first_number(self):
        assert ib.math_calc_score("[1, 35, 47]", [35, 47, 39], drop_first=True) == pytest.approx(2 / 3)
        assert ib.math_calc_score("[1, 35, 47]", [35, 47, 39]) == 0.0

    def test_math_calc_labels(self):
        assert ib.official_label("math_calc", [[35, 47, 39]]) == [35, 47, 39]  # the hub nests the list
        assert ib.official_label("math_calc", ["35", "-4"]) == [35, -4]
        with pytest.raises(DataError, match="empty"):
            ib.official_label("math_calc", [[]])


class TestNovelAndDialogueScorers:
    def test_longdialogue_first_name_whole_word(self):
        assert ib.longdialogue_qa_score("Ace Rothstein said", ["ACE", "ACE ROTHSTEIN"]) == 1.0
        assert ib.longdialogue_qa_score("ACEY", ["ACE"]) == 0.0
        assert ib.longdialogue_qa_score("Ace Rothstein", ["ACE ROTHSTEIN"]) == 0.0  # a two-word label never matches
        assert ib.longdialogue_qa_score("GINGER.", ["ACE", "GINGER"]) == 0.0  # only label[0] counts
        assert ib.official_label("longdialogue_qa_eng", "GINGER") == ["GINGER"]  # upstream would use "G"

    def test_longbook_choice_first_letter_wins(self):
        label = ["Sunday", "D"]
        assert ib.longbook_choice_score("A. no wait, the answer is D", label) == 0.0  # a last-letter rule: 1
        assert ib.longbook_choice_score("D. Sunday", label) == 1.0
        assert ib.longbook_choice_score(" Sunday ", label) == 1.0  # the whole answer text
        assert ib.longbook_choice_score("I think the answer is: D", label) == 1.0
        assert ib.longbook_choice_score("I think the answer is D.", label) == 1.0  # "answer is" + one char
        assert ib.longbook_choice_score("I think the answer is Sunday", label) == 1.0
        assert ib.longbook_choice_score("Option D", label) == 1.0  # first word that is in "ABCD"
        assert ib.longbook_choice_score("Maybe C or D", label) == 0.0  # ... the first one
        assert ib.longbook_choice_score("Pick BC", ["x", "B"]) == 0.0  # "BC" is a substring of "ABCD"
        assert ib.longbook_choice_score("", label) == 0.0

    def test_choice_labels_follow_get_answer(self):
        options = ["Monday", "Friday", "Saturday", "Sunday"]
        assert ib.official_label("longbook_choice_eng", ["Sunday"], options) == ["Sunday", "D"]
        assert ib.official_label("longbook_choice_eng", "Friday", options) == ["Friday", "B"]
        assert ib.official_label("code_debug", ["f", "C"]) == ["f", "C"]  # already [answer, letter]
        with pytest.raises(DataError, match="options"):
            ib.official_label("code_debug", ["f"])
        with pytest.raises(DataError, match="not one of the options"):
            ib.official_label("longbook_choice_eng", ["Tuesday"], options)

    def test_qa_eng_token_f1(self):
        assert ib.longbook_qa_eng_score("The books", ["books"]) == 1.0
        # [banker, i, think] vs [banker]: P = 1/3, R = 1, F = 0.5 for both answers
        assert ib.longbook_qa_eng_score("a banker, I think", ["a banker", "banker"]) == pytest.approx(0.5)
        assert ib.longbook_qa_eng_score("London", ["Paris"]) == 0.0

    def test_qa_chn_is_character_level(self):
        # 8 characters vs 2, overlap 2: P = 1/4, R = 1, F = 0.4 (LongBench's jieba word F1 gives 1/3)
        assert ib.longbook_qa_chn_score("北京是中国的首都", ["北京"]) == pytest.approx(0.4)
        assert ib.longbook_qa_chn_score("救星行动。", ["救星行动"]) == 1.0  # punctuation dropped

    def test_sum_is_rouge_lsum_of_rouge_score(self):
        # tokens lower-cased (unlike LongBench's pltrdy ROUGE): LCS 3 of [the cat sat] vs 6 ref tokens -> F = 2/3
        assert ib.longbook_sum_score("the cat sat", ["The cat sat on the mat"]) == pytest.approx(2 / 3)
        # sentences split on newlines: the union of both sentences' LCS covers 4 ref tokens -> P 1, R 4/6, F 0.8
        # (plain rougeL over the joined text would be 0.6)
        assert ib.longbook_sum_score("the mat\ncat sat", ["the cat sat on the mat"]) == pytest.approx(0.8)
        assert ib.longbook_sum_score("the cat sat", ["dog", "The cat sat on the mat"]) == pytest.approx(2 / 3)
        assert ib.longbook_sum_score("", ["the cat"]) == 0.0


class TestLabels:
    def test_retrieval_labels_are_strings(self):
        assert ib.official_label("passkey", ["71432"]) == "71432"
        assert ib.official_label("number_string", "3000077442") == "3000077442"
        assert ib.official_label("kv_retrieval", ["uuid-1"]) == "uuid-1"  # upstream: list label never matches

    def test_bad_labels(self):
        with pytest.raises(DataError, match="code_run"):
            ib.official_label("code_run", ["fourteen"])
        with pytest.raises(DataError, match="unknown InfiniteBench task"):
            ib.official_label("passkey_retrieval", ["1"])
        with pytest.raises(DataError, match="empty"):
            ib.official_label("longbook_qa_eng", [])


# ---- the task -------------------------------------------------------------------------------------------------------
class TestFields:
    def test_yaml_lists_every_field_with_its_default(self):
        cfg = OmegaConf.to_container(OmegaConf.load(CONF_TASK / "infinitebench.yaml"))
        assert cfg.pop("name") == "infinitebench"
        assert set(cfg) == {f.name for f in dataclasses.fields(InfiniteBenchTask)}
        assert InfiniteBenchTask(**cfg) == InfiniteBenchTask()
        assert cfg["datasets"] == list(OFFICIAL_MAX_NEW) == TASKS and cfg["truncate_to"] == 128 * 1024
        assert build_task({"name": "infinitebench"}).chat_template is False  # nothing downloaded to validate

    @pytest.mark.parametrize(
        ("fields", "shown"),
        [
            ({"datasets": ["passkey", "kv_retrival"]}, "kv_retrival"),
            ({"datasets": []}, "[]"),
            ({"datasets": ["passkey", "passkey"]}, "duplicates"),
            ({"chat_template": "no"}, "'no'"),
            ({"truncate_to": 0}, "0"),
            ({"stop_strings": [""]}, "['']"),
        ],
    )
    def test_bad_values(self, fields, shown):
        with pytest.raises(ConfigError) as err:
            InfiniteBenchTask(**fields).validate()
        assert "infinitebench" in str(err.value) and shown in str(err.value)

    def test_max_new_tokens_and_protocol(self):
        assert InfiniteBenchTask().max_new_tokens == 30000
        task = _task(datasets=["passkey", "code_run"])
        assert task.max_new_tokens == 6
        protocol = task.protocol()
        assert "data_dir" not in protocol and protocol["version"] == "1"
        assert protocol["max_new_tokens_per_task"] == {"passkey": 6, "code_run": 5}
        assert protocol["truncate_to"] == 131072 and protocol["chat_template"] is False


class TestSamples:
    def test_all_fixture_rows_in_order(self):
        samples = _task().samples(None)
        counts = {t: len(_rows(t)) for t in TASKS}
        assert [s.meta["dataset"] for s in samples] == [t for t in TASKS for _ in range(counts[t])]
        assert samples[0].id == "passkey/0" and len({s.id for s in samples}) == len(samples)
        for sample in samples:
            assert sample.max_new_tokens == OFFICIAL_MAX_NEW[sample.meta["dataset"]]
            assert sample.assistant_prefix == "" and sample.stop_strings is None

    def test_retrieval_prompts(self):
        row = _rows("passkey")[0]
        assert _first("passkey").prompt == (
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz "
            "you about the important information.\n\n" + row["context"] + "\n\nWhat is the pass key?\n\n"
            "The pass key is")
        row = _rows("kv_retrieval")[0]
        assert _first("kv_retrieval").prompt == ("Extract the value corresponding to the specified key in the JSON "
                                                 "object below.\n\n" + row["context"] + "\n\n" + row["input"])

    def test_book_and_dialogue_prompts(self):
        row = _rows("longbook_choice_eng")[0]
        assert _first("longbook_choice_eng").prompt == (
            "Read the book and answer the question.\n\n" + row["context"] + "\n\nQuestion: What did Jennifer open in "
            "the city?\nA. A library\nB. A bank\nC. A bakery\nD. A school\n\nThe letter of the correct answer is")
        row = _rows("longbook_qa_chn")[0]
        assert _first("longbook_qa_chn").prompt == ("阅读以下书籍然后回答问题。\n\n" + row["context"]
                                                    + "\n\n问题：田立帆后来加入了什么？\n答案：")
        row = _rows("longdialogue_qa_eng")[0]
        assert _first("longdialogue_qa_eng").prompt.endswith(
            row["context"] + "\n\nThe name that has been replaced with $$MASK$$ is likely")
        assert _first("longbook_sum_eng").prompt.endswith("\n\nSummary:")

    def test_math_and_code_prompts(self):
        row = _rows("math_find")[0]
        assert _first("math_find").prompt == ("What is the largest number in the following list?\n\n"
                                              + row["context"] + "\n\n" + row["input"])
        assert _first("math_calc").prompt.endswith("Values: [8, 5, 7, 3]\n\nExpression: 35 + 12 - 8\nValues:")
        code_run = _task(datasets=["code_run"]).samples(None)[1]
        assert code_run.prompt.startswith("There is a function called func_2 in the following Python code.\n\n")
        assert code_run.prompt.endswith("\n\nPlease compute the exact value of func_2(-4). The value of func_2(-4) is")
        assert _first("code_debug").prompt.endswith(
            "\n\nOptions:\nA. Configer._set_option\nB. repack_carchive\nC. load_config\nD. main\n\nThe correct "
            "option is:")

    def test_typed_labels(self):
        labels = {s.meta["dataset"]: s.meta["label"] for s in reversed(_task().samples(None))}  # first rows win
        assert labels["passkey"] == "71432" and labels["kv_retrieval"] == "d1ff29be-4e2a-4208-a182-0cea716be3d4"
        assert labels["code_run"] == 14 and type(labels["code_run"]) is int
        assert labels["math_find"] == 88 and labels["math_calc"] == [35, 47, 39]
        assert labels["longbook_choice_eng"] == ["A library", "A"] and labels["code_debug"] == ["repack_carchive", "B"]
        median = _task(datasets=["math_find"]).samples(None)[2]
        assert type(median.meta["label"]) is float and median.answers == ["3.0"]

    def test_chat_mode_moves_the_answer_prefix_into_the_reply(self):
        raw, chat = _first("code_run"), _first("code_run", chat_template=True)
        assert chat.assistant_prefix == "The value of func_1(4) is"
        assert chat.prompt == raw.prompt[: -len(chat.assistant_prefix)].rstrip()
        assert chat.prompt.endswith("Please compute the exact value of func_1(4).")
        assert _first("kv_retrieval", chat_template=True).assistant_prefix == ""  # the question ends the template

    def test_postprocess_keeps_the_generation(self):
        sample = _first("passkey")
        assert _task().postprocess("\n 71432.\n", sample) == "\n 71432.\n"
        assert _task().score("\n 71432.\n", sample) == 1.0


class TestTruncation:
    SPEC = ModelSpec(name="toy", source="tiny-random", context_length=4096, max_input_tokens=1000)

    def test_budget_default_null_and_cap(self):
        sample = _first("passkey")
        assert prompt_token_budget(_task(), self.SPEC, sample) == 4096 - 6  # 131072 capped at the window
        assert prompt_token_budget(_task(truncate_to=None), self.SPEC, sample) == 1000  # the model's value
        assert prompt_token_budget(_task(truncate_to=200), self.SPEC, sample) == 200

    def test_math_calc_longer_than_the_window_is_refused(self):
        with pytest.raises(ConfigError, match=r"math_calc/0.*30000 new tokens.*4096"):
            prompt_token_budget(_task(), self.SPEC, _first("math_calc"))

    def test_middle_truncation_keeps_both_ends(self, tokenizer):
        task = _task(truncate_to=64)
        sample = _first("passkey")
        full = tokenizer.encode(sample.prompt, add_special_tokens=False)
        assert len(full) > 200
        text, templated = render_prompt(task, sample, tokenizer, self.SPEC)
        assert not templated
        expected = tokenizer.decode(full[:32], skip_special_tokens=True) + tokenizer.decode(full[-32:],
                                                                                           skip_special_tokens=True)
        assert text == expected
        assert text.startswith("There is an important info")
        assert text.endswith("What is the pass key?\n\nThe pass key is")


class TestAggregate:
    def test_per_task_percent_and_mean(self):
        records = [{"score": s, "meta": {"dataset": d}} for d, s in
                   [("code_run", 1.0), ("passkey", 1.0), ("passkey", 0.0), ("passkey", 0.0), ("math_calc", 0.25)]]
        out = _task(datasets=["passkey", "math_calc", "code_run"]).aggregate(records)
        assert out["datasets"] == {"passkey": 33.33, "math_calc": 25.0, "code_run": 100.0}  # task order
        assert out["official_mean"]["passkey"] == pytest.approx(1 / 3)
        assert out["counts"] == {"passkey": 3, "math_calc": 1, "code_run": 1} and out["n"] == 5
        assert out["score"] == round((33.33 + 25.0 + 100.0) / 3, 2) == 52.78

    def test_score_records_matches_the_task(self):
        task = _task(datasets=["passkey", "code_debug", "math_find"])
        samples = task.samples(None)
        predictions = ["71432", "1", "0", "B. repack", "It is: C", "88.5", "1", "3"]
        records = [{"score": task.score(p, s), "meta": s.meta} for p, s in zip(predictions, samples, strict=True)]
        out = task.aggregate(records)
        assert out["datasets"] == {"passkey": 33.33, "code_debug": 100.0, "math_find": 66.67}
        cli_records = [{"dataset": s.meta["dataset"], "prediction": p, "answers": s.answers,
                        "options": s.meta["options"]} for p, s in zip(predictions, samples, strict=True)]
        assert score_records(cli_records) == out  # stringified answers give back the typed labels


# ---- data files and the hub download --------------------------------------------------------------------------------
class TestData:
    def test_data_dir_missing(self, tmp_path):
        with pytest.raises(DataError, match=r"data_dir=.*nowhere.*not a directory"):
            InfiniteBenchTask(data_dir=str(tmp_path / "nowhere")).validate()

    def test_missing_files_are_all_named(self, tmp_path):
        (tmp_path / "passkey.jsonl").write_text((FIXTURES / "passkey.jsonl").read_text())
        with pytest.raises(DataError) as err:
            InfiniteBenchTask(data_dir=str(tmp_path), datasets=["passkey", "code_run", "math_find"]).validate()
        message = str(err.value)
        assert "code_run.jsonl" in message and "math_find.jsonl" in message and "passkey.jsonl" not in message

    def test_malformed_rows_name_the_line(self, tmp_path):
        good = (FIXTURES / "passkey.jsonl").read_text()
        (tmp_path / "passkey.jsonl").write_text(good + '{"context": "c", "input": "q"}\n')
        with pytest.raises(DataError, match=r"line 4 has no field\(s\) answer"):
            InfiniteBenchTask(data_dir=str(tmp_path), datasets=["passkey"]).samples(None)
        (tmp_path / "code_debug.jsonl").write_text('{"context": "c", "input": "", "answer": ["f"], "options": []}\n')
        with pytest.raises(DataError, match=r"line 1 needs 4 'options'"):
            InfiniteBenchTask(data_dir=str(tmp_path), datasets=["code_debug"]).samples(None)
        (tmp_path / "code_run.jsonl").write_text('{"context": "c", "input": "What is 3?", "answer": [3]}\n')
        with pytest.raises(DataError, match=r"code_run.jsonl line 1: code_run: no func_"):
            InfiniteBenchTask(data_dir=str(tmp_path), datasets=["code_run"]).samples(None)

    def test_offline_download_is_one_clear_line(self, monkeypatch):
        import huggingface_hub

        calls = []

        def offline(**kwargs):
            calls.append(kwargs)
            assert {k: kwargs[k] for k in ("repo_id", "filename", "repo_type")} == {
                "repo_id": "xinrongzhang2022/InfiniteBench", "filename": "passkey.jsonl", "repo_type": "dataset"}
            raise OSError("We couldn't connect to 'https://huggingface.co'\nto load this file.")

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
        monkeypatch.setattr("kvbench.hub.hub_unreachable", lambda: None)  # reachable, the download itself fails
        task = InfiniteBenchTask(datasets=["passkey"])
        task.validate()  # nothing is downloaded before the model loads
        with pytest.raises(DataError) as err:
            task.prepare_data()
        message = str(err.value)
        assert "\n" not in message and "task.data_dir" in message and "xinrongzhang2022/InfiniteBench" in message
        assert [c.get("local_files_only", False) for c in calls] == [True, False]  # the cache first

    def test_unreachable_hub_is_one_line_without_a_network_call(self, monkeypatch):
        from helpers import UNREACHABLE, hub_without_network

        network = hub_without_network(monkeypatch)
        task = InfiniteBenchTask(datasets=["passkey"])
        task.validate()
        with pytest.raises(DataError) as err:
            task.prepare_data()
        assert str(err.value) == (
            "task 'infinitebench': could not download passkey.jsonl of the hub dataset xinrongzhang2022/InfiniteBench "
            f"({UNREACHABLE}); download the official files (InfiniteBench scripts/download_dataset.sh) and set "
            "task.data_dir=<directory with the .jsonl files>")
        assert network == []  # refused before huggingface_hub's retries

    def test_download_reads_the_hub_cache_file(self, monkeypatch):
        import huggingface_hub

        calls = []
        monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                            lambda **kw: calls.append(kw["filename"]) or str(FIXTURES / kw["filename"]))
        samples = InfiniteBenchTask(datasets=["code_run", "passkey"]).samples(None)
        assert calls == ["code_run.jsonl", "passkey.jsonl"] and len(samples) == 5  # found in the cache


# ---- the real model -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_fixture_run(tmp_path):
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path / "results")}
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", "task=infinitebench", "method=fullkv",
                           f"task.data_dir={FIXTURES}", "limit=3"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (job,) = (tmp_path / "results" / "runs").glob("smollm2-135m/infinitebench/fullkv/*/*")
    records = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["passkey/0", "passkey/1", "passkey/2"]
    assert all(r["new_tokens"] <= 6 for r in records)
    scores = json.loads((job / "scores.json").read_text())
    assert scores["n_samples"] == 3 and scores["datasets"]["passkey"] == scores["score"]
    assert scores["score"] == round(100 * sum(r["score"] for r in records) / 3, 2)
