"""RULER: generators against the official generator's output, sizes, placement, seeding, word lists, scorers.

The golden file ``tests/fixtures/ruler/official_smollm2_base_1024.json`` was written by running NVIDIA/RULER's own
``scripts/data/synthetic/*.py`` (see its ``generated_by``), not by kvbench.
"""

from __future__ import annotations

import hashlib
import json
import random
import urllib.request
from pathlib import Path

import pytest

from kvbench.errors import ConfigError, DataError
from kvbench.metrics.ruler import postprocess_pred, string_match_all, string_match_part
from kvbench.tasks import build_task
from kvbench.tasks.ruler import RULER_TASKS
from kvbench.tasks.ruler.common import GENERATORS, TASK_ARGS
from kvbench.tasks.ruler.niah import AdjectiveNounWords, key_words
from kvbench.tasks.ruler.resources import WORDLIST_DIR, sent_tokenize, wonderwords_list
from kvbench.tasks.ruler.scoring import score_records

FIXTURES = Path(__file__).parent / "fixtures" / "ruler"
GOLDEN = json.loads((FIXTURES / "official_smollm2_base_1024.json").read_text())
ESSAY_TASKS = {t for t, spec in TASK_ARGS.items() if spec["args"].get("type_haystack") == "essay"}


def ruler(**fields):
    return build_task({"name": "ruler", "data_dir": str(FIXTURES), **fields})


@pytest.fixture(scope="module")
def chat_rows(tokenizer):
    task = ruler(context_lengths=[1024], num_samples=2)
    return {t: task.rows(t, 1024, tokenizer) for t in RULER_TASKS}


# ---------------------------------------------------------------- generation


def test_every_task_equals_the_official_generator(tokenizer):
    task = ruler(context_lengths=[1024], num_samples=3, template="base")
    for name, expected in GOLDEN["tasks"].items():
        rows = task.rows(name, 1024, tokenizer)
        got = [{"input_sha256": hashlib.sha256(r["input"].encode()).hexdigest(),
                "outputs": r["outputs"], "length": r["length"], "answer_prefix": r["answer_prefix"]} for r in rows]
        # niah.py overwrites its loop variable `index` with the answer's character offset before writing the row,
        # so the official "index" field is not the sample number; it is not compared.
        assert got == [{k: v for k, v in row.items() if k != "index"} for row in expected], name


def test_length_fits_and_is_counted_on_the_chat_prompt(tokenizer, chat_rows):
    for name, rows in chat_rows.items():
        new_tokens = GENERATORS[TASK_ARGS[name]["task"]]["tokens_to_generate"]
        for row in rows:
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["input"]}], tokenize=False,
                                                 add_generation_prompt=True) + row["answer_prefix"]
            assert row["length"] == len(tokenizer.encode(text, add_special_tokens=False)) + new_tokens, name
            assert row["length"] <= 1024, name
            # RULER steps the haystack down by `incremental` units when a draw overflows: 500 essay words
            # (~650 SmolLM2 tokens), otherwise 5 lines / 10 words or documents / max_len // 32 words.
            assert row["length"] >= (1024 - 800 if name in ESSAY_TASKS else 1024 * 0.8), (name, row["length"])


