"""A job's captured decode replays one graph over one set of buffers, whatever its prompts' lengths (issue #36 item 1).

A layer whose slot count follows the prompt (FullKV, a ratio budget, a prompt within a fixed budget) used to take a
count rounded up to 256 per sample: a job whose prompts span N buckets of 256 compiled N graphs (inductor: about a
minute each for an 8B model, measured 60-112 s for 32 layers on this CPU), in the job's order, and a bucket met
again after another reallocated its buffers (on a GPU, a CUDA graph recorded again over the new addresses). With
the job's longest prompt and most new tokens (``CompressionSession(job_lengths=...)``, which the job runner reads
off every sample of the job, its limit aside) every sample's layers take the count of the longest: one graph, one
buffer. Evicting layers whose capacities the method sets per layer from the prompt (D2O) share one count in a job,
the most any of them needs rounded up to 64, where each sample was a graph of its own, and so do all the layers of a
method whose entry counts per layer or head follow the prompt's content (``Method.capacities_from_content``:
DynamicKV, KVMerger, AdaKV: which layers exceed the budget's mean, or turn ragged, changed per sample). H2O's recent
window, Quest's page budget and CaM's start and recent counts follow each row's capacity in the step (a prompt under
the budget, or a ratio budget, made them graph constants of its own: CaM compiled a graph per sample), and Quest's
layers, which keep every entry, take the job's longest prompt. Pinned as counts and addresses; the tokens, the final
resident bytes and the resident curve stay the host-driven path's (the slots a short prompt's layers take for the
job's longest are layout, not memory the method keeps). The job's count is rounded up to 256 (``SLOT_ROUND``), so the
jobs of a sweep whose budgets or new tokens differ by less share a graph too (LongBench's datasets take 32, 64, 128 or
512 new tokens: SnapKV at budgets 64 and 128 over them took 7 counts, 7 graphs; now 2).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import ByteTokenizer
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.engine.static import release_slot_pool, slot_pool
from kvbench.errors import ConfigError
from kvbench.methods import METHODS, build_method

pytestmark = pytest.mark.compat
#: a job's prompts in its order: four buckets of 256 tokens, one prompt shorter than a 256-token budget
LENGTHS = [300, 900, 130, 610]
NEW = 12


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _job(model, name: str, budget: str, compile, job_lengths=None, fields=None):
    """Every prompt of the job in a session of its own, as the job runner runs them: per sample, its tokens, its
    first layer's slot count and that buffer's address; and the graphs dynamo compiled meanwhile."""
    b = Budget.parse(budget)
    method = build_method({"name": name, **(fields or {})}, b)
    release_slot_pool(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out = []
    for seed, n in enumerate(LENGTHS):
        tokenizer = ByteTokenizer() if method.needs_reconstruction else None  # KVzip's repeat prompt, in toy ids
        with CompressionSession(model, method, b, compile=compile, job_lengths=job_lengths,
                                tokenizer=tokenizer) as session:
            gen = greedy_generate(model, [_prompt(n, seed)], NEW, [], 0)
        keys = slot_pool(model)._held.get((0, "keys")) if compile else None
        memory = (gen.resident_kv_bytes_final, session.stats.resident_curve)
        out.append((gen.tokens, None if keys is None else (keys.shape[-2], keys.data_ptr()), memory))
    return out, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


@pytest.mark.parametrize(("name", "budget"), [("fullkv", "full"), ("snapkv", "256"), ("snapkv", "0.5"),
                                              ("streamingllm", "256"), ("h2o", "256"), ("d2o", "128"),
                                              ("quest", "256"), ("dynamickv", "256"), ("kvmerger", "256"),
                                              ("adakv", "256"), ("cam", "0.5"), ("cam", "256"),
                                              ("pyramidinfer", "0.5"), ("pyramidinfer", "256")])
def test_a_jobs_samples_replay_one_graph_over_one_buffer(toy_llama, name, budget):
    eager, _ = _job(toy_llama, name, budget, False)
    captured, graphs = _job(toy_llama, name, budget, "eager", job_lengths=(max(LENGTHS), NEW))
    assert [t for t, _, _ in captured] == [t for t, _, _ in eager]
    assert len({slots for _, slots, _ in captured}) == 1  # one slot count and one address for the whole job
    # each sample's memory is the entries it holds, as on the host-driven path: not the job's longest prompt's slots
    assert [m for _, _, m in captured] == [m for _, _, m in eager]
    assert graphs <= 1  # (0 where an earlier test of this process compiled the same count, or nothing compiles)


def test_a_content_methods_slots_only_grow_within_a_job(toy_llama):
    """DynamicKV's layers hold what its allocation gives each (here 218-275 entries around a budget of 240): a sample
    whose largest layer needs more than the job's count (240 + 12, rounded up to 256) takes its own (275 + 12, rounded
    up to 320), and the samples after it, needing less,
    kept it instead of returning to 256 (a second graph, and buffers at new addresses: on a GPU a graph recorded again).
    The tokens and each sample's memory stay the host-driven path's."""
    b = Budget.parse("240")
    method = build_method({"name": "dynamickv"}, b)
    release_slot_pool(toy_llama)
    job = [(700, 5), (300, 0), (900, 1), (130, 2)]  # the first sample's allocation needs the most
    runs = {}
    for compile in (False, "eager"):
        out = []
        for n, seed in job:
            with CompressionSession(toy_llama, method, b, compile=compile, job_lengths=(900, NEW)) as session:
                gen = greedy_generate(toy_llama, [_prompt(n, seed)], NEW, [], 0)
            keys = slot_pool(toy_llama)._held.get((0, "keys")) if compile else None
            out.append((gen.tokens, gen.resident_kv_bytes_final, session.stats.resident_curve,
                        None if keys is None else (keys.shape[-2], keys.data_ptr())))
        runs[compile] = out
    assert {slots for *_, slots in runs["eager"]} == {(320, runs["eager"][0][3][1])}
    assert [r[:3] for r in runs["eager"]] == [r[:3] for r in runs[False]]


@pytest.mark.parametrize(("name", "budget"), [("pyramidkv", "0.5"), ("d2o", "0.5"), ("kvzip", "0.5"),
                                              ("kvzip", "256")])
def test_a_layer_allocation_only_grows_within_a_job(toy_llama, name, budget):
    """A ratio budget sizes PyramidKV's layers per prompt, each layer its own count around the mean: the layers share
    one count, the longest prompt's largest layer's (``Method.prompt_entries``: 870 + 12, rounded up to 1024 slots),
    where each sample's counts were a graph of their own (462, 1024, 462, 768 slots for the job's four samples, 3
    graphs), and then a count that grew at the longest prompt (2 graphs). D2O's allocation follows the content
    (``capacities_from_content``): its count only grows within the job (the most any layer needs, rounded up). So do
    KVzip's heads, each holding what the scores give it (a ragged layer: its longest head): 320, 384, 320, 384 slots
    at 256 before (3 graphs; the third prompt, within the budget, kept its layers uniform and took a count of its
    own), then 320, 384, 384, 384, and 512 for all four since a job's count is rounded up to 256 (256 + 12 -> 512:
    the job's count holds every head). The tokens and each sample's memory stay the host-driven path's."""
    eager, _ = _job(toy_llama, name, budget, False)
    captured, graphs = _job(toy_llama, name, budget, "eager", job_lengths=(max(LENGTHS), NEW))
    assert [t for t, _, _ in captured] == [t for t, _, _ in eager]
    assert [m for _, _, m in captured] == [m for _, _, m in eager]
    counts = [slots for _, (slots, _), _ in captured]
    assert counts == sorted(counts) and len(set(counts)) <= 2, counts  # grows once: at the longest prompt (second)
    assert graphs <= 2
    if name == "pyramidkv":  # host arithmetic: the job's count from the first sample on
        assert set(counts) == {1024} and graphs <= 1
    if (name, budget) == ("kvzip", "256"):  # the job's rounded count holds every head of every sample
        assert set(counts) == {512} and graphs <= 1


