"""Prompt encoding: middle truncation of the raw prompt, then chat template on/off, assistant prefix placement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.models.spec import ModelSpec
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.encoding import (
    cut_at_stop,
    decode_prediction,
    encode_sample,
    middle_truncate,
    prompt_token_budget,
    render_prompt,
)


@dataclass
class ToyTask(Task):
    name: ClassVar[str] = "toy"
    max_new_tokens: int = 10
    chat_template: bool = False
    stop_strings: list[str] = field(default_factory=list)
    truncate_to: int | None = None

    def samples(self, tokenizer: Any) -> list[Sample]:
        return []

    def score(self, prediction: str, sample: Sample) -> float:
        return 0.0


class BosTokenizer:
    """Whitespace tokenizer that prepends BOS (id 1) by default, like Llama's; no chat template."""

    chat_template = None

    def __init__(self):
        self.vocab: dict[str, int] = {"<s>": 1}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.vocab.setdefault(word, len(self.vocab) + 1) for word in text.split()]
        return [1, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        words = {v: k for k, v in self.vocab.items()}
        return "".join(words[i] + " " for i in ids if not (skip_special_tokens and i == 1))


SPEC = ModelSpec(name="smollm2-135m", source="embedded", context_length=8192, chat_template=True)
LONG = " ".join(f"w{i}" for i in range(1000))


class TestBudget:
    def test_precedence(self):
        spec = ModelSpec(name="m", context_length=4096, max_input_tokens=3500)
        assert prompt_token_budget(ToyTask(truncate_to=1200), spec) == 1200
        assert prompt_token_budget(ToyTask(), spec) == 3500  # LongBench model2maxlen is a prompt budget already
        assert prompt_token_budget(ToyTask(max_new_tokens=96), ModelSpec(name="m", context_length=4096)) == 4000
        # an explicit budget never lets prompt + answer overflow the window
        assert prompt_token_budget(ToyTask(max_new_tokens=30), ModelSpec(name="m", context_length=8192,
                                                                         max_input_tokens=8192)) == 8162
        assert prompt_token_budget(ToyTask(truncate_to=9000, max_new_tokens=10), spec) == 4086


class TestMiddleTruncate:
    def test_short_text_unchanged(self, tokenizer):
        assert middle_truncate("Hello world.", tokenizer, 100) == "Hello world."

    def test_keeps_head_and_tail(self):
        tok = BosTokenizer()
        out = middle_truncate(LONG, tok, 100)
        words = out.split()
        assert words[:50] == [f"w{i}" for i in range(50)]
        assert words[50:] == [f"w{i}" for i in range(950, 1000)]
        assert len(tok.encode(out, add_special_tokens=False)) == 100  # BOS not counted, not kept

    def test_real_tokenizer(self, tokenizer):
        text = "START " + "The grass is green. " * 400 + "END"
        out = middle_truncate(text, tokenizer, 301)
        assert out.startswith("START The grass") and out.endswith("is green. END")
        assert len(tokenizer.encode(out, add_special_tokens=False)) <= 302  # 150 + 150, re-encoded


class TestEncodeSample:
    def test_raw_uses_default_special_tokens(self):
        tok = BosTokenizer()
        sample = Sample(id="a", prompt="what is it ?", answers=["x"], assistant_prefix=" It is")
        ids = encode_sample(ToyTask(), sample, tok, SPEC)
        assert ids == tok.encode("what is it ? It is") and ids[0] == 1

    def test_raw_smollm2(self, tokenizer):
        sample = Sample(id="a", prompt="Question: what?\n\n", answers=["x"], assistant_prefix="The pass key is")
        ids = encode_sample(ToyTask(), sample, tokenizer, SPEC)
        assert ids == tokenizer.encode("Question: what?\n\nThe pass key is")
        assert tokenizer.decode(ids) == "Question: what?\n\nThe pass key is"

    def test_chat_template_with_default_system(self, tokenizer):
        sample = Sample(id="a", prompt="What is the pass key?", answers=["x"], assistant_prefix="The pass key is")
        text, templated = render_prompt(ToyTask(chat_template=True), sample, tokenizer, SPEC)
        assert templated
        assert text == (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is"
        )
        ids = encode_sample(ToyTask(chat_template=True), sample, tokenizer, SPEC)
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3

    def test_chat_template_with_system(self, tokenizer):
        sample = Sample(id="a", prompt="Q?", answers=["x"], system="You are a helpful assistant. ", assistant_prefix="")
        text, _ = render_prompt(ToyTask(chat_template=True), sample, tokenizer, SPEC)
        assert text == (
            "<|im_start|>system\nYou are a helpful assistant. <|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )

    def test_chat_template_off_in_model_spec_or_tokenizer(self, tokenizer):
        sample = Sample(id="a", prompt="Q?", answers=["x"], system="S", assistant_prefix=" A")
        no_chat_spec = ModelSpec(name="base", context_length=8192, chat_template=False)
        assert render_prompt(ToyTask(chat_template=True), sample, tokenizer, no_chat_spec) == ("Q? A", False)
        assert render_prompt(ToyTask(chat_template=True), sample, BosTokenizer(), SPEC) == ("Q? A", False)
        assert render_prompt(ToyTask(chat_template=False), sample, tokenizer, SPEC) == ("Q? A", False)

    def test_truncation_happens_before_the_template(self, tokenizer):
        prompt = "HEAD " + "The grass is green. " * 600 + "What is the pass key?"
        sample = Sample(id="a", prompt=prompt, answers=["x"], assistant_prefix="The pass key is")
        task = ToyTask(chat_template=True, truncate_to=400)
        text, _ = render_prompt(task, sample, tokenizer, SPEC)
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        assert user.startswith("HEAD The grass") and user.endswith("What is the pass key?")
        assert len(tokenizer.encode(user, add_special_tokens=False)) <= 401
        assert text.endswith("<|im_start|>assistant\nThe pass key is")  # prefix kept whole, after the header
        ids = encode_sample(task, sample, tokenizer, SPEC)
        assert 400 < len(ids) < 460  # the template and prefix come on top of the budget

    def test_context_length_fallback_reserves_new_tokens(self, tokenizer):
        spec = ModelSpec(name="small", context_length=300, chat_template=False)
        sample = Sample(id="a", prompt="The grass is green. " * 200, answers=["x"])
        ids = encode_sample(ToyTask(max_new_tokens=50), sample, tokenizer, spec)
        assert len(ids) <= 251


class TestDecodePrediction:
    def test_cut_at_first_stop(self):
        assert cut_at_stop("abc\ndef", ["\n"]) == "abc"
        assert cut_at_stop("a.b\nc", ["\n", "."]) == "a"
        assert cut_at_stop("abc", []) == "abc"
        assert cut_at_stop("\nabc", ["\n"]) == ""

    def test_skips_special_tokens_and_stops(self, tokenizer):
        ids = tokenizer.encode(" eat a sandwich.\nMore text", add_special_tokens=False)
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        assert decode_prediction(ToyTask(stop_strings=["\n"]), ids, tokenizer) == " eat a sandwich."
        assert decode_prediction(ToyTask(), ids, tokenizer) == " eat a sandwich.\nMore text"