def test_answers_are_in_the_context(chat_rows):
    squad = json.loads((FIXTURES / "squad.json").read_text())
    hotpot = json.loads((FIXTURES / "hotpotqa.json").read_text())
    for name, rows in chat_rows.items():
        for row in rows:
            if name == "qa_1":  # the gold paragraph is in: at least one reference occurs
                assert any(answer in row["input"] for answer in row["outputs"])
            elif name == "qa_2":  # the gold (supporting) paragraphs are in, titled
                item = next(d for d in hotpot if [d["answer"]] == row["outputs"])
                assert all(f"{title}\n" in row["input"] for title, _ in item["supporting_facts"])
            else:
                assert all(str(answer) in row["input"] for answer in row["outputs"]), name
    assert squad["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["text"] == chat_rows["qa_1"][0]["outputs"][0]


def test_niah_needles_and_templates(chat_rows):
    single = chat_rows["niah_single_1"][0]
    (value,) = single["outputs"]
    assert len(value) == 7 and value.isdigit()
    assert f"is: {value}." in single["input"]
    assert single["input"].startswith("A special magic number is hidden within the following text.")
    assert single["answer_prefix"].startswith(" The special magic number for ") and single["answer_prefix"].endswith(
        "mentioned in the provided text is")
    multi = chat_rows["niah_multivalue"][0]
    assert len(multi["outputs"]) == 4 and multi["answer_prefix"].endswith("text are")
    assert chat_rows["niah_multiquery"][0]["answer_prefix"].count(", and ") == 1
    uuid_key = chat_rows["niah_multikey_3"][0]["answer_prefix"].split(" for ")[1].split(" mentioned")[0]
    assert len(uuid_key) == 36 and uuid_key[14] == "4"  # version-4 UUID
    noise = chat_rows["niah_single_1"][0]["input"]
    assert noise.count("The grass is green. The sky is blue.") > 10


def test_vt_cwe_fwe_structure(chat_rows):
    vt = chat_rows["vt"][0]
    names = vt["outputs"]
    assert len(names) == 5 and all(len(n) == 5 and n.isupper() for n in names)
    assert vt["input"].startswith("Memorize and track")  # the one-shot example first
    assert vt["input"].count("Memorize and track") == 2
    value = vt["input"].split(f"VAR {names[0]} = ")[1].split("\n")[0]
    assert value.isdigit() and len(value) == 5 and f"assigned the value {value}" in vt["answer_prefix"]
    cwe = chat_rows["cwe"][0]
    counts = {w: cwe["input"].split("Question:")[-2].count(f". {w} ") for w in cwe["outputs"]}
    assert len(counts) == 10 and min(counts.values()) >= 5  # < 4096 tokens: 6 repeats (last one may end the list)
    fwe = chat_rows["fwe"][0]
    words = fwe["input"].split("coded words. ")[1].split("\nQuestion")[0].split()
    top = sorted({w for w in words if w != "..."}, key=words.count, reverse=True)[:3]
    assert sorted(top) == sorted(fwe["outputs"])


def test_seeded(tokenizer):
    tasks = ["niah_single_1", "cwe", "vt"]
    one = ruler(context_lengths=[1024], num_samples=1, tasks=tasks)
    same = ruler(context_lengths=[1024], num_samples=1, tasks=tasks)
    other = ruler(context_lengths=[1024], num_samples=1, tasks=tasks, seed=7)
    first = [(s.id, s.prompt, s.answers) for s in one.samples(tokenizer)]
    assert first == [(s.id, s.prompt, s.answers) for s in same.samples(tokenizer)]
    second = [(s.id, s.prompt, s.answers) for s in other.samples(tokenizer)]
    assert [s[0] for s in first] == [s[0] for s in second]
    assert all(a[1] != b[1] and a[2] != b[2] for a, b in zip(first, second))


def test_samples_are_index_major_with_per_task_protocol(tokenizer):
    task = ruler(context_lengths=[512], num_samples=2, tasks=["niah_single_1", "fwe"])
    samples = task.samples(tokenizer)
    assert [s.id for s in samples] == ["niah_single_1/L512/0", "fwe/L512/0", "niah_single_1/L512/1", "fwe/L512/1"]
    assert [s.max_new_tokens for s in samples[:2]] == [128, 50]
    assert task.max_new_tokens == 128 and task.truncate_to == 512 and task.chat_template
    assert samples[1].meta["metric"] == "string_match_all" and samples[1].assistant_prefix.startswith(" Answer:")


# ---------------------------------------------------------------- word lists and sentences


def test_vendored_wordlists_are_wonderwords_3_0_1_and_2_2_0():
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in WORDLIST_DIR.glob("*.txt")}
    assert digests == {
        "nounlist.txt": "8d88b3ebc2e2969ed92ebe49cdb0c8a87c2ad3b27493d7afdff608f2e51c5bc9",
        "adjectivelist.txt": "66814d46b7e292c83e839d12fe2fa083c8f66779b14b294e1be4e1342c5d4131",
        "verblist.txt": "9fbf5e4e69b8869aebd88e6d545312ff9f878a747327ede5f6dbbba5c27b08ad",
    }
    old = wonderwords_list("nounlist.txt", "2.2.0")
    assert len(set(old)) == 6786  # sha256 below: of "\n".join(sorted(set(...))) of the real 2.2.0 nounlist.txt
    expected = "2ec8c8cdc8837fe0140930466fd29fe2f798bf9e040c4b284503c992cd8ce5ba"
    assert hashlib.sha256("\n".join(sorted(set(old))).encode()).hexdigest() == expected
    assert len(wonderwords_list("nounlist.txt", "3.0.1")) == 6782


