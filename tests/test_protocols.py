"""Question placement and turns (#23): ``question=with_context|after_compression`` and ``turns=N``.

* The split: context ids + question ids are exactly today's encoding (needle, passkey, RULER; chat template on/off).
* with_context is today's behaviour: the job key of default configs did not change (hashes pinned from the commit
  before the option existed).
* after_compression: the method compressed the context alone (the session saw a context-long prompt), the question's
  tokens joined the cache after it (resident = budget, then + question tokens per layer), on tiny-random and through
  the whole job; a run that fed the whole prompt at once fails these.
* turns=N: one compressed context, N questions on one cache, a score and resident KV per turn (keep and rollback).
* Bad combinations fail at plan time in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from helpers import ByteTokenizer, method_fields
from kvbench.budget import Budget
from kvbench.config import CONF_DIR, register_resolvers
from kvbench.engine import CompressionSession
from kvbench.engine.generate import staged_generate
from kvbench.errors import ConfigError
from kvbench.jobs.plan import plan_job
from kvbench.methods import METHODS, build_method
from kvbench.store import config_hash


def _cfg(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# ---- with_context is today's behaviour ---------------------------------------------------------------------------
# sha256 of the job key at c7d991d (before question/turns existed), computed there with the same overrides
PINNED = {
    (): "e24ff131e61c4790747c9b5605270bdea49b503a5858a132acaf3bdd3021ce4f",
    ("model=tiny-random", "task=passkey", "budget=64"):
        "9d4c40ffc1732e16d6cef7adf8efbfc56644f29fd2aa2013604cb5a35ec78e46",
    ("method=h2o", "task=ruler", "budget=0.2"): "7f0b72ab0991a3e954a4a12062c677ab0dc298166a4fefb1a7a6741ddb340b54",
    ("method=streamingllm", "task=needle", "engine.compile=true"):
        "d987e0860c98219ff2ba80673dd20a31bb56276a08c633c38fe5f9997f242d74",
}


@pytest.mark.parametrize("overrides", list(PINNED))
def test_the_default_job_key_did_not_change(overrides):
    job = plan_job(_cfg(*overrides))
    assert not {"question", "turns", "turn_history"} & set(job.key)
    assert config_hash(job.key) == PINNED[overrides]
    # spelling the defaults out changes nothing either
    same = plan_job(_cfg(*overrides, "question=with_context", "turns=1", "turn_history=keep"))
    assert config_hash(same.key) == PINNED[overrides]


def test_after_compression_and_turns_change_the_key():
    base = plan_job(_cfg("model=tiny-random", "task=passkey"))
    after = plan_job(_cfg("model=tiny-random", "task=passkey", "question=after_compression"))
    assert after.key["question"] == "after_compression" and config_hash(after.key) != config_hash(base.key)
    multi = plan_job(_cfg("model=tiny-random", "task=needle_multiturn", "turns=3", "turn_history=rollback"))
    assert (multi.key["question"], multi.key["turns"], multi.key["turn_history"]) == ("after_compression", 3,
                                                                                      "rollback")
    assert multi.task.turns == 3


# ---- the split equals today's encoding ------------------------------------------------------------------------------
SPLIT_CASES = [
    ("task=needle", "task.context_lengths=[400]", "task.depths=[0,50,100]", "task.buffer_tokens=100"),
    ("task=needle_chat", "task.context_lengths=[400]", "task.depths=[50]", "task.buffer_tokens=100"),
    ("task=passkey", "task.context_lengths=[300]", "task.depths=[0,100]"),
    ("task=passkey", "task.context_lengths=[300]", "task.depths=[50]", "task.chat_template=true"),
    ("task=ruler", "task.tasks=[niah_single_1,niah_multikey_1,vt,cwe,fwe]", "task.context_lengths=[1500]",
     "task.num_samples=1"),
    ("task=ruler", "task.tasks=[niah_single_2,vt]", "task.context_lengths=[1500]", "task.num_samples=1",
     "task.template=base"),
    ("task=ruler", "task.tasks=[niah_single_1]", "task.context_lengths=[1500]", "task.num_samples=1",
     "task.template=meta-chat"),
    ("task=needle_multiturn", "turns=3", "task.context_lengths=[400]", "task.repeats=1", "task.buffer_tokens=100"),
]


@pytest.mark.parametrize("overrides", SPLIT_CASES, ids=lambda o: "-".join(x.split("=")[-1] for x in o[:2]))
def test_context_and_question_ids_are_exactly_the_full_encoding(tokenizer, overrides):
    from kvbench.tasks.encoding import encode_sample, encode_split, uses_chat_template

    job = plan_job(_cfg("model=tiny-random", *overrides))
    samples = job.task.samples(tokenizer)
    assert samples
    for sample in samples:
        assert sample.question and sample.prompt.endswith(sample.question)
        full = encode_sample(job.task, sample, tokenizer, job.spec)
        context, question = encode_split(job.task, sample, tokenizer, job.spec)
        assert context + question == full, sample.id
        assert len(question) >= 5 and len(context) > len(question)
        # the question part decodes to the question (and the template's tail / answer prefix after it)
        tail = tokenizer.decode(question)
        assert sample.question.strip().split("\n")[-1].strip()[:20] in tail, (sample.id, tail)
        chat = uses_chat_template(job.task, job.spec, tokenizer, sample)
        assert ("<|im_start|>assistant" in tail) == chat


# ---- plan-time refusals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (("task=truthfulqa", "question=after_compression"),
     "task 'truthfulqa' cannot separate its question from the context (question=after_compression); tasks that "
     "can: 2stageretr, infinitebench, leval, longbench, longbench_e, longbench_zh, needle, needle_kvpress, "
     "needle_multiturn, needle_retrieval_head, passkey, ruler, zeroscrolls"),
    (("task=pg19", "question=after_compression"), "task 'pg19' cannot separate its question"),
    (("task=infinitebench", "task.chat_template=true", "question=after_compression"),
     "task 'infinitebench' cannot separate the question of math_calc from the context"),
    (("task=leval", "question=after_compression"), "task 'leval' cannot separate the question of sci_fi"),
    (("task=passkey", "method=omnikv", "question=after_compression"), "method 'omnikv' cannot take the question"),
    (("task=passkey", "method=quest", "question=after_compression"), "method 'quest' cannot take the question"),
    (("task=passkey", "method=pod", "question=after_compression"), "method 'pod' cannot take the question"),
    (("task=passkey", "method=infllm", "question=after_compression"), "method 'infllm' cannot take the question"),
    (("task=passkey", "question=after_compression", "batch_size=2"), "use batch_size=1"),
    (("task=passkey", "question=after_compression", "engine.compile=true"), "use engine.compile=false"),
    (("task=passkey", "question=later"), "question='later' is not valid"),
    (("task=passkey", "turns=3"), "task 'passkey' asks one question per sample (turns=3); multi-turn tasks: "
                                  "needle_multiturn"),
    (("task=needle_multiturn", "turns=4", "task.turns=2"), "set turns only"),
    (("task=needle_multiturn", "turns=2", "turn_history=rollback", "method=pyramidinfer"),
     "turn_history=rollback restores the cache layers only"),
    (("task=needle_multiturn", "turns=2", "turn_history=forget"), "turn_history='forget' is not valid"),
])
def test_bad_combinations_fail_at_plan_time(overrides, message):
    with pytest.raises(ConfigError) as err:
        plan_job(_cfg("model=tiny-random", *overrides))
    assert message in str(err.value)


def test_the_command_line_says_it_in_one_line_before_loading(tmp_path):
    import os

    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", "task=truthfulqa", "question=after_compression"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: task 'truthfulqa' cannot separate its question from the context (question=after_compression); "
        "tasks that can: "), proc.stderr
    assert not list(tmp_path.glob("runs/*/*/*/*/*"))


# ---- the engine: the context is compressed alone, the question joins after it ------------------------------------
def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _staged(model, method_name, budget, context, turns, history="keep", new_tokens=4):
    b = Budget.parse(budget)
    method = build_method({"name": method_name, **method_fields(method_name, model)}, b)
    # KVzip feeds the model its repeat prompt after the context's prefill (the only method that reads a tokenizer)
    with CompressionSession(model, method, b, tokenizer=ByteTokenizer()) as session:
        out = staged_generate(model, context, turns, [new_tokens] * len(turns), [], history=history)
    return session, out


def test_snapkv_compresses_the_context_alone_then_the_question_joins(toy_llama):
    context, question = _ids(200, 1), _ids(12, 2)
    session, out = _staged(toy_llama, "snapkv", 64, context, [question])
    assert session.stats.prompt_lens == [200]  # the compression saw the context only (a whole-prompt feed: 212)
    assert out.context_tokens == 200
    assert out.layer_entries_after_compression == [64] * 3
    (turn,) = out.turns
    assert turn.fed_tokens == 12 and turn.layer_entries_after_question == [64 + 12] * 3
    assert turn.layer_entries_final == [64 + 12 + 3] * 3  # 4 generated, the last one never fed


def test_the_question_is_not_in_the_compressed_span(toy_llama, monkeypatch):
    """The positions the method chose from are the context's: every one kept after compression is < 200, and the
    question's 12 positions are all resident after its forward. Feeding the whole prompt at once fails both."""
    from kvbench.engine import generate as gen

    seen = {}
    real = gen.layer_entries

    def spy(cache):
        layer = cache.layers[0]
        seen.setdefault("after_compression", layer.positions[0, 0].tolist())
        seen["latest"] = layer.positions[0, 0].tolist()
        return real(cache)

    monkeypatch.setattr(gen, "layer_entries", spy)
    _staged(toy_llama, "snapkv", 64, _ids(200, 1), [_ids(12, 2)], new_tokens=1)
    assert len(seen["after_compression"]) == 64 and max(seen["after_compression"]) < 200
    assert set(range(200, 212)) <= set(seen["latest"])