@pytest.mark.parametrize(("name", "budget"), [("pod", "128"), ("triattention", "256")])
def test_a_method_that_holds_the_prompt_whole_takes_the_jobs_longest(toy_llama, tmp_path, name, budget):
    """POD keeps every value (its budget is unused) and TriAttention the whole prompt until its schedule compresses
    during decode (``compression = "none"``): the job's count is its longest prompt's whole (912 slots here), where
    the budget's tokens for it (128 + 12, 256 + ...) left every sample a count and a graph of its own (142, 312, 622,
    912: 4 graphs)."""
    import json

    from helpers import triattention_stats

    (tmp_path / "map.json").write_text(json.dumps({"model": "toy", "delta": 0.5, "granularity": "kv_head",
                                                   "num_layers": 3, "num_kv_heads": 2,
                                                   "blocks": [[[0, 1], [2]], [[0], [1, 2]]]}))
    fields = {"pod": {"n_s": 4, "n_r": 8, "block_map": str(tmp_path / "map.json")},
              "triattention": {"stats_path": triattention_stats(toy_llama), "divide_length": 4}}[name]
    eager, _ = _job(toy_llama, name, budget, False, fields=fields)
    captured, graphs = _job(toy_llama, name, budget, "eager", job_lengths=(max(LENGTHS), NEW), fields=fields)
    assert [t for t, _, _ in captured] == [t for t, _, _ in eager]
    assert [m for _, _, m in captured] == [m for _, _, m in eager]
    assert len({slots for _, slots, _ in captured}) == 1 and graphs <= 1
    assert captured[0][1][0] >= max(LENGTHS)  # (912 for POD, 901 for TriAttention: it evicts at its first step)