def test_adjective_noun_words_equal_sorted_set():
    adjectives = ["high", "high-pitched", "ad hoc", "blue", "blue", "old-fashioned", "old", "x"]
    nouns = ["pitched-tone", "tone", "fashioned-car", "car", "dune buggy", "a", "zebra", "car"]
    expected = sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    words = AdjectiveNounWords(adjectives, nouns)
    assert len(words) == len(expected) < len(adjectives) * len(nouns)  # duplicates: high-pitched-tone, ...
    assert [words[i] for i in range(len(words))] == expected
    assert random.Random(3).choice(words) == random.Random(3).choice(expected)
    # brute force over the real lists (checked once, ~30 s): 6,171,620 and 6,175,260 distinct keys
    assert len(key_words("3.0.1")) == 6171620 and len(key_words("2.2.0")) == 6175260


def test_sentence_splitter_is_punkt_english():
    assert sent_tokenize("Mr. Smith went to Washington. He arrived at 5 p.m. on Monday. It rained.") == [
        "Mr. Smith went to Washington.", "He arrived at 5 p.m. on Monday.", "It rained."]


# ---------------------------------------------------------------- scoring


def test_string_match_all_and_part_hand_computed():
    preds = ["The numbers are 123 and 456.", "only 999", "Nothing"]
    refs = [["123", "456", "789"], ["999"], ["abc", "def"]]
    assert string_match_all(preds, refs) == round((2 / 3 + 1 + 0) / 3 * 100, 2) == 55.56
    assert string_match_part(preds, refs) == round((1 + 1 + 0) / 3 * 100, 2) == 66.67
    # any reference counts for part; lm-eval's copy would give 1/3 for the first sample
    assert string_match_part(["the Broncos won"], [["Denver Broncos", "the Denver Broncos", "Broncos"]]) == 100.0
    assert string_match_all(["the Broncos won"], [["Denver Broncos", "the Denver Broncos", "Broncos"]]) == 33.33
    assert string_match_all(["DENVER broncos"], [["Denver Broncos"]]) == 100.0  # case-insensitive
    assert postprocess_pred("  a\tb\x00c\r\n ") == "a\nb\nc"


def test_score_records_is_the_official_evaluation():
    records = [
        {"dataset": "niah_multivalue", "prediction": " 1, 2\t3", "answers": ["1", "2", "3", "4"]},
        {"dataset": "niah_multivalue", "prediction": "4 3 2 1", "answers": ["1", "2", "3", "4"]},
        {"dataset": "qa_1", "prediction": "Catholic", "answers": ["Catholic orthodoxy", "Catholic"]},
        {"dataset": "qa_1", "prediction": "", "answers": "France"},
    ]
    out = score_records(records)
    assert out["datasets"] == {"niah_multivalue": 87.5, "qa_1": 50.0}
    assert out["average"] == 68.75
    with_lengths = score_records([{**r, "context_length": 4096 if i < 2 else 8192} for i, r in enumerate(records)])
    assert with_lengths["lengths"] == {"4096": {"niah_multivalue": 87.5, "average": 87.5},
                                       "8192": {"qa_1": 50.0, "average": 50.0}}
    with pytest.raises(DataError, match="qa_squad.*valid: niah_single_1"):
        score_records([{"dataset": "qa_squad", "prediction": "x", "answers": ["x"]}])


