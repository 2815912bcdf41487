"""Sampled decoding (issue #40 item 2): the token choice against transformers' own warpers, the per-row seeds and
streams, the engine's eager and captured steps, the plan's validation and keys, and jobs (n samples per prompt, a
kill and resume, batched rows equal to rows run alone, pass@1 and maj@n recomputed by ``store verify``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from kvbench.budget import Budget
from kvbench.config import CONF_DIR, register_resolvers
from kvbench.engine import CompressionSession, graph, greedy_generate
from kvbench.engine.sampling import RowStreams, Sampling, choose, filter_logits, sample_seed
from kvbench.errors import ConfigError
from kvbench.jobs import plan_job
from kvbench.methods import build_method
from kvbench.store import config_hash
from kvbench.store.scores import record_scores, sampled_scores


def _cfg(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# ---- the choice: transformers' filtering, then an inverse-CDF draw -------------------------------------------------
SETTINGS = [Sampling(0.6, 0.95, 0), Sampling(1.0, 1.0, 20), Sampling(0.7, 0.8, 20), Sampling(1.3, 0.5, 0),
            Sampling(0.2, 0.9, 3), Sampling(1.0, 0.999, 1), Sampling(2.0, 1.0, 0)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: f"t{s.temperature}-p{s.top_p}-k{s.top_k}")
def test_the_filter_keeps_what_transformers_warpers_keep(sampling):
    """Temperature -> top-k -> top-p, as ``generate(do_sample=True)`` orders its warpers: the same kept set and the
    same kept values, on logits with ties (rounded) and without."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    gen = torch.Generator().manual_seed(3)
    for logits in (torch.randn(4, 300, generator=gen) * 3, (torch.randn(4, 300, generator=gen) * 2).round()):
        ours = filter_logits(logits, sampling)
        theirs = warpers(torch.zeros(4, 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        assert torch.equal(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])
        assert bool((~torch.isinf(ours)).any(-1).all())  # at least one token kept per row


def test_the_draw_is_the_inverse_cdf_over_the_kept_tokens():
    """Probabilities 0.1, 0.2, 0.3, 0.4 (vocabulary order): a uniform in [0, 0.1) draws token 0, [0.1, 0.3) token 1,
    and so on; with top_p=0.5 only tokens 2 and 3 remain (0.3/0.7 and 0.4/0.7 of the mass)."""
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(8, 4)
    u = torch.tensor([0.0, 0.099, 0.101, 0.299, 0.301, 0.599, 0.601, 0.9999])
    assert choose(logits, Sampling(1.0), u).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    u2 = torch.tensor([0.0, 0.42, 0.43, 0.9999, 0.2, 0.5, 0.7, 0.1])
    assert choose(logits, Sampling(1.0, top_p=0.5), u2).tolist() == [2, 2, 3, 3, 2, 3, 3, 2]


def test_the_empirical_distribution_follows_the_filtered_probabilities():
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(0.8, 0.9, 8)
    probs = filter_logits(logits, sampling).softmax(-1)[0]
    draws = choose(logits.expand(20000, 12), sampling, RowStreams([7]).next(20000)[0])
    freq = torch.bincount(draws, minlength=12).float() / 20000
    assert float((freq - probs).abs().max()) < 0.015
    assert bool((freq[probs == 0] == 0).all())


def test_seeds_are_pinned_and_depend_on_job_sample_and_index_only():
    # a changed derivation would change every stored sampled result: pinned
    assert sample_seed(42, "L256_D10_R0", 0) == 1177033380373722321
    seeds = {sample_seed(s, i, k) for s in (0, 42) for i in ("a", "b") for k in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2 ** 63 for s in seeds)


def test_a_rows_stream_is_the_same_drawn_one_step_at_a_time_or_in_blocks():
    """The host-driven loop draws one uniform per step, the captured loop a block of them: the same stream."""
    one = RowStreams([5, 9])
    steps = torch.cat([one.next(1) for _ in range(20)], dim=1)
    block = RowStreams([5, 9])
    assert torch.equal(steps, torch.cat([block.next(4), block.next(16)], dim=1))
    assert torch.equal(RowStreams([9]).next(20)[0], steps[1])  # a row's stream is its own, whatever the batch


@pytest.mark.parametrize("bad", [dict(temperature=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(top_k=2.5), dict(n=0), dict(n=True)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match=f"sampling.{next(iter(bad))}="):
        Sampling(**bad)


# ---- the engine: the host-driven and the captured step, batches, seeds ---------------------------------------------
def _prompt(n=200, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(model, name, budget, compile, prompts, seeds, sampling, new=40):
    b = Budget.parse(budget)
    with CompressionSession(model, build_method({"name": name}, b), b, compile=compile):
        return greedy_generate(model, prompts, new, [], 0, None, sampling=sampling, seeds=seeds)


SAMPLED = Sampling(0.8, 0.9, 50)


@pytest.mark.parametrize("method, budget", [("snapkv", 64), ("h2o", 64), ("fullkv", None)])
def test_captured_sampled_tokens_equal_the_host_driven_ones(toy_llama, method, budget):
    """A sampled generation of three left-padded rows (a bucket of four): the captured step, fed each block's
    uniforms, chooses what the host-driven loop chooses step by step (48 steps: across three reads)."""
    prompts = [_prompt(200, 1), _prompt(150, 2), _prompt(180, 3)]
    graph.STATUS.clear()
    eager = _generate(toy_llama, method, budget, False, prompts, [11, 12, 13], SAMPLED, new=48)
    captured = _generate(toy_llama, method, budget, "eager", prompts, [11, 12, 13], SAMPLED, new=48)
    assert "captured" in graph.STATUS  # the captured loop ran (compiled, or the same step uncompiled)
    assert captured.tokens == eager.tokens and all(len(t) == 48 for t in eager.tokens)


def test_sampled_rows_are_reproducible_independent_of_the_batch_and_differ_by_seed(toy_llama):
    prompts = [_prompt(200, 1), _prompt(150, 2)]
    both = _generate(toy_llama, "snapkv", 64, False, prompts, [11, 12], SAMPLED)
    again = _generate(toy_llama, "snapkv", 64, False, prompts, [11, 12], SAMPLED)
    alone = [_generate(toy_llama, "snapkv", 64, False, [p], [s], SAMPLED).tokens[0] for p, s in zip(prompts, [11, 12])]
    assert both.tokens == again.tokens == alone
    other = _generate(toy_llama, "snapkv", 64, False, [prompts[0]] * 3, [11, 21, 31], SAMPLED).tokens
    assert other[0] == both.tokens[0] and len({tuple(t) for t in other}) == 3
    greedy = _generate(toy_llama, "snapkv", 64, False, prompts, None, None)
    assert greedy.tokens != both.tokens


def test_sampling_needs_one_seed_per_row(toy_llama):
    with pytest.raises(ValueError, match="one seed per prompt"):
        _generate(toy_llama, "fullkv", None, False, [_prompt()], None, SAMPLED, new=2)


# ---- the plan: config, validation, keys ----------------------------------------------------------------------------
def test_greedy_jobs_keep_their_key_and_a_sampled_job_has_its_own():
    greedy = plan_job(_cfg("model=tiny-random"))
    assert greedy.sampling is None and "sampling" not in greedy.key
    for same in (("sampling.temperature=0",), ("sampling.temperature=0", "sampling.n=1")):
        assert config_hash(plan_job(_cfg("model=tiny-random", *same)).key) == config_hash(greedy.key)
    sampled = plan_job(_cfg("model=tiny-random", "sampling.temperature=1", "sampling.n=4", "sampling.top_p=0.95"))
    assert sampled.sampling == Sampling(1.0, 0.95, 0, 4)
    assert sampled.key["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "n": 4}
    assert config_hash(sampled.key) != config_hash(greedy.key)
    # 1 and 1.0 are one setting
    assert plan_job(_cfg("model=tiny-random", "sampling.temperature=1.0", "sampling.n=4",
                         "sampling.top_p=0.95")).key == sampled.key


def test_a_tasks_declared_sampling_is_the_default_and_the_top_level_overrides_it():
    from kvbench.jobs.plan import resolve_sampling

    task = plan_job(_cfg("model=tiny-random", "task=passkey")).task
    task.sampling = {"temperature": 0.6, "top_p": 0.95, "top_k": None, "n": 8}  # what a math task declares
    assert resolve_sampling(_cfg(), task) == Sampling(0.6, 0.95, 0, 8)
    assert resolve_sampling(_cfg("sampling.n=2", "sampling.top_k=20"), task) == Sampling(0.6, 0.95, 20, 2)
    assert resolve_sampling(_cfg("sampling.temperature=0", "sampling.n=1"), task) is None  # greedy on request
    with pytest.raises(ConfigError, match=r"sampling.n=8 needs sampling"):
        resolve_sampling(_cfg("sampling.temperature=0"), task)


BAD = [
    (("sampling.temperature=-0.5",), "sampling.temperature=-0.5 must be a number > 0 (0 or null: greedy)"),
    (("sampling.temperature=0.7", "sampling.top_p=0"), "sampling.top_p=0 must be a number in (0, 1]"),
    (("sampling.temperature=0.7", "sampling.top_p=1.2"), "sampling.top_p=1.2 must be a number in (0, 1]"),
    (("sampling.temperature=0.7", "sampling.top_k=-3"), "sampling.top_k=-3 must be an integer >= 0"),
    (("sampling.temperature=0.7", "sampling.n=0"), "sampling.n=0 must be an integer >= 1"),
    (("sampling.n=4",), "sampling.n=4 needs sampling (a sampling.temperature > 0)"),
    (("sampling.top_p=0.9",), "sampling.top_p=0.9 needs sampling"),
    (("sampling.temperature=0.7", "task=pg19"), "task 'pg19' runs its own evaluation loop"),
    (("sampling.temperature=0.7", "task=passkey", "question=after_compression"),
     "sampling with question=after_compression or turns > 1 is not supported"),
    (("+sampling.min_p=0.1", "sampling.temperature=0.7"), "sampling.min_p is not a sampling setting; valid: "),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_sampling_is_refused_in_one_line_at_plan_time(overrides, message):
    with pytest.raises(ConfigError) as info:
        plan_job(_cfg("model=tiny-random", *overrides))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_task_whose_loop_depends_on_a_field_samples_where_the_runner_generates():
    """LongBench v2 runs its own two requests only with its CoT: without it the runner generates and may sample."""
    job = plan_job(_cfg("model=tiny-random", "task=longbench_v2", "task.cot=false", "sampling.temperature=0.7"))
    assert job.key["sampling"]["temperature"] == 0.7
    with pytest.raises(ConfigError, match="task 'longbench_v2' runs its own evaluation loop"):
        plan_job(_cfg("model=tiny-random", "task=longbench_v2", "task.cot=true", "sampling.temperature=0.7"))


def test_the_command_line_refuses_bad_sampling_with_exit_2(tmp_path):
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path), "KVBENCH_FAULT": "model_load:1"}
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", "model=tiny-random", "sampling.temperature=0.7",
                           "sampling.top_p=2"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert "sampling.top_p=2 must be a number in (0, 1]" in proc.stderr and not (tmp_path / "runs").exists()


# ---- scores from records -------------------------------------------------------------------------------------------
def _rec(of, k, score, key, tokens=10):
    return {"id": f"{of}#{k}", "sample_of": of, "sample_index": k, "answer_key": key, "score": score,
            "new_tokens": tokens}


def test_pass_at_1_and_majority_from_records():
    records = [_rec("a", 0, 1.0, "12"), _rec("a", 1, 0.0, "13"), _rec("a", 2, 1.0, "12"), _rec("a", 3, 0.0, "7"),
               # a tie between "x" (met first, wrong) and "y" (right): the first met wins
               _rec("b", 0, 0.0, "x", 30), _rec("b", 1, 1.0, "y", 30), _rec("b", 2, 1.0, "y", 30),
               _rec("b", 3, 0.0, "x", 30)]
    scores = sampled_scores(records)
    assert scores == {"pass@1": 0.5, "maj@n": 0.5, "n_samples_per_prompt": 4, "n_prompts": 2,
                      "new_tokens_mean": 20.0}
    # the majority is over answers, not over scores: three wrong answers that differ lose to two right ones
    c = [_rec("c", 0, 0.0, "1"), _rec("c", 1, 0.0, "2"), _rec("c", 2, 1.0, "5"), _rec("c", 3, 1.0, "5"),
         _rec("c", 4, 0.0, "3")]
    assert sampled_scores(c)["maj@n"] == 1.0 and sampled_scores(c)["pass@1"] == 0.4
    assert sampled_scores([{"id": "g", "score": 1.0, "new_tokens": 3}]) == {}  # greedy records: nothing added


def test_pass_at_1_and_majority_read_on_the_tasks_scale():
    """0/1 per problem, accuracy in percent (the math tasks, passkey): pass@1 and maj@n are percent too, and pass@1
    equals the task's own aggregate score when every prompt has its n samples."""
    from kvbench.store.scores import record_scores
    from kvbench.tasks.math.task import Math500Task

    records = [{**_rec("a", 0, 1.0, "12"), "decode_steps": 1, "batch_size": 1, "resident_kv_bytes": 0,
                "prompt_tokens": 1, "prefill_seconds": 0.0, "decode_seconds": 0.0},
               {**_rec("a", 1, 0.0, "13"), "decode_steps": 1, "batch_size": 1, "resident_kv_bytes": 0,
                "prompt_tokens": 1, "prefill_seconds": 0.0, "decode_seconds": 0.0}]
    assert sampled_scores(records, 100.0)["pass@1"] == 50.0
    scores = record_scores(Math500Task(), records)
    assert Math500Task.score_scale == 100.0
    assert scores["pass@1"] == scores["score"] == 50.0 and scores["maj@n"] == 100.0


def test_greedy_record_scores_are_unchanged():
    from kvbench.tasks.base import Sample, Task

    class T(Task):
        def samples(self, tokenizer):
            return [Sample("a", "p", ["x"])]

        def score(self, prediction, sample):
            return 1.0

    records = [{"id": "a", "score": 1.0, "new_tokens": 4, "decode_steps": 3, "batch_size": 1,
                "resident_kv_bytes": 8, "prompt_tokens": 5, "prefill_seconds": 0.1, "decode_seconds": 0.3}]
    assert set(record_scores(T(), records)) == {"score", "n", "n_samples", "resident_kv_bytes_mean",
                                                "prompt_tokens_mean", "prefill_seconds_mean",
                                                "decode_ms_per_token", "new_tokens_total"}
    assert T().majority_key("  42 ", Sample("a", "p", [])) == "42"


# ---- jobs: n rows per prompt, kill and resume, batches -------------------------------------------------------------
JOB = ["model=tiny-random", "task=passkey", "task.context_lengths=[256]", "task.depths=[10,50]", "method=snapkv",
       "budget=64", "task.max_new_tokens=8", "sampling.temperature=0.9", "sampling.top_p=0.95", "sampling.n=3"]


def _run(results: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "KVBENCH_FAULT"}
    return subprocess.run([sys.executable, "-m", "kvbench.run", *JOB, *extra], capture_output=True, text=True,
                          timeout=600, env={**environ, "KVBENCH_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1",
                                            **env})


def _job(results: Path) -> tuple[list[dict], dict]:
    (samples,) = list((results / "runs").glob("*/*/*/*/*/samples.jsonl"))
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    return records, json.loads((samples.parent / "scores.json").read_text())


def _outcome(records: list[dict]) -> dict:
    return {r["id"]: (r["prediction"], r["seed"], r["sample_of"], r["sample_index"], r["answer_key"], r["score"])
            for r in records}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[list[dict], dict, str]:
    results = tmp_path_factory.mktemp("clean")
    proc = _run(results)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return (*_job(results), proc.stdout)


@pytest.mark.slow
def test_a_sampled_job_runs_n_rows_per_prompt_and_prints_pass_at_1(clean):
    records, scores, stdout = clean
    assert [r["id"] for r in records] == [f"L256_D{d}_R0#{k}" for d in (10, 50) for k in range(3)]
    assert {r["seed"] for r in records} == {sample_seed(42, r["sample_of"], r["sample_index"]) for r in records}
    assert len({r["prediction"] for r in records if r["sample_of"] == "L256_D10_R0"}) == 3  # n samples differ
    assert scores["n_samples"] == 6 and scores["n_samples_per_prompt"] == 3 and scores["n_prompts"] == 2
    assert scores["pass@1"] == sampled_scores(records)["pass@1"] and "maj@n" in scores
    assert scores["new_tokens_mean"] == sum(r["new_tokens"] for r in records) / 6
    assert "pass@1" in stdout and "maj@3" in stdout and "output tokens" in stdout


@pytest.mark.slow
def test_a_killed_sampled_job_resumes_to_the_records_of_an_uninterrupted_run(tmp_path, clean):
    """SIGKILL after the fourth row's prefill (``mid_sample:4``): three rows are stored; the rerun generates the
    other three with their own seeds, and every record equals the uninterrupted run's; ``store verify`` recomputes
    pass@1 and maj@n from the records."""
    killed = _run(tmp_path, KVBENCH_FAULT="mid_sample:4")
    assert killed.returncode == -9, killed.stderr[-2000:]
    (samples,) = list((tmp_path / "runs").glob("*/*/*/*/*/samples.jsonl"))
    assert len(samples.read_text().splitlines()) == 3
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    records, scores = _job(tmp_path)
    assert _outcome(records) == _outcome(clean[0])
    names = ("pass@1", "maj@n", "score")
    assert {k: scores[k] for k in names} == {k: clean[1][k] for k in names}
    check = subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--results", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "1 finished" in check.stdout, check.stdout


@pytest.mark.slow
def test_batched_sampled_rows_equal_the_rows_run_alone(tmp_path, clean):
    """batch_size=2: rows of a batch (two samples of one prompt, or of two prompts) sample independently."""
    proc = _run(tmp_path, "batch_size=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records, _ = _job(tmp_path)
    assert {r["batch_size"] for r in records} == {2}
    assert _outcome(records) == _outcome(clean[0])
