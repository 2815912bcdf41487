"""Sample generators of needle, passkey and 2stageretr on the SmolLM2 tokenizer: deterministic, sized, placed.

No model forward passes: these check prompts, lengths, needle placement, scoring and aggregation.
"""

from __future__ import annotations

import ast
import random
import re

import pytest

from kvbench.errors import ConfigError
from kvbench.tasks import build_task
from kvbench.tasks.needle.task import NEEDLE, PROMPT, haystack_files, insert_needle, period_token_ids
from kvbench.tasks.passkey.task import ANSWER_PREFIX, NOISE, TEMPLATE
from kvbench.tasks.twostage_retr.task import (
    COLORS,
    COT_SENTENCE,
    DIRECT_PREFIX,
    DIRECT_SENTENCE,
    LLAMA_COT_PREFIX,
    YI_COT_HEAD,
    YI_COT_PREFIX,
    make_one,
)


def _records(task, samples, predictions):
    return [
        {"id": s.id, "meta": s.meta, "score": task.score(task.postprocess(p, s), s)}
        for s, p in zip(samples, predictions)
    ]


# ---------------------------------------------------------------- needle


class TestNeedle:
    def test_haystack_is_the_sorted_wheel_essays(self):
        files = haystack_files()
        assert len(files) == 49
        assert [f.name for f in files] == sorted(f.name for f in files)
        assert files[0].name == "addiction.txt"

    def test_period_tokens_from_vocab(self, tokenizer):
        ids = period_token_ids(tokenizer)
        assert ids == {30, 1673}  # "." and "Ġ."
        assert {tokenizer.decode([i]).strip() for i in ids} == {"."}

    def test_insert_needle_walks_back_to_a_period(self):
        periods = {0}
        context = [5, 0, 6, 7, 0, 8, 9, 10, 11, 12]  # periods after index 1 and 4
        ids, at = insert_needle(context, [99], 70, periods)  # int(10 * 0.7) = 7 -> back to 5
        assert at == 5 and ids == [5, 0, 6, 7, 0, 99, 8, 9, 10, 11, 12]
        assert insert_needle(context, [99], 0, periods) == ([99, *context], 0)
        assert insert_needle(context, [99], 100, periods) == ([*context, 99], 10)
        assert insert_needle([5, 6, 7], [99], 90, periods) == ([99, 5, 6, 7], 0)  # no period: start

    def test_grid_ids_and_determinism(self, tokenizer):
        task = build_task({"name": "needle"})
        samples = task.samples(tokenizer)
        depths = [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
        assert [s.id for s in samples] == [f"L{n}_D{d}" for n in (1000, 1500, 2000) for d in depths]
        again = build_task({"name": "needle"}).samples(tokenizer)
        assert [s.prompt for s in samples] == [s.prompt for s in again]
        assert all(s.answers == [NEEDLE.strip()] for s in samples)

    def test_lengths_and_placement(self, tokenizer):
        task = build_task({"name": "needle", "context_lengths": [1000, 2000], "depths": [0, 25, 50, 90, 100]})
        periods = period_token_ids(tokenizer)
        needle_ids = tokenizer.encode(NEEDLE, add_special_tokens=False)
        template_tokens = len(tokenizer.encode(PROMPT.format(context="", question=task.question)))
        for sample in task.samples(tokenizer):
            length, depth = sample.meta["context_length"], sample.meta["depth"]
            # haystack + needle = context_length - buffer exactly; the prompt adds only the template around it.
            assert sample.meta["haystack_tokens"] + len(needle_ids) == length - 200
            prompt_tokens = len(tokenizer.encode(sample.prompt))
            assert abs(prompt_tokens - (length - 200 + template_tokens)) <= 4
            # the needle sits right after a period, at or just before the requested depth
            context = sample.prompt.split("<book> ", 1)[1].rsplit(" </book>", 1)[0]
            before, _, _ = context.partition(NEEDLE)
            assert NEEDLE in context
            before_tokens = len(tokenizer.encode(before, add_special_tokens=False))
            assert before_tokens == sample.meta["needle_token_index"]
            target = int(sample.meta["haystack_tokens"] * depth / 100)
            if depth in (0, 100):
                assert before_tokens == target
            else:
                assert 0 < target - before_tokens < 120  # walked back to the previous sentence end
                assert tokenizer.encode(before, add_special_tokens=False)[-1] in periods

    def test_prompt_text_raw_and_chat(self, tokenizer):
        raw = build_task({"name": "needle", "context_lengths": [1000], "depths": [50]}).samples(tokenizer)[0]
        assert raw.prompt.startswith("<|im_start|> This is a very long story book: <book> July 2010What hard")
        assert raw.prompt.endswith(
            " </book>.\n Based on the content of the book, Question: The best thing to do in San Francisco is: \n"
            "Answer:"
        )
        assert raw.assistant_prefix == "" and raw.system is None
        chat = build_task({"name": "needle", "context_lengths": [1000], "depths": [50], "chat_template": True})
        sample = chat.samples(tokenizer)[0]
        assert sample.prompt == raw.prompt.removeprefix("<|im_start|> ")

    def test_score_and_grid(self, tokenizer):
        task = build_task({"name": "needle", "context_lengths": [1000, 1500], "depths": [0, 50]})
        samples = task.samples(tokenizer)
        predictions = [f" {NEEDLE.strip()}\n", "eat a sandwich", "", "nothing relevant"]
        records = _records(task, samples, predictions)
        assert [r["score"] for r in records] == pytest.approx([10.0, 2.5, 0.0, 0.0])
        agg = task.aggregate(records)
        assert agg["n"] == 4 and agg["score"] == pytest.approx(3.125)
        assert agg["grid"] == {"1000": {"0": 10.0, "50": 2.5}, "1500": {"0": 0.0, "50": 0.0}}


# ---------------------------------------------------------------- passkey


class TestPasskey:
    def test_grid_and_determinism(self, tokenizer):
        task = build_task({"name": "passkey"})
        samples = task.samples(tokenizer)
        assert len(samples) == 3 * 11
        assert samples[0].id == "L1000_D0_R0" and samples[-1].id == "L2000_D100_R0"
        again = build_task({"name": "passkey"}).samples(tokenizer)
        assert [(s.prompt, s.answers) for s in samples] == [(s.prompt, s.answers) for s in again]
        keys = [s.answers[0] for s in samples]
        assert all(re.fullmatch(r"[0-9]{5}", k) for k in keys)
        assert len(set(keys)) > 25  # random keys, not one repeated
        other = build_task({"name": "passkey", "seed": 7}).samples(tokenizer)
        assert [s.answers for s in other] != [s.answers for s in samples]

    def test_a_cell_keeps_its_key_whatever_the_grid(self, tokenizer):
        full = {s.id: s.answers[0] for s in build_task({"name": "passkey"}).samples(tokenizer)}
        one = build_task({"name": "passkey", "context_lengths": [1500], "depths": [50]}).samples(tokenizer)
        assert one[0].answers[0] == full["L1500_D50_R0"]

    def test_raw_prompt_is_the_infinitebench_template(self, tokenizer):
        sample = build_task({"name": "passkey", "chat_template": False, "context_lengths": [500]}).samples(tokenizer)[5]
        text = sample.prompt + sample.assistant_prefix
        key = sample.answers[0]
        units = sample.meta["noise_units"]
        before = sample.meta["needle_unit_index"]
        context = NOISE * before + f"The pass key is {key}. Remember it. {key} is the pass key.\n"
        context += NOISE * (units - before)
        assert text == TEMPLATE.format(context=context, input="What is the pass key?")
        assert text.endswith("\n\nWhat is the pass key?\n\nThe pass key is")
        assert sample.assistant_prefix == ANSWER_PREFIX

    def test_chat_prompt_ends_at_the_question(self, tokenizer):
        cfg = {"name": "passkey", "context_lengths": [500], "depths": [50], "chat_template": True}
        sample = build_task(cfg).samples(tokenizer)[0]
        assert sample.prompt.endswith("\n\nWhat is the pass key?")
        assert sample.assistant_prefix == "The pass key is"

    @pytest.mark.parametrize("length", [300, 1000, 2000, 4096])
    def test_lengths_fit_within_one_noise_unit(self, tokenizer, length):
        unit = len(tokenizer.encode(NOISE, add_special_tokens=False))
        task = build_task({"name": "passkey", "context_lengths": [length], "depths": [0, 50, 100]})
        for sample in task.samples(tokenizer):
            tokens = len(tokenizer.encode(sample.prompt + sample.assistant_prefix))
            assert tokens == sample.meta["raw_prompt_tokens"]
            assert length - unit < tokens <= length

    def test_length_shorter_than_the_template_is_rejected(self, tokenizer):
        with pytest.raises(ConfigError, match=r"context_lengths 64 .*without any haystack"):
            build_task({"name": "passkey", "context_lengths": [64]}).samples(tokenizer)

    def test_depth_placement(self, tokenizer):
        task = build_task({"name": "passkey", "context_lengths": [2000], "depths": [0, 10, 50, 90, 100]})
        for sample in task.samples(tokenizer):
            key = sample.answers[0]
            needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
            rest = sample.prompt.partition("\n\n")[2]
            context = rest.rsplit("\n\nWhat is the pass key?", 1)[0]
            before, found, after = context.partition(needle)
            assert found and before.count(NOISE) == sample.meta["needle_unit_index"]
            fraction = before.count(NOISE) / (before.count(NOISE) + after.count(NOISE))
            assert fraction == pytest.approx(sample.meta["depth"] / 100, abs=0.02)

    def test_score_and_grid(self, tokenizer):
        task = build_task({"name": "passkey", "context_lengths": [500, 800], "depths": [10, 90]})
        samples = task.samples(tokenizer)
        keys = [s.answers[0] for s in samples]
        predictions = [f" {keys[0]}.", f" {keys[1]}", "the pass key.", f"{keys[3][:4]}"]
        records = _records(task, samples, predictions)
        assert [r["score"] for r in records] == [1.0, 1.0, 0.0, 0.0]
        agg = task.aggregate(records)
        grid = {"500": {"10": 100.0, "90": 100.0}, "800": {"10": 0.0, "90": 0.0}}
        assert agg == {"score": 50.0, "n": 4, "grid": grid}


# ---------------------------------------------------------------- 2stageretr


class TestTwoStageRetr:
    def test_make_one_matches_omnikv(self):
        rng = random.Random(3)
        prompt, answer, meta = make_one(rng, 40)
        assert prompt.startswith(
            "Let's play a game. You have a dict and a mathematical addition equation. The keys of a dictionary can "
            "be any number. You need to find the corresponding key value in the dictionary after performing the "
            "addition and output the value corresponding to that key. The Dict is {0: '"
        )
        dict_text = prompt.split(" The Dict is ", 1)[1].split("\n", 1)[0]
        d = ast.literal_eval(dict_text)
        assert list(d) == list(range(40)) and set(d.values()) <= set(COLORS)
        assert f"\nThe equation is {meta['num_a']} + {meta['num_b']} = ?\n" in prompt
        assert prompt.endswith("\n" + COT_SENTENCE)
        assert meta["num_a"] + meta["num_b"] == meta["key"] and d[meta["key"]] == answer
        # the same random calls in the same order as OmniKV's make_one
        ref = random.Random(3)
        ref_dict = {i: ref.choice(list(COLORS)) for i in range(40)}
        final = ref.randint(0, 39)
        assert (ref_dict, final, ref.randint(0, final)) == (d, meta["key"], meta["num_a"])

    def test_samples_default(self, tokenizer):
        task = build_task({"name": "2stageretr"})
        samples = task.samples(tokenizer)
        assert len(samples) == 100 and len(COLORS) == 23
        assert [s.meta["dict_len"] for s in samples[:11]] == [40, 50, 60, 70, 80, 90, 100, 140, 180, 200, 40]
        assert samples[0].id == "S000_N40" and samples[-1].id == "S099_N200"
        again = build_task({"name": "2stageretr"}).samples(tokenizer)
        assert [(s.prompt, s.answers) for s in samples] == [(s.prompt, s.answers) for s in again]
        other = build_task({"name": "2stageretr", "seed": 1}).samples(tokenizer)
        assert [s.prompt for s in other] != [s.prompt for s in samples]
        cot = samples[0]
        assert cot.system == "You are a helpful assistant. " and cot.assistant_prefix == LLAMA_COT_PREFIX
        assert cot.prompt.endswith(COT_SENTENCE)

    def test_direct_mode(self, tokenizer):
        sample = build_task({"name": "2stageretr", "cot": False, "num_samples": 1}).samples(tokenizer)[0]
        assert COT_SENTENCE not in sample.prompt and sample.prompt.endswith(DIRECT_SENTENCE)
        assert sample.system == "You are a helpful assistant." and sample.assistant_prefix == DIRECT_PREFIX
        assert DIRECT_PREFIX.endswith("The corresponding color is")
        bare = build_task({"name": "2stageretr", "cot": False, "chat_template": False, "num_samples": 1})
        assert bare.samples(tokenizer)[0].assistant_prefix == ""

    def test_yi_template(self, tokenizer):
        task = build_task({"name": "2stageretr", "template": "yi", "chat_template": False, "num_samples": 1})
        sample = task.samples(tokenizer)[0]
        assert sample.prompt.startswith(YI_COT_HEAD) and sample.assistant_prefix == YI_COT_PREFIX
        assert (sample.prompt + sample.assistant_prefix).endswith(
            COT_SENTENCE + "\nEvidence (less than 5 steps) then final answer: Step 1:"
        )

    def test_score_and_aggregate(self, tokenizer):
        task = build_task({"name": "2stageretr", "num_samples": 3, "dict_lengths": [40, 50]})
        samples = task.samples(tokenizer)
        answers = [s.answers[0] for s in samples]
        predictions = [f"The result is 12. The color is {answers[0].upper()}.", "I do not know", f"{answers[2]}"]
        records = _records(task, samples, predictions)
        assert [r["score"] for r in records] == [1.0, 0.0, 1.0]  # no color is a substring of "i do not know"
        agg = task.aggregate(records)
        assert agg["n"] == 3 and agg["score"] == pytest.approx(round(100 * sum(r["score"] for r in records) / 3, 2))
        assert agg["by_dict_len"]["40"] == 100.0
