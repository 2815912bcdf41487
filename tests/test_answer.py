"""The job runner's answers to a task's requests (kvbench/jobs/answer.py): a request runs in a fresh session of the
job's method and budget, or with the full cache where it asks for a FullKV pass; its statistics are that session's."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from kvbench.budget import Budget
from kvbench.config import CONF_DIR
from kvbench.engine import CompressionSession, greedy_generate, teacher_forced_logprobs
from kvbench.jobs.answer import EngineAnswerer
from kvbench.methods import build_method
from kvbench.tasks.requests import GenerateUntil, TeacherForced

FULL = Budget("full", float("inf"))
BYTES_PER_TOKEN = 4 * 2 * 16 * 2 * 4  # tiny-random: layers x (K, V) x head_dim x KV heads x float32


@pytest.fixture(scope="module")
def tiny():
    from kvbench.models import load_model, spec_from_config

    return load_model(spec_from_config(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml")))


def _answerer(loaded, method, budget):
    def new_session():
        return CompressionSession(loaded.model, build_method({"name": method}, budget), budget)

    return EngineAnswerer(loaded, new_session, budget)


def test_generate_runs_under_the_job_method_or_with_the_full_cache(tiny):
    prompt = tuple(tiny.tokenizer.encode(" ".join(["The grass is green."] * 8)))
    answerer = _answerer(tiny, "streamingllm", Budget.parse(8))
    compressed = answerer.generate(GenerateUntil((prompt,), 5))
    full = answerer.generate(GenerateUntil((prompt,), 5, full_cache=True))
    assert compressed.stats.resident_kv_bytes == 8 * BYTES_PER_TOKEN
    assert full.stats.resident_kv_bytes == len(prompt) * BYTES_PER_TOKEN
    assert full.stats.layer_entries == [len(prompt)] * 4 != compressed.stats.layer_entries
    with CompressionSession(tiny.model, build_method({"name": "fullkv"}, FULL), FULL):
        direct = greedy_generate(tiny.model, [list(prompt)], 5, tiny.eos_token_ids, tiny.tokenizer.pad_token_id)
    assert full.tokens == direct.tokens and full.stats.decode_steps == direct.decode_steps


def test_loglikelihood_is_the_engines_teacher_forcing_in_the_jobs_session(tiny):
    ids = tuple(tiny.tokenizer.encode(" ".join(["The sky is blue."] * 6)))
    answerer = _answerer(tiny, "streamingllm", Budget.parse(8))
    out = answerer.loglikelihood(TeacherForced(ids, 8, score_from=1))
    budget = Budget.parse(8)
    with CompressionSession(tiny.model, build_method({"name": "streamingllm"}, budget), budget) as session:
        direct = teacher_forced_logprobs(tiny.model, list(ids), 8, score_from=1)
    assert out.logprobs.tolist() == direct.logprobs.tolist() and out.greedy.tolist() == direct.greedy.tolist()
    assert out.stats.resident_kv_bytes == session.stats.resident_kv_bytes_after_prefill == 8 * BYTES_PER_TOKEN
    assert out.stats.decode_steps == direct.decode_steps == len(ids) - 1 - 8
    assert answerer.budget == budget and answerer.tokenizer is tiny.tokenizer and answerer.spec is tiny.spec


def test_stop_strings_end_a_row_on_its_decoded_tail(tiny):
    prompt = tuple(tiny.tokenizer.encode("Question: what colour is the sky?\nAnswer:"))
    answerer = _answerer(tiny, "fullkv", FULL)
    whole = answerer.generate(GenerateUntil((prompt,), 10)).tokens[0]
    text = tiny.tokenizer.decode(whole)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = answerer.generate(GenerateUntil((prompt,), 10, (stop,), stop_tail=16)).tokens[0]
    assert whole[: len(cut)] == cut and stop in tiny.tokenizer.decode(cut)
    assert stop not in tiny.tokenizer.decode(cut[:-1])
