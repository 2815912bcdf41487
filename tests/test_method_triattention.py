"""TriAttention in kvbench's engine: the session's cross-layer hook runs the authors' schedule (resident KV bounded by
budget + divide_length, one kept set per KV head in every layer), on the host-driven path and with the captured decode
step (the layers append inside the graph, the host compresses between blocks of captured steps), and bad input is
refused in one line. Parity with the authors' code: tests/test_parity_triattention_official.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import record_caches, run_job_in, triattention_stats
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.session import SLOT_ROUND
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.models.tiny import build_tiny_llama, resolve_tiny

ROOT = Path(__file__).resolve().parents[1]
SMOL_STATS = "tests/fixtures/triattention/smollm2-135m.pt"


def _tiny(layers=3, heads=4, kv_heads=2, head_dim=16):
    arch = resolve_tiny({"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim})
    return build_tiny_llama(arch, vocab_size=256, context_length=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            attn_implementation="sdpa").eval()


def _generate(model, fields, budget, prompt_len, new_tokens, monkeypatch, compile=False, sampling=None):
    b = Budget.parse(budget)
    method = build_method({"name": "triattention", "stats_path": triattention_stats(model), **fields}, b)
    caches = record_caches(monkeypatch)
    prompt = torch.randint(3, 250, (prompt_len,), generator=torch.Generator().manual_seed(3)).tolist()
    with CompressionSession(model, method, b, compile=compile) as session:
        out = greedy_generate(model, [prompt], new_tokens, [], 0, sampling=sampling,
                              seeds=None if sampling is None else [11])
    return method, session.stats, out, caches[-1]


def test_the_session_runs_the_schedule(monkeypatch):
    """Prompt 40 < budget 48, divide_length 16: the cache grows to 64, is cut to 48 (the 40 prompt entries and 8
    decode entries per KV head, the same in every layer), and so on: resident never above budget + divide_length."""
    model = _tiny()
    method, stats, out, cache = _generate(model, {"divide_length": 16}, 48, 40, 70, monkeypatch)
    curve = dict(stats.resident_curve)
    assert max(curve.values()) <= 48 + 16 - 1 and method.compressions == 3  # entries 64 at steps 24, 40, 56
    assert curve[23] == 63 and curve[24] == 48 and curve[39] == 63 and curve[40] == 48
    positions = [layer.positions[0] for layer in cache.layers]
    assert all(torch.equal(p, positions[0]) for p in positions)  # one kept set per KV head for every layer
    assert not torch.equal(positions[0][0], positions[0][1])  # ... chosen per KV head
    assert positions[0][:, :40].tolist() == [list(range(40))] * 2  # the prompt pinned
    assert cache.layers[0].num_entries == 48 + (out.decode_steps - 56)


def test_interval_trigger_and_prompt_beyond_the_budget(monkeypatch):
    """use_slack_trigger=false: at the budget when the tokens seen are a multiple of divide_length; a prompt of at
    least the budget leaves the first budget entries (the code's compute_keep_indices)."""
    model = _tiny()
    method, stats, _, _ = _generate(model, {"divide_length": 16, "use_slack_trigger": False}, 48, 40, 40, monkeypatch)
    curve = dict(stats.resident_curve)
    # seen 48 (step 8): 48 entries, kept whole; seen 64 (step 24): 64 entries cut to 48; the run ends at step 39
    assert method.compressions == 2 and curve[23] == 63 and curve[24] == 48 and curve[39] == 63
    method, _, out, cache = _generate(model, {"divide_length": 16}, 32, 50, 4, monkeypatch)
    assert method.compressions == 1 and out.decode_steps == 3  # 51 entries at the first step: the prompt's first 32
    assert [layer.positions[0].tolist() for layer in cache.layers] == [[list(range(32)) + [51, 52]] * 2] * 3


def test_stats_of_another_model_are_refused_in_one_line(monkeypatch):
    model = _tiny(layers=3)
    other = _tiny(layers=2)
    b = Budget.parse(48)
    method = build_method({"name": "triattention", "stats_path": triattention_stats(other)}, b)
    with pytest.raises(ConfigError, match=r"stats_path=.* holds statistics of a model with 2 layers, kvbench "
                                          r"compresses 3 layers of this one .*; produce it with the authors' "
                                          r"scripts/calibrate.py"):
        with CompressionSession(model, method, b):
            pass
    wide = _tiny(layers=3, heads=8, kv_heads=2)
    method = build_method({"name": "triattention", "stats_path": triattention_stats(wide)}, b)
    prompt = list(range(3, 43))
    with pytest.raises(ConfigError, match=r"holds statistics of a model with 8 query heads, this model has 4"):
        with CompressionSession(model, method, b):
            greedy_generate(model, [prompt], 2, [], 0)
    dims = _tiny(layers=3, heads=4, kv_heads=2, head_dim=32)
    method = build_method({"name": "triattention", "stats_path": triattention_stats(dims)}, b)
    with pytest.raises(ConfigError, match=r"holds statistics of a model with head_dim 32, this model has 16"):
        with CompressionSession(model, method, b):
            greedy_generate(model, [prompt], 2, [], 0)


@pytest.mark.parametrize(("fields", "budget", "message"), [
    ({}, 128, "stats_path=null; it needs calibrated query statistics"),
    ({"stats_path": "/nonexistent/stats.pt"}, 128, "stats_path='/nonexistent/stats.pt' does not exist; produce it "
                                                   "with the authors' scripts/calibrate.py"),
    ({"stats_path": "conf/method/triattention.yaml"}, 128, "is not a TriAttention statistics file"),
    ({"stats_path": SMOL_STATS}, 0.2, "budget=0.2 is a ratio of the prompt"),
    ({"stats_path": SMOL_STATS, "score_aggregation": "median"}, 128, "score_aggregation='median' is not valid; valid: "
                                                                     "mean, max"),
    ({"stats_path": SMOL_STATS, "divide_length": 0}, 128, "divide_length=0 must be > 0"),
    ({"stats_path": SMOL_STATS, "normalize_scores": "yes"}, 128, "normalize_scores='yes' must be true or false"),
])
def test_bad_fields_are_one_line(fields, budget, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_method({"name": "triattention", **fields}, Budget.parse(budget))


@pytest.mark.parametrize(("args", "message"), [
    (["method=triattention"], "method 'triattention': stats_path=null"),
    (["method=triattention", "method.stats_path=/nonexistent/s.pt"], "stats_path='/nonexistent/s.pt' does not exist"),
    (["method=triattention", f"method.stats_path={SMOL_STATS}", "batch_size=2"], "method 'triattention' is defined "
                                                                                 "per sequence; use batch_size=1"),
])
def test_cli_refuses_before_the_model_loads(tmp_path, args, message, monkeypatch):
    monkeypatch.setenv("KVBENCH_FAULT", "model_load:1")  # reaching the model's load would SIGKILL the process
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path / "results")}
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def _kept(cache) -> list[list[list[int]]]:
    """Per layer, each KV head's kept positions in order (a static layer's valid slots, wherever they are)."""
    out = []
    for layer in cache.layers:
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        out.append([sorted(p[v].tolist()) for p, v in zip(layer.positions[0], valid[0])])
    return out