def test_with_context_compresses_context_and_question_together(toy_llama):
    """The control: the same ids as one prompt leave the budget after prefill (the question inside the span)."""
    from kvbench.engine import greedy_generate

    b = Budget.parse(64)
    with CompressionSession(toy_llama, build_method({"name": "snapkv"}, b), b) as session:
        greedy_generate(toy_llama, [_ids(200, 1) + _ids(12, 2)], 1, [], 0)
    assert session.stats.prompt_lens == [212] and session.stats.layer_entries_after_prefill == [64] * 3


def test_the_compression_check_still_guards_the_context(toy_llama, monkeypatch):
    """A method that keeps the whole context under after_compression is caught at the context's prefill, as always."""
    from kvbench.errors import CompressionInactiveError
    from kvbench.methods.snapkv import SnapKV

    monkeypatch.setattr(SnapKV, "prefill", lambda self, layer, ctx: None)
    with pytest.raises(CompressionInactiveError, match="kept all 200 tokens of the prompt"):
        _staged(toy_llama, "snapkv", 64, _ids(200, 1), [_ids(12, 2)])


def test_fullkv_after_compression_generates_what_one_prefill_does(toy_llama):
    """With nothing compressed, feeding the question as a continued forward is the same computation as one prefill:
    the same tokens (the engine's continuation attends causally over the cache and the question)."""
    from kvbench.engine import greedy_generate

    context, question = _ids(150, 4), _ids(10, 5)
    b = Budget.parse("full")
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, b), b):
        whole = greedy_generate(toy_llama, [context + question], 8, [], 0).tokens[0]
    _, staged = _staged(toy_llama, "fullkv", "full", context, [question], new_tokens=8)
    assert staged.turns[0].tokens == whole
    assert staged.turns[0].layer_entries_after_question == [160] * 3


