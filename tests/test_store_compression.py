"""kvbench.store.compression: a stored job of a compressing method whose records show it never compressed (the
transformers 5.24 rename ran every method as FullKV under its name) is named, with the transformers version; methods
that keep the prompt resident, or whose budget is unused, are judged by what they do instead."""

from __future__ import annotations

import pytest

from kvbench.store.compression import uncompressed_reason

PROMPT = 300


def meta(method, kind="tokens", value=64, layers=4, transformers="5.24.0"):
    method = method if isinstance(method, dict) else {"name": method}
    label = "full" if kind == "full" else f"{value:g}"
    return {"versions": {"transformers": transformers}, "method": method, "model": {"layers": layers},
            "budget": {"kind": kind, "value": value, "label": label}}


def record(entries, prompt=PROMPT, attended=70.0, resident=4096, sample="s0"):
    """A record as the runner writes it; ``entries``: one number for every layer, or a list."""
    layer_entries = entries if isinstance(entries, list) else [entries] * 4
    return {"id": sample, "prompt_tokens": prompt, "layer_entries": layer_entries, "attended_tokens_mean": attended,
            "resident_kv_bytes": resident}


def test_compressed_runs_are_not_flagged():
    assert uncompressed_reason(meta("snapkv"), [record(64), record(64, sample="s1")]) is None
    assert uncompressed_reason(meta("snapkv", "ratio", 0.2), [record(60)]) is None
    # per-layer allocations: one layer below the prompt is a cache that shrank (PyramidKV, D2O, DynamicKV)
    assert uncompressed_reason(meta("pyramidkv"), [record([PROMPT, PROMPT, 12, PROMPT])]) is None


@pytest.mark.parametrize(("kind", "value"), [("tokens", 64), ("ratio", 0.5)])
def test_a_prefill_method_that_kept_the_whole_prompt_is_flagged(kind, value):
    reason = uncompressed_reason(meta("snapkv", kind, value), [record(PROMPT), record(PROMPT + 5, sample="s1")])
    assert reason is not None and f"snapkv at budget {value:g} kept every prompt token in every layer" in reason
    assert "2 of 2 sample(s)" in reason and reason.endswith("(transformers 5.24.0)")


def test_prompts_within_the_budget_show_nothing():
    assert uncompressed_reason(meta("snapkv", value=512), [record(PROMPT)]) is None
    assert uncompressed_reason(meta("snapkv", value=PROMPT), [record(PROMPT)]) is None  # the budget holds it exactly
    # only the longer prompt counts: it compressed
    assert uncompressed_reason(meta("snapkv", value=200), [record(150, prompt=150), record(200)]) is None


def test_one_uncompressed_record_is_enough():
    """A job killed under the rename and resumed after the fix holds both kinds of records."""
    records = [record(64, sample="new1"), record(PROMPT, sample="old"), record(64, sample="new2")]
    reason = uncompressed_reason(meta("h2o"), records)
    assert reason is not None and "1 of 3 sample(s)" in reason and "e.g. old: 300 prompt tokens" in reason


@pytest.mark.parametrize("empty", [{"layer_entries": []}, {"resident_kv_bytes": 0}])
@pytest.mark.parametrize("method", ["snapkv", "omnikv", {"name": "pod", "n_s": 16, "n_r": 48}, "offload"])
def test_records_without_the_engines_measurements_are_flagged_for_every_method(method, empty):
    records = [record(64, sample="a"), {**record(64, sample="b"), **empty}]
    reason = uncompressed_reason(meta(method, value=128, layers=30, transformers="5.24.1"), records)
    assert reason is not None and "1 of 2 record(s) have no cache measurements" in reason and "e.g. b" in reason
    assert "transformers 5.24.1" in reason


def test_records_of_an_older_format_show_nothing():
    old = {"id": "s0", "prompt_tokens": PROMPT, "score": 1.0}  # no layer_entries, no resident_kv_bytes
    assert uncompressed_reason(meta("snapkv"), [old]) is None


@pytest.mark.parametrize("method", ["omnikv", "quest", "infllm"])
def test_methods_that_keep_the_prompt_resident_are_judged_by_what_they_attend(method):
    layers = 30  # OmniKV's filter layers and Quest's dense layers leave sparse layers on a deep model
    resident = record([PROMPT] * layers, attended=120.0)
    assert uncompressed_reason(meta(method, layers=layers), [resident]) is None
    assert uncompressed_reason(meta(method, layers=layers), [{**resident, "attended_tokens_mean": 0.0}]) is None
    for attended in (PROMPT, PROMPT + 4.5):
        reason = uncompressed_reason(meta(method, layers=layers), [{**resident, "attended_tokens_mean": attended}])
        assert reason is not None and f"{method} at budget 64 attended to the whole prompt or more" in reason


def test_d2o_official_code_evicts_at_decode():
    official = meta({"name": "d2o", "variant": "official_code"})
    assert uncompressed_reason(official, [record(PROMPT, attended=66.0)]) is None
    assert "attended to the whole prompt" in uncompressed_reason(official, [record(PROMPT, attended=PROMPT + 3.0)])
    assert "kept every prompt token" in uncompressed_reason(meta("d2o"), [record(PROMPT, attended=66.0)])


@pytest.mark.parametrize("method", [
    {"name": "pod", "n_s": 16, "n_r": 112, "block_map": "smollm2-135m-layer.json#sha256:cf9cf2061b246ebb"},
    {"name": "pod", "n_s": 16, "n_r": 48},
    "offload",
    "kvmerger",  # a ratio budget with the paper's fixed theta keeps what the data says
])
def test_methods_whose_budget_does_not_bound_the_cache_are_not_flagged(method):
    records = [record(PROMPT, attended=PROMPT + 4.0)]
    assert uncompressed_reason(meta(method, "ratio", 0.5, layers=30), records) is None


def test_fullkv_and_full_budgets_are_not_judged():
    records = [record([])]
    assert uncompressed_reason(meta("fullkv", "full", float("inf")), records) is None
    assert uncompressed_reason(meta("fullkv"), records) is None  # whatever budget the command line named
    assert uncompressed_reason(meta("snapkv", "full", float("inf")), records) is None
    assert uncompressed_reason({}, records) is None  # no meta.json: nothing to judge with


def test_a_method_kvbench_no_longer_has_is_held_to_the_prefill_rule():
    reason = uncompressed_reason(meta("retired_method", transformers=None), [record(PROMPT)])
    assert reason is not None and "kept every prompt token" in reason and "transformers version unknown" in reason
    assert uncompressed_reason(meta("retired_method", value=PROMPT), [record(PROMPT)]) is None
    assert uncompressed_reason(meta("retired_method", "ratio", 0.5), [record(150)]) is None