@pytest.mark.parametrize(("fields", "budget", "prompt_len", "new_tokens", "sampled"), [
    ({"divide_length": 16}, 48, 40, 150, False),  # slack trigger: 8 compressions, at steps 24, 40, ..., 136
    ({"divide_length": 16, "use_slack_trigger": False}, 48, 40, 60, False),  # at the budget, every 16 tokens seen
    ({"divide_length": 16}, 32, 50, 40, False),  # a prompt beyond the budget: the first (host-driven) step compresses
    ({"divide_length": 12}, 40, 30, 70, True),  # sampled (its tasks' temperature 0.6, top-p 0.95): cuts mid-block
])
def test_the_captured_decode_runs_the_schedule_between_its_blocks(fields, budget, prompt_len, new_tokens, sampled,
                                                                    monkeypatch):
    """engine.decode=graph: every layer appends inside the captured step; at the forward the schedule names
    (``after_decode_forward_due``) the host cuts the block of captured steps and compresses every layer as the
    host-driven path does (``_after_forward_captured``). The tokens, the resident curve, the final bytes, the number
    of compressions and each layer's kept positions per KV head are the host-driven path's; the step is one graph for
    the whole generation (its slots sized by the schedule: budget + divide_length), never recompiled."""
    from torch._dynamo.utils import counters

    from kvbench.engine import graph
    from kvbench.engine.sampling import Sampling

    model = _tiny()
    sampling = Sampling(0.6, 0.95, 0) if sampled else None
    eager = _generate(model, fields, budget, prompt_len, new_tokens, monkeypatch, sampling=sampling)
    phases = []
    real = CompressionSession._after_forward_captured
    monkeypatch.setattr(CompressionSession, "_after_forward_captured",
                        lambda self, later: phases.append(self._decode_step) or real(self, later))
    torch._dynamo.reset()
    counters.clear()
    graph.STATUS.clear()
    captured = _generate(model, fields, budget, prompt_len, new_tokens, monkeypatch, compile="eager",
                         sampling=sampling)
    (em, es, eo, ec), (cm, cs, co, cc) = eager, captured
    assert co.tokens == eo.tokens and cs.resident_curve == es.resident_curve
    assert co.resident_kv_bytes_final == eo.resident_kv_bytes_final
    assert cm.compressions == em.compressions >= 2 and len(phases) == cm.compressions
    assert _kept(cc) == _kept(ec)
    if graph.STATUS.get("captured"):  # (torch 2.6 with transformers 5.6 runs the step uncompiled)
        assert counters["stats"]["unique_graphs"] == 1
        # the most a layer holds (budget + divide_length, or the prompt and the first step's token), rounded up to
        # SLOT_ROUND where the budget holds the prompt (a slot count the prompt's length could set)
        need = max(budget + fields["divide_length"], prompt_len + 1)
        assert {layer.keys.shape[2] for layer in cc.layers} == {need + (-need % SLOT_ROUND if budget >= prompt_len
                                                                         else 0)}