CONTINUABLE = sorted(n for n in set(METHODS.names()) - {"cla", "lococo", "offload"}
                     if METHODS.get_class(n).supports_continued_forward)


@pytest.mark.parametrize("method", CONTINUABLE)
def test_every_continuable_method_takes_the_question_and_two_turns(toy_llama, method):
    """Every method that does not refuse after_compression runs it: compression at the context's end (the cache
    below the context's length), the question joined (entries grew, or the method evicted at decode to its budget)."""
    session, out = _staged(toy_llama, method, 64, _ids(200, 1), [_ids(12, 2), _ids(8, 3)])
    assert session.stats.prompt_lens == [200]
    first, second = out.turns
    if method == "triattention":  # compresses during decoding only: the question's forward (212 >= 64 + 128
        # entries) cuts the cache to the context's first 64 (the prompt beyond the budget: the code's arange(budget))
        assert out.layer_entries_after_compression == [200] * 3 and first.layer_entries_after_question == [64] * 3
    elif method != "fullkv":
        assert max(out.layer_entries_after_compression) < 200
    assert first.fed_tokens == 12 and second.fed_tokens == 1 + 8  # the first answer's last token, then turn 2
    for turn in out.turns:
        assert len(turn.tokens) == 4
        assert max(turn.layer_entries_after_question) <= max(out.layer_entries_after_compression) + 12 + 4 + 9