#: fields a method needs on the toy model, or a configuration whose layers hold counts of their own
FIELDS = {"omnikv": {"filter_layers": [0]}, "pyramidinfer-paper": {"allocation": "paper"},
          "pyramidkv-2406": {"schedule": "kvfactory_2406"}}
#: fewer than ``prompt_entries`` says: a budget's remainder smaller than a chunk stays unused
BELOW = {"chunkkv"}
#: counts that follow the prompt's content (``Method.capacities_from_content``)
CONTENT = {"adakv", "d2o", "dynamickv", "kvmerger", "kvzip"}


def test_the_methods_whose_counts_follow_the_content():
    assert {n for n in METHODS.names() if METHODS.get_class(n).capacities_from_content is True} == CONTENT


@pytest.mark.parametrize("name", sorted(set(METHODS.names()) - {"cla", "lococo", "offload", "fullkv"} - CONTENT
                                        | {"pyramidinfer-paper", "pyramidkv-2406"}))
def test_prompt_entries_are_what_each_layer_holds_after_prefill(toy_llama, tmp_path, name):
    """``Method.prompt_entries`` (host arithmetic, what a job's captured decode sizes every sample's slots from) is
    what each layer holds after the prompt's prefill, for two lengths and a token and a ratio budget: PyramidInfer's
    and PyramidKV's counts per layer, the whole prompt for the methods that keep it, the budget's tokens otherwise;
    at most that for ChunkKV. A method whose counts follow the content (D2O, DynamicKV, KVMerger, AdaKV, KVzip) is not
    held to it (its job's count grows where a sample needs more)."""
    from helpers import ByteTokenizer, triattention_stats

    base = name.split("-")[0]
    fields = FIELDS.get(name, {})
    if base == "triattention":
        fields = {"stats_path": triattention_stats(toy_llama)}
    if base == "pod":
        (tmp_path / "map.json").write_text('{"model": "toy", "delta": 0.5, "granularity": "layer", "num_layers": 3, '
                                           '"num_kv_heads": 2, "blocks": [[0, 1], [2]]}')
        fields = {"n_s": 4, "n_r": 8, "block_map": str(tmp_path / "map.json")}
    checked = 0
    for budget in ("64", "0.5"):
        for n in (100, 300):
            b = Budget.parse(budget)
            try:
                method = build_method({"name": base, **fields}, b)
            except ConfigError:  # (TriAttention: a ratio; OmniKV: a ratio below its dense layers' share)
                continue
            assert not method.capacities_from_content
            tokenizer = ByteTokenizer() if method.needs_reconstruction else None
            try:
                with CompressionSession(toy_llama, method, b, tokenizer=tokenizer) as session:
                    greedy_generate(toy_llama, [_prompt(n, 1)], 1, [], 0)  # the prefill only
                    held = [session._layers[i].values.shape[2] for i in sorted(session._layers)]
            except ConfigError:  # (a ratio below the method's minimum on this prompt, or OmniKV's dense share)
                continue
            want = method.prompt_entries(b, n, 3)
            if base in BELOW:
                assert all(h <= w for h, w in zip(held, want)) and held != want, (budget, n, held, want)
            else:
                assert held == want, (budget, n, held, want)
            checked += 1
    assert checked >= 2


def test_a_prompt_within_the_budget_replays_the_jobs_grown_count(toy_llama):
    """PyramidKV at budget 256: a 900-token prompt's layers hold 503, 267 and 31 entries (one count for them: 512
    slots); a 130-token prompt after it, whose layers hold it whole, replays those 512 slots instead of taking the
    job's own count (268: a second graph). So does the first sample (300 tokens: every layer 267), which took 268
    before the job's count came from the longest prompt's pyramid (``Method.prompt_entries``): a second graph."""
    b = Budget.parse("256")
    method = build_method({"name": "pyramidkv"}, b)
    release_slot_pool(toy_llama)
    counts = []
    for seed, n in enumerate(LENGTHS):
        with CompressionSession(toy_llama, method, b, compile="eager", job_lengths=(max(LENGTHS), NEW)) as session:
            greedy_generate(toy_llama, [_prompt(n, seed)], NEW, [], 0)
        counts.append({session._layers[i].keys.shape[2] for i in session._layers})
    assert counts == [{512}, {512}, {512}, {512}]


