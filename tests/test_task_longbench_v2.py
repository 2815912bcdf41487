"""LongBench v2 (kvbench/tasks/longbench_v2) against THUDM/LongBench@2e00731 pred.py and result.py.

The official rules are transcribed here on their own (``official_extract_answer``, ``official_result``) and the
expected prompts are written out by hand from the official template files, so the task's code is checked against
them, not against itself. The fixture (tests/fixtures/longbench_v2/data.json) is four tiny rows in the official
data.json format.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import run_job_in
from kvbench.errors import DataError
from kvbench.models.spec import ModelSpec
from kvbench.tasks import build_task
from kvbench.tasks.encoding import encode_sample, render_prompt
from kvbench.tasks.longbench_v2 import LongBenchV2Task
from kvbench.tasks.longbench_v2.protocol import PROMPTS, truncate_ids
from kvbench.tasks.longbench_v2.scoring import extract_answer, judge, score_records

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "fixtures" / "longbench_v2" / "data.json"
ROWS = json.loads(DATA.read_text(encoding="utf-8"))


# ---- the official rules, transcribed ------------------------------------------------------------------------------
def official_extract_answer(response):  # pred.py extract_answer
    response = response.replace('*', '')
    match = re.search(r'The correct answer is \(([A-D])\)', response)
    if match:
        return match.group(1)
    else:
        match = re.search(r'The correct answer is ([A-D])', response)
        if match:
            return match.group(1)
        else:
            return None


def official_result(pred_data, compensated=False):  # result.py, one file: Overall, Easy, Hard, Short, Medium, Long
    easy, hard, short, medium, long = 0, 0, 0, 0, 0
    easy_acc, hard_acc, short_acc, medium_acc, long_acc = 0, 0, 0, 0, 0
    for pred in pred_data:
        acc = int(pred['judge'])
        if compensated and pred["pred"] is None:
            acc = 0.25
        if pred["difficulty"] == "easy":
            easy += 1
            easy_acc += acc
        else:
            hard += 1
            hard_acc += acc
        if pred['length'] == "short":
            short += 1
            short_acc += acc
        elif pred['length'] == "medium":
            medium += 1
            medium_acc += acc
        else:
            long += 1
            long_acc += acc
    return (round(100 * (easy_acc + hard_acc) / len(pred_data), 1), round(100 * easy_acc / easy, 1),
            round(100 * hard_acc / hard, 1), round(100 * short_acc / short, 1), round(100 * medium_acc / medium, 1),
            round(100 * long_acc / long, 1))


RESPONSES = [
    "The correct answer is (C)",
    "**The correct answer is (C)**",               # markdown bold is removed first
    "The correct answer is C.",                     # the bare form
    "The correct *answer* is (A)",                  # '*' removed: matches
    "The correct answer is A, no wait: The correct answer is (B)",  # the parenthesised form wins wherever it is
    "The correct answer is (B) and The correct answer is (C)",      # the first parenthesised match
    "the correct answer is (C)",                    # case-sensitive: no answer
    "The correct answer is (E)",                    # not A-D: no answer
    "The correct answer is: C",                     # a colon breaks both patterns
    "The correct answer is (c)",                    # lower-case letter: no answer
    "Answer: C",
    "",                                             # an empty response: no answer, wrong
    "The correct answer is Dave",                   # the bare pattern takes the letter D
    "The correct answer is  (A)",                   # two spaces: no answer
]


@pytest.mark.parametrize("response", RESPONSES)
def test_extract_answer_is_pred_pys(response):
    assert extract_answer(response) == official_extract_answer(response)


def test_extract_answer_cases_by_hand():
    assert [extract_answer(r) for r in RESPONSES] == ["C", "C", "C", "A", "B", "B", None, None, None, None, None,
                                                     None, "D", None]


def test_no_extractable_answer_is_wrong_or_compensated():
    assert judge("I cannot tell.", "C") == 0.0 and judge("", "C") == 0.0
    assert judge("I cannot tell.", "C", compensated=True) == 0.25
    assert judge("The correct answer is (A)", "C", compensated=True) == 0.0  # a wrong letter is not compensated
    assert judge("**The correct answer is (C)**", "C") == 1.0


def _preds(responses, rows):
    out = []
    for response, row in zip(responses, rows, strict=True):
        pred = official_extract_answer(response)
        out.append({"pred": pred, "judge": pred == row["answer"], "difficulty": row["difficulty"],
                    "length": row["length"], "answer": row["answer"], "response": response})
    return out


@pytest.mark.parametrize("compensated", [False, True])
def test_scores_are_result_pys(compensated):
    # 8 rows over every difficulty x length, responses right, wrong and without an answer
    rows = [dict(ROWS[i % 4], difficulty=d, length=n) for i, (d, n) in enumerate(
        [("easy", "short"), ("hard", "medium"), ("hard", "long"), ("easy", "long"), ("easy", "medium"),
         ("hard", "short"), ("hard", "long"), ("easy", "short")])]
    responses = ["The correct answer is (C)", "The correct answer is B", "nothing", "The correct answer is (B)",
                 "**The correct answer is (C)**", "", "The correct answer is (D)", "The correct answer is (A)"]
    official = official_result(_preds(responses, rows), compensated)
    records = [{"prediction": p, "answer": r["answer"], "difficulty": r["difficulty"], "length": r["length"]}
               for p, r in zip(responses, rows, strict=True)]
    out = score_records(records, compensated=compensated)
    assert (out["score"], out["difficulty"]["easy"], out["difficulty"]["hard"], out["length"]["short"],
            out["length"]["medium"], out["length"]["long"]) == official
    # the same through the task, and upstream's results files ("response" instead of "prediction")
    task = LongBenchV2Task(data_file=str(DATA), compensated=compensated)
    task_records = [{"score": task.score(p, _sample(task, r)), "prediction": p, "meta": {**r}}
                    for p, r in zip(responses, rows, strict=True)]
    assert {k: v for k, v in task.aggregate(task_records).items() if k != "no_answer"} == out
    assert score_records([{**r, "response": r.pop("prediction")} for r in records], compensated) == out
    if not compensated:  # by hand: right = rows 0, 3, 4, 6 (C, B, C, D); 8 rows
        assert official == (50.0, 75.0, 25.0, 33.3, 50.0, 66.7)


def test_cli_rescores_upstream_results_files(tmp_path, capsys):
    """`python -m kvbench.score --benchmark longbench_v2` on a pred.py results file: the response is `response`
    (its `pred`, the extracted letter, is not read), and the numbers are result.py's."""
    from kvbench.score import main as score_main

    responses = ["The correct answer is (C)", "The correct answer is (B)", "", "The correct answer is D"]
    preds = _preds(responses, ROWS)
    path = tmp_path / "Model.jsonl"
    path.write_text("".join(json.dumps({**r, "_id": row["_id"], "context": row["context"][:1000]}) + "\n"
                            for r, row in zip(preds, ROWS, strict=True)))
    for extra, compensated in (([], False), (["--compensated"], True)):
        assert score_main([str(path), "--benchmark", "longbench_v2", "--out", "-", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["score"], out["difficulty"]["easy"], out["difficulty"]["hard"], out["length"]["short"],
                out["length"]["medium"], out["length"]["long"]) == official_result(preds, compensated)
    assert score_main([str(path), "--benchmark", "longbench", "--compensated"]) == 2
    assert "applies to --benchmark longbench_v2 only" in capsys.readouterr().err


def _sample(task, row):
    return task.make_sample(row["_id"], row)


# ---- prompts --------------------------------------------------------------------------------------------------------
def test_template_files_are_the_official_ones():
    """Byte for byte THUDM/LongBench@2e00731 prompts/ (no trailing newline)."""
    digests = {name: hashlib.sha256((PROMPTS / name).read_bytes()).hexdigest() for name in
               ("0shot.txt", "0shot_cot.txt", "0shot_cot_ans.txt")}
    assert digests == {
        "0shot.txt": "68a162252bc9ff71d5d7abca3d69bb31aac3c35f832d657a2866f2018b8a6950",
        "0shot_cot.txt": "6cc33d92fd8f611662b756c1f10f302c541ca005b58c46d5f3188ac3a939bfe8",
        "0shot_cot_ans.txt": "85ec59df4ac0e27aabbc619a7ca5cf3ae1787dd5a76cf51a18944eb52c91955f",
    }


DOC = ("Revenue report. Q1 revenue was 10 million. Q2 revenue was 12 million. Q3 revenue was 19 million. "
       "Q4 revenue was 15 million. Costs rose every quarter.")
QUESTION_BLOCK = ("What is the correct answer to this question: Which quarter had the highest revenue?\n"
                  "Choices:\n(A) Q1\n(B) Q2\n(C) Q3\n(D) Q4\n\n")


def test_zero_shot_prompt():
    task = LongBenchV2Task(data_file=str(DATA))
    sample = task.samples()[0]
    assert sample.prompt == ("Please read the following text and answer the question below.\n\n<text>\n" + DOC +
                             "\n</text>\n\n" + QUESTION_BLOCK +
                             'Format your response as follows: "The correct answer is (insert answer here)".')
    assert sample.answers == ["C"] and sample.max_new_tokens == 128 and sample.id == "66f36490821e116aacb2cc22"
    assert sample.meta == {"_id": "66f36490821e116aacb2cc22", "domain": "Single-Document QA",
                           "sub_domain": "Financial", "difficulty": "easy", "length": "short", "answer": "C",
                           "cot": False}


def test_cot_two_step_prompts():
    task = LongBenchV2Task(data_file=str(DATA), cot=True)
    sample = task.samples()[0]
    assert sample.prompt == ("Please read the following text and answer the questions below.\n\n<text>\n" + DOC +
                             "\n</text>\n\n" + QUESTION_BLOCK + "Let\u2019s think step by step:")
    assert sample.max_new_tokens == 1024
    cot = "Q3 had 19 million, more than the others."
    second = task.answer_sample(sample, cot)
    assert second.prompt == ("Please read the following text and answer the questions below.\n\n"
                             "The text is too long and omitted here.\n\n" + QUESTION_BLOCK +
                             "Let\u2019s think step by step: " + cot + "\n\n"
                             "Based on the above, what is the single, most likely answer choice? Format your response "
                             'as follows: "The correct answer is (insert answer here)".')
    assert second.max_new_tokens == 128 and second.id == sample.id and "Revenue report" not in second.prompt


def test_placeholders_are_replaced_in_sequence_as_upstream():
    """pred.py chains str.replace: a placeholder inside the document is replaced by the later field too."""
    sample = LongBenchV2Task(data_file=str(DATA)).samples()[2]
    assert "(A note quoting the template: Alice.)" in sample.prompt and "$C_A$" not in sample.prompt


# ---- truncation -----------------------------------------------------------------------------------------------------
def test_truncate_ids_is_query_llms_slice():
    ids = list(range(10))
    for n in (1, 2, 3, 4, 5, 7, 9, 10, 11):
        assert truncate_ids(ids, n) == (ids[:n // 2] + ids[-n // 2:] if len(ids) > n else ids)
    assert truncate_ids(ids, 5) == [0, 1, 7, 8, 9]  # -5//2 == -3: the odd token goes to the end
    assert truncate_ids(ids, 4) == [0, 1, 8, 9]


def test_middle_truncation_counts_special_tokens_and_decodes_once(tokenizer):
    task = LongBenchV2Task(data_file=str(DATA), truncate_to=41, chat_template=False)
    sample = task.samples()[3]
    ids = tokenizer.encode(sample.prompt)  # pred.py: tokenizer.encode(prompt), special tokens as the tokenizer adds
    assert len(ids) > 41
    expected = tokenizer.decode(ids[:20] + ids[-21:], skip_special_tokens=True)
    assert task.truncate_prompt(sample, tokenizer, 41) == expected
    spec = ModelSpec(name="toy", source="tiny-random", context_length=4096, max_input_tokens=4096)
    text, templated = render_prompt(task, sample, tokenizer, spec)
    assert text == expected and not templated
    short = LongBenchV2Task(data_file=str(DATA)).samples()[3]
    assert task.truncate_prompt(short, tokenizer, 10_000) == short.prompt  # within budget: untouched


def test_truncation_budget_default_and_cap():
    from kvbench.tasks.encoding import prompt_token_budget

    task = LongBenchV2Task(data_file=str(DATA))
    sample = task.samples()[0]
    big = ModelSpec(name="big", source="hf", path="x", context_length=131072, max_input_tokens=131072)
    small = ModelSpec(name="small", source="hf", path="x", context_length=8192, max_input_tokens=8192)
    assert prompt_token_budget(task, big, sample) == 120000  # config/model2maxlen.json
    assert prompt_token_budget(task, small, sample) == 8192 - 128
    cot = LongBenchV2Task(data_file=str(DATA), cot=True)
    assert prompt_token_budget(cot, small, cot.samples()[0]) == 8192 - 1024


# ---- data and config ------------------------------------------------------------------------------------------------
def test_local_json_and_jsonl_give_the_same_samples(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    a, b = LongBenchV2Task(data_file=str(DATA)).samples(), LongBenchV2Task(data_file=str(jsonl)).samples()
    assert [(s.id, s.prompt, s.meta) for s in a] == [(s.id, s.prompt, s.meta) for s in b]
    assert [s.meta["difficulty"] for s in a] == ["easy", "hard", "hard", "easy"]


@pytest.mark.parametrize("edit, shown", [
    (lambda rows: rows[0].pop("choice_D"), "no field.*choice_D"),
    (lambda rows: rows[1].update(answer="E"), "answer must be one of A, B, C, D"),
    (lambda rows: rows[2].update(context=None), "context must be strings"),
])
def test_bad_rows_are_one_line(tmp_path, edit, shown):
    rows = json.loads(DATA.read_text())
    edit(rows)
    path = tmp_path / "data.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError, match=shown):
        LongBenchV2Task(data_file=str(path)).validate()


def test_missing_file_and_offline_hub(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="data_file=.*is not a file"):
        LongBenchV2Task(data_file=str(tmp_path / "nope.json")).validate()

    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"THUDM/LongBench-v2 \(split train\).*task.data_file"):
        LongBenchV2Task().prepare_data()


def test_hub_rows_are_read_as_pred_py_reads_them(monkeypatch):
    import datasets

    calls = []

    def fake(repo, split):
        calls.append((repo, split))
        return [dict(r, extra="ignored") for r in ROWS]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    samples = LongBenchV2Task().samples()
    assert calls == [("THUDM/LongBench-v2", "train")] and len(samples) == 4


def test_yaml_is_the_dataclass_defaults():
    cfg = OmegaConf.load(ROOT / "conf" / "task" / "longbench_v2.yaml")
    assert build_task(cfg) == LongBenchV2Task()
    assert LongBenchV2Task().protocol()["source"].startswith("THUDM/LongBench@2e00731")
    assert LongBenchV2Task(cot=True).protocol()["prompts_sha256"] != LongBenchV2Task().protocol()["prompts_sha256"]


# ---- end to end on the tiny random model ----------------------------------------------------------------------------
def test_job_without_cot(tmp_path):
    scores, records = run_job_in(tmp_path, ["model=tiny-random", "method=snapkv", "budget=64", "task=longbench_v2",
                                            f"task.data_file={DATA}", "task.max_new_tokens=4"])
    assert [r["id"] for r in records] == [r["_id"] for r in ROWS]
    assert all(r["new_tokens"] <= 4 and r["score"] == judge(r["prediction"], r["meta"]["answer"]) for r in records)
    expected = score_records([{"prediction": r["prediction"], **{k: r["meta"][k] for k in
                                                                 ("answer", "difficulty", "length")}} for r in records])
    assert {k: scores[k] for k in expected} == expected
    assert score_records(records) == expected  # the job's records as they are (answer, difficulty, length in meta)
    from kvbench.score import main as score_main

    samples = next(tmp_path.rglob("samples.jsonl"))
    assert score_main([str(samples), "--benchmark", "longbench_v2", "--out", str(tmp_path / "s.json")]) == 0
    assert {k: v for k, v in json.loads((tmp_path / "s.json").read_text()).items() if k in expected} == expected


def test_cot_job_runs_both_requests(tmp_path, tokenizer):
    scores, records = run_job_in(tmp_path, ["model=tiny-random", "method=snapkv", "budget=64", "task=longbench_v2",
                                            f"task.data_file={DATA}", "task.cot=true", "task.cot_max_new_tokens=6",
                                            "task.max_new_tokens=3", "limit=2"])
    assert len(records) == scores["n_samples"] == 2
    task = LongBenchV2Task(data_file=str(DATA), cot=True, cot_max_new_tokens=6, max_new_tokens=3)
    samples = {s.id: s for s in task.samples()}
    spec = ModelSpec(name="tiny-random", source="tiny-random", context_length=4096, max_input_tokens=4096)
    for r in records:
        assert r["cot_new_tokens"] <= 6 and r["answer_new_tokens"] <= 3
        assert r["new_tokens"] == r["cot_new_tokens"] + r["answer_new_tokens"]
        assert r["prompt_tokens"] == len(encode_sample(task, samples[r["id"]], tokenizer, spec)) > 64
        second = task.answer_sample(samples[r["id"]], r["cot"])  # the second request holds the first's output
        assert r["answer_prompt_tokens"] == len(encode_sample(task, second, tokenizer, spec))
        assert r["score"] == judge(r["prediction"], r["meta"]["answer"])
        assert 0 < r["resident_kv_bytes"] <= 64 * 4 * 2 * 16 * 2 * 4  # the first request ran compressed


class RecordingAnswerer:
    """The job runner's side of ``Task.evaluate`` with canned replies: it keeps each request it is sent."""

    def __init__(self, tokenizer, spec, replies):
        self.tokenizer, self.spec, self.budget = tokenizer, spec, None
        self.replies, self.requests = list(replies), []

    def generate(self, request):
        from kvbench.tasks.requests import AnswerStats, Generation

        self.requests.append(request)
        tokens = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        k = len(self.requests)  # the second request's statistics differ from the first's
        stats = AnswerStats(prefill_seconds=0.5, decode_seconds=1.0, decode_steps=3 + k, resident_kv_bytes=640 * k,
                            resident_kv_bytes_final=700 * k, layer_entries=[10 * k], attended_tokens_mean=12.3456 * k)
        return Generation(tokens=[tokens] * len(request.prompts), stats=stats)


def test_cot_sends_the_document_under_the_job_method_and_the_answer_as_a_fullkv_pass(tokenizer):
    """The task describes its two requests and never runs the engine: the CoT request (the document) under the
    job's method, the answer request (no document) with the full cache; the record's cache statistics are the first
    request's, its seconds and steps both requests'."""
    task = LongBenchV2Task(data_file=str(DATA), cot=True, cot_max_new_tokens=6, max_new_tokens=3)
    batch = task.samples()[:2]
    spec = ModelSpec(name="tiny-random", source="tiny-random", context_length=4096, max_input_tokens=4096)
    answerer = RecordingAnswerer(tokenizer, spec, [" Q3 had more. ", "The correct answer is (B)"])
    records = task.evaluate(batch, answerer)
    first, second = answerer.requests
    assert first.prompts == tuple(tuple(encode_sample(task, s, tokenizer, spec)) for s in batch)
    assert (first.max_new_tokens, first.full_cache, second.max_new_tokens, second.full_cache) == (6, False, 3, True)
    cot = tokenizer.decode(tokenizer.encode(" Q3 had more. ", add_special_tokens=False)).strip()
    assert second.prompts == tuple(tuple(encode_sample(task, task.answer_sample(s, cot), tokenizer, spec))
                                   for s in batch)
    for r, sample in zip(records, batch):
        assert r["cot"] == cot and r["prediction"] == "The correct answer is (B)"
        assert r["score"] == judge("The correct answer is (B)", sample.meta["answer"])
        assert (r["resident_kv_bytes"], r["resident_kv_bytes_final"], r["layer_entries"]) == (320, 350, [10])
        assert (r["attended_tokens_mean"], r["decode_steps"], r["prefill_seconds"]) == (12.35, 4 + 5, 0.5)
    assert LongBenchV2Task(data_file=str(DATA)).evaluate(batch, answerer) is None  # without CoT the runner generates