def test_rollback_gives_every_turn_the_compressed_context_only(toy_llama):
    context, turns = _ids(200, 1), [_ids(12, 2), _ids(8, 3), _ids(8, 3)]
    _, keep = _staged(toy_llama, "snapkv", 64, context, turns, history="keep")
    _, back = _staged(toy_llama, "snapkv", 64, context, turns, history="rollback")
    assert [t.layer_entries_after_question[0] for t in back.turns] == [64 + 12, 64 + 8, 64 + 8]
    assert [t.fed_tokens for t in back.turns] == [12, 8, 8]
    assert [t.layer_entries_after_question[0] for t in keep.turns] == [76, 76 + 3 + 9, 76 + 3 + 9 + 3 + 9]
    # turns 2 and 3 ask the same question on the same cache: the same answer (rollback restores exactly)
    assert back.turns[1].tokens == back.turns[2].tokens
    # and turn 1 is the same under both
    assert keep.turns[0].tokens == back.turns[0].tokens


# ---- whole jobs ------------------------------------------------------------------------------------------------------
def _run(tmp_path, *overrides):
    from kvbench.jobs import run_job

    cfg = _cfg("model=tiny-random", "print_table=false", f"paths.results_dir={tmp_path}", *overrides)
    scores = run_job(cfg)
    (job,) = [p for p in (tmp_path / "runs").glob("*/*/*/*/*") if p.name == config_hash(plan_job(cfg).key)[:12]]
    records = [json.loads(x) for x in (job / "samples.jsonl").read_text().splitlines()]
    return scores, records, job


def test_a_passkey_job_after_compression_records_the_split(tmp_path):
    common = ("task=passkey", "task.context_lengths=[300]", "task.depths=[0,100]", "budget=64", "limit=2")
    _, before, _ = _run(tmp_path, *common)
    _, after, job = _run(tmp_path, *common, "question=after_compression")
    assert json.loads((job / "meta.json").read_text())["question"] == "after_compression"
    for plain, staged in zip(before, after):
        assert staged["id"] == plain["id"] and staged["prompt_tokens"] == plain["prompt_tokens"]
        assert staged["context_tokens"] + staged["question_tokens"] == staged["prompt_tokens"]
        assert plain["layer_entries"] == [64] * 4  # with_context: the question compressed with the context
        assert staged["resident_after_compression"] == [64] * 4
        assert staged["resident_after_question"] == [64 + staged["question_tokens"]] * 4
        assert staged["resident_kv_bytes_after_question"] > staged["resident_kv_bytes"] == plain["resident_kv_bytes"]