def test_pyramidinfers_paper_allocation_replays_one_graph(toy_llama):
    """PyramidInfer's ``allocation=paper`` sizes its recent window from each prompt (W = 1 + int(0.2 n): 61, 181, 27,
    123 here): W is a device value of its captured step, not a shape (a graph per sample before), so the job's
    samples replay one graph, as the host-driven path decodes them."""
    fields = {"allocation": "paper"}
    eager, _ = _job(toy_llama, "pyramidinfer", "256", False, fields=fields)
    captured, graphs = _job(toy_llama, "pyramidinfer", "256", "eager", job_lengths=(max(LENGTHS), NEW), fields=fields)
    assert [t for t, _, _ in captured] == [t for t, _, _ in eager]
    assert [m for _, _, m in captured] == [m for _, _, m in eager]
    # one count and buffer from the first sample on (the longest prompt's contexts, ``prompt_entries``: the first
    # sample took 320 slots from the unused budget's tokens and the second 960, a second graph)
    assert len({slots for _, slots, _ in captured}) == 1 and graphs <= 1


@pytest.mark.parametrize(("budget", "selector"), [("64", "last"), ("64", "exp"), ("0.8", "softmax_before_last"),
                                                  ("0.8", "uniform")])
def test_omnikvs_selection_of_every_prompt_replays_one_graph(toy_llama, budget, selector):
    """OmniKV's captured step selects among the prompt's slots by a device prompt length and k (``omnikv_sizes``) in
    a selection as wide as the slots: a job's prompts of four lengths replay one graph (a graph per sample before:
    the prompt's length was the selection's width and a constant of the step, and a ratio budget's k too), and
    decode as the host-driven path does."""
    fields = {"filter_layers": [0], "selector": selector}
    eager, _ = _job(toy_llama, "omnikv", budget, False, fields=fields)
    captured, graphs = _job(toy_llama, "omnikv", budget, "eager", job_lengths=(max(LENGTHS), NEW), fields=fields)
    assert [t for t, _, _ in captured] == [t for t, _, _ in eager]
    assert [m for _, _, m in captured] == [m for _, _, m in eager]
    assert len({slots for _, slots, _ in captured}) == 1 and graphs <= 1


def test_a_jobs_short_last_batch_replays_the_jobs_graph(toy_llama):
    """Five prompts at batch size four: the last batch, one row, ran its captured step at the bucket of one, a graph
    and buffers of its own (on a GPU about a minute of inductor for an 8B model, in every job whose samples are not a
    multiple of its batch size). With the job's rows (``job_rows``, which the job runner gives: its batch size, at
    most the samples it runs) it runs at the bucket of four over the same buffers, its extra rows copies of its one:
    one graph for the job; the tokens and records are the host-driven path's."""
    b = Budget.parse("64")
    method = build_method({"name": "h2o"}, b)
    prompts = [_prompt(n, seed) for seed, n in enumerate(LENGTHS + [450])]
    runs = {}
    for compile in (False, "eager"):
        release_slot_pool(toy_llama)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out = []
        for batch in (prompts[:4], prompts[4:]):
            with CompressionSession(toy_llama, method, b, compile=compile, job_lengths=(max(LENGTHS), NEW),
                                    job_rows=4 if compile else None) as session:
                gen = greedy_generate(toy_llama, batch, NEW, [], 0)
            keys = slot_pool(toy_llama)._held.get((0, "keys")) if compile else None
            out.append((gen.tokens, gen.resident_kv_bytes_final, session.stats.resident_curve,
                        session.stats.attended_tokens_mean,
                        None if keys is None else (tuple(keys.shape), keys.data_ptr())))
        runs[compile] = out, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    (eager, _), (captured, graphs) = runs[False], runs["eager"]
    assert [r[:4] for r in captured] == [r[:4] for r in eager]
    assert len({r[4] for r in captured}) == 1 and captured[0][4][0][0] == 4  # one buffer, four rows, for both
    assert graphs <= 1