def test_task_score_and_aggregate(tokenizer):
    task = ruler(context_lengths=[1024], num_samples=1, tasks=["niah_multivalue", "qa_1"])
    samples = task.samples(tokenizer)
    preds = [" ".join(samples[0].answers[:3]) + "\x01", samples[1].answers[0].upper()]
    records = [{"id": s.id, "meta": s.meta, "score": task.score(task.postprocess(p, s), s)}
               for s, p in zip(samples, preds)]
    assert [r["score"] for r in records] == [0.75, 1.0]
    out = task.aggregate(records + [{**records[0], "meta": {**records[0]["meta"], "context_length": 2048}}])
    assert out["datasets"] == {"niah_multivalue": 75.0, "qa_1": 100.0}
    assert out["lengths"] == {"1024": {"niah_multivalue": 75.0, "qa_1": 100.0, "average": 87.5},
                              "2048": {"niah_multivalue": 75.0, "average": 75.0}}
    assert out["score"] == 81.25 and out["average"] == 87.5


# ---------------------------------------------------------------- config and data


def test_bad_config_fails_before_any_model():
    with pytest.raises(ConfigError, match="niah_single_9.*valid: niah_single_1"):
        ruler(tasks=["niah_single_9"])
    with pytest.raises(ConfigError, match="template must be a string.*meta-llama3"):
        ruler(template="llama")
    with pytest.raises(ConfigError, match="wonderwords"):
        ruler(wonderwords="2.0")
    with pytest.raises(ConfigError, match="context_lengths"):
        ruler(context_lengths=[100])
    with pytest.raises(DataError, match="task.data_dir=.*hotpotqa.json"):
        build_task({"name": "ruler", "tasks": ["qa_2"], "data_dir": str(FIXTURES.parent)})


def test_qa_offline_names_data_dir_and_others_need_no_data(tmp_path, monkeypatch, tokenizer):
    from kvbench.tasks.ruler import qa

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    qa.load.cache_clear()
    task = build_task({"name": "ruler", "context_lengths": [512], "num_samples": 1})
    with pytest.raises(DataError, match="squad.json or dev-v2.0.json.*task.data_dir"):
        task.prepare_data()
    eleven = build_task({"name": "ruler", "context_lengths": [1024], "num_samples": 1,
                         "tasks": [t for t in RULER_TASKS if not t.startswith("qa")]})
    eleven.prepare_data()
    assert len(eleven.samples(tokenizer)) == 11


# ---------------------------------------------------------------- a real run


@pytest.mark.slow
def test_smollm2_ruler_run_completes(tmp_path):
    """``python -m kvbench.run task=ruler`` on SmolLM2 at 1K tokens, one sample of four tasks (one per generator
    family that fits at 1K, QA from the fixtures), with SnapKV at 128."""
    import os
    import subprocess
    import sys

    tasks = "[niah_single_1,vt,fwe,qa_1]"
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvbench.run", "method=snapkv", "budget=128", "task=ruler", f"task.tasks={tasks}",
         "task.context_lengths=[1024]", "task.num_samples=1", f"task.data_dir={FIXTURES}", "limit=4"],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (scores_file,) = tmp_path.glob("runs/smollm2-135m/ruler/snapkv/128/*/scores.json")
    scores = json.loads(scores_file.read_text())
    assert scores["n_samples"] == 4 and set(scores["datasets"]) == {"niah_single_1", "vt", "fwe", "qa_1"}
    assert all(0 <= v <= 100 for v in scores["datasets"].values()) and set(scores["lengths"]) == {"1024"}
    records = [json.loads(line) for line in scores_file.with_name("samples.jsonl").read_text().splitlines()]
    assert all(r["prompt_tokens"] + r["meta"]["max_new_tokens"] <= 1024 + 1 for r in records)  # +1: BOS-free here