def test_a_three_turn_job_records_three_scores_one_cache_and_resident_kv_per_turn(tmp_path, monkeypatch):
    from kvbench.engine.session import CompressionSession as Session

    prefills = []
    real = Session._finish_prefill
    monkeypatch.setattr(Session, "_finish_prefill", lambda self, ctx: (prefills.append(1), real(self, ctx))[1])
    scores, records, _ = _run(tmp_path, "task=needle_multiturn", "turns=3", "task.context_lengths=[400]",
                              "task.buffer_tokens=100", "task.max_new_tokens=3", "budget=64", "limit=1")
    (record,) = records
    assert len(prefills) == 1  # one compressed context for the three questions
    assert len(record["turn_scores"]) == 3 and len(record["turns"]) == 3
    assert len(scores["turn_scores"]) == 3
    turns = record["turns"]
    assert record["resident_after_compression"] == [64] * 4
    assert turns[0]["resident_after_question"] == [64 + record["question_tokens"]] * 4
    for prev, turn in zip(turns, turns[1:]):  # keep: each turn starts where the previous one ended
        assert turn["resident_after_question"][0] == prev["resident_final"][0] + turn["fed_tokens"]
    assert len({tuple(t["answers"]) for t in turns}) == 3


# ---- the other benchmarks: their question follows the context in every prompt template ------------------------------
ESSAY = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 30).strip()


def _other_samples(name: str, tokenizer, **fields):
    """Samples of a benchmark built from synthetic rows by the task's own ``make_sample``: no download."""
    job = plan_job(_cfg("model=tiny-random", f"task={name}", *(f"task.{k}={v}" for k, v in fields.items())))
    task = job.task
    if name == "longbench":
        rows = {d: {"context": ESSAY, "input": "Who is blue?", "answers": ["sky"], "_id": d, "length": 300,
                    "all_classes": ["a", "b"], "language": "en"} for d in ("hotpotqa", "trec", "lcc", "gov_report")}
        return job, [task.make_sample(d, 0, row) for d, row in rows.items()]
    if name == "infinitebench":
        rows = {"passkey": {"context": ESSAY, "input": "What is the pass key?", "answer": ["12345"], "id": 0},
                "longbook_qa_eng": {"context": ESSAY, "input": "What is green?", "answer": ["grass"], "id": 1},
                "code_run": {"context": "def func_1(x):\n    return x", "input": "func_1(3)", "answer": [3], "id": 2}}
        return job, [task.make_sample(d, i, row) for i, (d, row) in enumerate(rows.items())]
    if name == "zeroscrolls":
        text = f"Answer the question.\n\nStory:\n{ESSAY}\n\nQuestion:\nWhat is blue?\n\nAnswer:\n"
        start = text.index("Question:")
        row = {"input": text, "query_start_index": start, "query_end_index": len(text), "id": "x",
               "truncation_seperator": "... [The rest of the story is omitted]\n\n"}
        return job, [task.make_sample("narrative_qa", row, ["the sky"])]
    if name == "leval":
        return job, [s for d in ("quality", "narrative_qa", "codeU")
                     for s in task.make_samples(d, 0, 0, 0, ESSAY, "What is blue?", "the sky")]
    return job, task.samples(tokenizer)[:3]


@pytest.mark.parametrize("name, fields", [
    ("longbench", {}), ("infinitebench", {}), ("infinitebench", {"chat_template": "true", "datasets": "[passkey]"}),
    ("zeroscrolls", {}), ("zeroscrolls", {"prompt_format": "completion"}), ("leval", {"datasets": "[quality]"}),
    ("leval", {"prompt_format": "llama2", "datasets": "[quality]"}), ("2stageretr", {"num_samples": 3}),
    ("2stageretr", {"cot": "false", "num_samples": 3}),
])
def test_other_benchmarks_split_into_exactly_their_encoding(tokenizer, name, fields):
    from kvbench.tasks.encoding import encode_sample, encode_split

    job, samples = _other_samples(name, tokenizer, **fields)
    for sample in samples:
        assert sample.question, sample.id
        full = encode_sample(job.task, sample, tokenizer, job.spec)
        context, question = encode_split(job.task, sample, tokenizer, job.spec)
        assert context + question == full and question and len(context) > 5, sample.id