def test_without_the_jobs_lengths_each_bucket_is_a_graph_of_its_own(toy_llama):
    from kvbench.engine import graph

    torch._dynamo.reset()  # graphs of these counts an earlier test of this worker compiled would be reused, not counted
    captured, graphs = _job(toy_llama, "fullkv", "full", "eager")
    counts = [slots for _, (slots, _), _ in captured]
    assert counts == [512, 1024, 256, 768]  # what a job paid before job_lengths: a graph per count
    # (where dynamo traces the forward whole: torch 2.6 with transformers 5.6, CI's lowest leg, runs it uncompiled)
    assert graphs == (4 if graph.STATUS.get("captured") else 0)


def test_a_layer_that_needs_more_than_the_jobs_longest_takes_its_own_count(toy_llama):
    """Job lengths that understate the job (a caller's mistake, or a per-layer allocation above the budget's mean)
    never cut a layer short: a sample that needs more takes its own rounded count, as without them; the others the
    job's (200 + 12, rounded up to 256)."""
    captured, _ = _job(toy_llama, "fullkv", "full", "eager", job_lengths=(200, NEW))
    assert [slots for _, (slots, _), _ in captured] == [512, 1024, 256, 768]


def test_the_job_runner_gives_every_session_the_whole_jobs_lengths(tmp_path, monkeypatch, tokenizer):
    """``_job_lengths`` reads every sample of the job (a ``limit`` run's sessions are sized as the full job's, so a
    sample's record does not depend on the limit), only for a captured decode."""
    from hydra import compose, initialize_config_dir

    import kvbench.engine
    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import plan_job
    from kvbench.jobs.runner import _job_lengths, run_job
    from kvbench.tasks.encoding import encode_sample

    overrides = ["model=tiny-random", "task=passkey", "task.context_lengths=[256,512]", "task.depths=[50]",
                 "task.max_new_tokens=6", "limit=1", f"paths.results_dir={tmp_path}"]
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        graph_cfg = compose(config_name="config", overrides=[*overrides, "engine.decode=graph"])
        eager_cfg = compose(config_name="config", overrides=overrides)
    job = plan_job(graph_cfg)
    samples = job.task.samples(tokenizer)
    lengths = [len(encode_sample(job.task, s, tokenizer, job.spec)) for s in samples]
    assert len(samples) == 2 and lengths[0] < lengths[1]
    loaded = SimpleNamespace(tokenizer=tokenizer)
    assert _job_lengths(job, samples, loaded) == (max(lengths), 6)
    assert _job_lengths(plan_job(eager_cfg), samples, loaded) is None

    seen = []

    class Spy(CompressionSession):
        def __init__(self, *args, **kwargs):
            seen.append((kwargs.get("job_lengths"), kwargs.get("job_rows")))
            super().__init__(*args, **{**kwargs, "compile": "eager"})  # dynamo's capture without inductor's kernels

    monkeypatch.setattr(kvbench.engine, "CompressionSession", Spy)
    run_job(graph_cfg)
    assert seen == [((max(lengths), 6), 1)]  # limit=1 ran the shorter sample, sized for the longer one, in one row


@pytest.mark.parametrize(("name", "jobs"), [
    ("snapkv", [("64", 12), ("128", 40), ("64", 40), ("128", 12)]),
    ("h2o", [("64", 12), ("128", 40)]),
    ("fullkv", [("full", 12), ("full", 40)]),
])
def test_a_sweeps_jobs_of_other_budgets_and_new_tokens_share_a_graph(toy_llama, name, jobs):
    """A sweep worker runs job after job on one loaded model: LongBench's datasets ask for 32, 64, 128 or 512 new
    tokens, and a sweep runs several budgets. A job's count was its budget (or longest prompt) plus its new tokens
    exactly, a graph per (budget, new tokens) (SnapKV: 76, 104, 140, 168 slots, 4 graphs of about a minute of inductor
    each for an 8B model); rounded up to 256 it is one count, one buffer and one graph for all four jobs. Each job's
    tokens are the host-driven path's."""
    release_slot_pool(toy_llama)
    torch._dynamo.reset()  # a count an earlier test of this worker compiled would be reused, not counted
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    slots = set()
    for budget, new in jobs:
        b = Budget.parse(budget)
        method = build_method({"name": name}, b)
        prompt = _prompt(max(LENGTHS), new)
        runs = []
        for compile in (False, "eager"):
            with CompressionSession(toy_llama, method, b, compile=compile, job_lengths=(max(LENGTHS), new)):
                runs.append(greedy_generate(toy_llama, [prompt], new, [], 0).tokens)
        assert runs[0] == runs[1]
        keys = slot_pool(toy_llama)._held[(0, "keys")]
        slots.add((keys.shape[-2], keys.data_ptr()))
    from kvbench.engine import graph

    assert len(slots) == 1, slots
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == (1 if graph.STATUS.get("captured") else 0)