@pytest.mark.parametrize("stop_at", [21, 36])
def test_a_generation_ending_before_a_compression_in_the_steps_run_past_it(stop_at):
    """The captured loop reads the chosen ids every 16 steps, so it runs past the step where the row ended (a task's
    stop string here: after 21 or 36 tokens), and the steps past it append and, at step 24 or 40, compress. The
    record is the generation's: the final resident bytes and the resident curve are what the host-driven path holds
    where it stopped (before, the final bytes were what the slots held after the extra steps)."""
    model = _tiny()
    b = Budget.parse(48)
    prompt = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for compile in (False, "eager"):
        method = build_method({"name": "triattention", "stats_path": triattention_stats(model), "divide_length": 16},
                              b)
        with CompressionSession(model, method, b, compile=compile) as session:
            out = greedy_generate(model, [prompt], 100, [], 0, should_stop=lambda row, tokens: len(tokens) >= stop_at)
        runs[compile] = (out, session.stats.resident_curve, method.compressions, session.stats.attended_tokens_mean)
    (eager, eager_curve, eager_n, eager_attended), (captured, captured_curve, captured_n, attended) = \
        runs[False], runs["eager"]
    assert captured.tokens == eager.tokens and len(eager.tokens[0]) == stop_at
    assert captured_curve == eager_curve and eager_curve[-1][0] == stop_at - 1
    assert attended == pytest.approx(eager_attended)
    assert captured.resident_kv_bytes_final == eager.resident_kv_bytes_final
    from kvbench.engine import graph

    if graph.STATUS.get("captured"):  # the extra steps ran, one compression among them
        assert captured.decode_steps > eager.decode_steps and captured_n == eager_n + 1


def test_the_captured_step_is_triattentions_schedule():
    """The captured decode's contract: an appending step (``StaticPolicy()``) and the schedule on host counts."""
    method = build_method({"name": "triattention", "stats_path": SMOL_STATS, "divide_length": 16},
                          Budget.parse(128))
    method.start(100, 128, 9, torch.ones(32))
    assert method.static_policy(256) is not None and method.has_static_step() and method.acts_on_schedule()
    assert [e for e in range(130, 150) if method.after_decode_forward_due(e, e)] == list(range(144, 150))


@pytest.mark.slow
def test_smollm2_math500_resident_kv_is_bounded(tmp_path):
    """The issue's smoke run: SmolLM2-135M on a MATH-500 problem, budget 128, 300 new tokens: the cache grows to
    budget + divide_length = 256 entries, is cut back to 128 (the prompt's 107 entries pinned), and grows again."""
    scores, records = run_job_in(tmp_path, [
        "model=smollm2-135m", "task=math500", "task.data_dir=tests/fixtures/math500", "method=triattention",
        f"method.stats_path={SMOL_STATS}", "budget=128", "limit=1", "task.max_new_tokens=300"])
    record = records[0]
    curve = record["resident_kv_curve"]
    prompt = record["prompt_tokens"]
    assert prompt < 128 and curve[0] == [0, prompt]
    assert max(entries for _, entries in curve) <= 128 + 128 - 1
    assert [256 - prompt - 1, 255] in curve and [256 - prompt, 128] in curve  # cut at the 256th entry
    assert record["decode_steps"] > 256 - prompt


def test_the_job_key_names_the_statistics_by_content(tmp_path):
    """Like POD's block map: the file's name and content hash, not its path; another calibration is another job."""
    import shutil

    b = Budget.parse(128)
    copy = tmp_path / "smollm2-135m.pt"
    shutil.copy(ROOT / SMOL_STATS, copy)
    here = build_method({"name": "triattention", "stats_path": SMOL_STATS}, b).describe()
    there = build_method({"name": "triattention", "stats_path": str(copy)}, b).describe()
    assert here == there and here["stats_path"].startswith("smollm2-135m.pt#sha256:")
    payload = torch.load(copy, weights_only=True)
    payload["stats"]["layer00_head00"]["q_abs_mean"] += 1.0
    torch.save(payload, copy)
    assert build_method({"name": "triattention", "stats_path": str(copy)}, b).describe() != here
