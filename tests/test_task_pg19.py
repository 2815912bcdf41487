"""PG-19 streaming perplexity: the streaming loop equals a full forward for FullKV, the loss of a compressed method is
taken before its eviction (checked against an independent forward on the exact attended set), the curve positions
and aggregate by hand, the data formats, and clear errors offline."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import run_job_in
from kvbench.budget import Budget
from kvbench.config import CONF_DIR
from kvbench.engine import CompressionSession, teacher_forced_logprobs
from kvbench.errors import ConfigError, DataError
from kvbench.jobs.answer import EngineAnswerer
from kvbench.methods import build_method
from kvbench.tasks.pg19 import PG19Task, curve_grid
from kvbench.tasks.pg19 import data as pg19_data

FULL = Budget("full", float("inf"))


def _full_forward_logprobs(model, ids):
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:]).view(-1, 1)).view(-1)


# ---- the streaming loop ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill", [1, 6, 39])
def test_fullkv_streaming_equals_one_full_forward(toy_llama, prefill):
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with CompressionSession(toy_llama, build_method({"name": "fullkv"}, FULL), FULL):
        out = teacher_forced_logprobs(toy_llama, ids, prefill, score_from=1)
    assert out.decode_steps == 39 - prefill and out.logprobs.shape == (39,)
    torch.testing.assert_close(out.logprobs, _full_forward_logprobs(toy_llama, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["fullkv", "streamingllm", "h2o"])
def test_a_batch_of_rows_scores_each_row_as_alone(toy_llama, method):
    """``teacher_forced_scores`` on three rows of one length equals ``teacher_forced_logprobs`` on each row alone
    (logprobs, greedy, gaps; a compressing method evicts per row), and a gap is 0 exactly where the token is the
    argmax and otherwise ``max(logits) - logits[token]`` of a full forward."""
    from kvbench.engine import teacher_forced_scores

    budget = FULL if method == "fullkv" else Budget.parse(16)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 256, (40,), generator=gen).tolist() for _ in range(3)]
    rows[1][30:] = rows[0][30:]  # one row's tail another row's: per-row state, not per-token
    with CompressionSession(toy_llama, build_method({"name": method}, budget), budget):
        batch = teacher_forced_scores(toy_llama, rows, 24, score_from=20)
    assert batch.logprobs.shape == batch.gaps.shape == batch.greedy.shape == (3, 20) and batch.decode_steps == 15
    for i, row in enumerate(rows):
        with CompressionSession(toy_llama, build_method({"name": method}, budget), budget):
            alone = teacher_forced_logprobs(toy_llama, row, 24, score_from=20)
        torch.testing.assert_close(batch.logprobs[i], alone.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(batch.gaps[i], alone.gaps, atol=1e-5, rtol=0)
        assert torch.equal(batch.greedy[i], alone.greedy)
    assert torch.equal(batch.gaps == 0, batch.greedy) and (batch.gaps >= 0).all() and not batch.greedy.all()
    if method == "fullkv":  # one forward gives every step's logits
        logits = toy_llama(torch.tensor(rows[:1])).logits[0, 19:39].float()
        target = torch.tensor(rows[0][20:]).view(-1, 1)
        gaps = logits.amax(-1) - logits.gather(-1, target).view(-1)
        torch.testing.assert_close(batch.gaps[0], gaps, atol=1e-4, rtol=0)


def test_rows_of_other_lengths_are_refused(toy_llama):
    from kvbench.engine import teacher_forced_scores

    with pytest.raises(ValueError, match=r"one length, got lengths \[10, 9\]"):
        teacher_forced_scores(toy_llama, [[5] * 10, [5] * 9], 4)


def test_loss_is_taken_before_the_steps_eviction():
    """One layer: a token's keys/values do not depend on its context, so the logits at step t equal a plain forward
    over exactly the tokens t attended (original positions). StreamingLLM (4 sinks, budget 8) attends the 8 cached
    tokens plus itself at step t, then evicts; scoring after the eviction would see one recent token fewer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    budget, sinks = Budget.parse(8), 4
    with CompressionSession(model, build_method({"name": "streamingllm", "sink_size": sinks}, budget), budget):
        out = teacher_forced_logprobs(model, ids, 8, score_from=1)

    def logprob_over(attended, t):
        logits = model(torch.tensor([[ids[i] for i in attended]]), position_ids=torch.tensor([attended])).logits
        return float(torch.log_softmax(logits[0, -1].float(), -1)[ids[t + 1]])

    full = _full_forward_logprobs(model, ids)
    torch.testing.assert_close(out.logprobs[:8], full[:8], atol=1e-5, rtol=0)  # the prefill: full causal attention
    for t in range(8, 29):
        before = [*range(sinks), *range(t - (8 - sinks), t), t]  # the cache after step t-1, plus t
        after = [*range(sinks), *range(t - (8 - sinks) + 1, t), t]
        assert out.logprobs[t] == pytest.approx(logprob_over(before, t), abs=1e-5)
        assert abs(float(out.logprobs[t]) - logprob_over(after, t)) > 1e-4


# ---- curve and aggregate by hand -------------------------------------------------------------------------------------
def test_curve_grid():
    assert curve_grid(11, 4, "log") == [1, 2, 5, 10]  # geomspace(1, 10, 4) = 1, 2.15, 4.64, 10
    assert curve_grid(11, 4, "linear") == [2, 5, 8, 10]  # linspace(2.5, 10, 4), rounded half to even
    assert curve_grid(3, 64, "log") == [1, 2]


def test_per_document_curve_and_aggregate():
    task = PG19Task(max_tokens=5, curve="linear", curve_points=4)  # grid 1, 2, 3, 4
    a = task._sample_curve(torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64))
    b = task._sample_curve(torch.tensor([2.0, 4.0], dtype=torch.float64))
    assert a == {"positions": [1, 2, 3, 4], "cum_nll": [1.0, 1.5, 2.0, 3.0]}
    assert b == {"positions": [1, 2], "cum_nll": [2.0, 3.0]}
    records = [{"id": "a", "score": math.exp(3.0), "nll_sum": 12.0, "n_predicted": 4, "curve": a,
                "resident_kv_bytes_final": 100},
               {"id": "b", "score": math.exp(3.0), "nll_sum": 6.0, "n_predicted": 2, "curve": b,
                "resident_kv_bytes_final": 50}]
    out = task.aggregate(records)
    assert out["score"] == round(math.exp(18 / 6), 4) and out["n_tokens"] == 6 and out["nll_mean"] == 3.0
    assert out["curve"] == {"positions": [1, 2, 3, 4], "cum_nll": [1.5, 2.25, 2.0, 3.0], "n_documents": [2, 2, 1, 1]}
    assert out["resident_kv_bytes_final_mean"] == 75


def test_prefill_rules():
    task = PG19Task()
    assert task.prefill_for(Budget.parse(128), 2048) == 128  # the budget: StreamingLLM's cache filling
    assert task.prefill_for(FULL, 2048) == 1
    assert task.prefill_for(Budget.parse(128), 50) == 49  # a short document: everything but the last token
    assert PG19Task(prefill_tokens=512).prefill_for(Budget.parse(128), 2048) == 512
    with pytest.raises(ConfigError, match="prefill_tokens=64 is below budget=128"):
        PG19Task(prefill_tokens=64).prefill_for(Budget.parse(128), 2048)
    with pytest.raises(ConfigError, match="ratio"):
        task.prefill_for(Budget.parse(0.2), 2048)
    assert PG19Task(prefill_tokens=100).prefill_for(Budget.parse(0.2), 2048) == 100


@pytest.mark.parametrize("fields, shown", [
    ({"source": "wiki"}, "source must be a string (one of pg19, essays); got 'wiki'"),
    ({"split": "dev"}, "split"),
    ({"max_tokens": 1}, "max_tokens must be an integer >= 2"),
    ({"prefill_tokens": 2048}, "prefill_tokens=2048 must be below max_tokens=2048"),
    ({"curve": "cubic"}, "curve"),
    ({"source": "essays", "data_dir": "/x"}, "data_dir is for source=pg19"),
])
def test_bad_fields(fields, shown):
    with pytest.raises(ConfigError, match=shown.replace("(", r"\(").replace(")", r"\)")):
        PG19Task(**fields).validate()


# ---- data ------------------------------------------------------------------------------------------------------------
def test_official_txt_books_sorted_by_gutenberg_id(tmp_path):
    (tmp_path / "test").mkdir()
    for book_id in ("20", "3", "100"):
        (tmp_path / "test" / f"{book_id}.txt").write_text(f"book {book_id}", encoding="utf-8")
    docs = pg19_data.read_local("pg19", str(tmp_path), "test")
    assert [(d.id, d.text) for d in docs] == [("3", "book 3"), ("20", "book 20"), ("100", "book 100")]
    task = PG19Task(data_dir=str(tmp_path), n_books=2)
    task.validate()
    assert [d.id for d in task.documents()] == ["3", "20"]


def test_parquet_books_with_url_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    rows = {"short_book_title": ["B", "A"], "publication_date": [1900, 1901],
            "url": ["http://www.gutenberg.org/ebooks/512", "http://www.gutenberg.org/ebooks/44"], "text": ["b", "a"]}
    pq.write_table(pa.table(rows), tmp_path / "data" / "test-00000-of-00001.parquet")
    pq.write_table(pa.table({**rows, "text": ["x", "y"]}), tmp_path / "data" / "train-00000-of-00001.parquet")
    docs = pg19_data.read_local("pg19", str(tmp_path), "test")
    assert [(d.id, d.title, d.text) for d in docs] == [("44", "A", "a"), ("512", "B", "b")]


def test_missing_or_empty_data_dir(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        PG19Task(data_dir=str(tmp_path / "nowhere")).validate()
    with pytest.raises(DataError, match=r"no PG-19 test books .*test-\*\.parquet"):
        PG19Task(data_dir=str(tmp_path)).validate()


def test_offline_hub_is_one_clear_line(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nto load this file.")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    monkeypatch.setattr("kvbench.hub.hub_unreachable", lambda: None)  # reachable, the listing itself fails
    task = PG19Task()
    task.validate()  # nothing is downloaded before the model loads
    with pytest.raises(DataError) as err:
        task.prepare_data()
    message = str(err.value)
    assert "\n" not in message and "task.data_dir" in message and "task.source=essays" in message
    assert "emozilla/pg19" in message and "OSError: We couldn't connect" in message


def test_unreachable_hub_is_one_line_without_a_network_call(monkeypatch):
    from helpers import UNREACHABLE, hub_without_network

    network = hub_without_network(monkeypatch)
    task = PG19Task()
    task.validate()
    with pytest.raises(DataError) as err:
        task.prepare_data()
    assert str(err.value) == (
        f"task 'pg19': could not download the PG-19 test split from the hub dataset emozilla/pg19 ({UNREACHABLE}); "
        "put the PG-19 test books (<book_id>.txt files or parquet files) in a directory and set "
        "task.data_dir=<directory>, or use the offline text: task.source=essays")
    assert network == []  # refused before huggingface_hub's retries


def test_hub_download_picks_the_split(tmp_path, monkeypatch):
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "test.parquet"
    pq.write_table(pa.table({"url": ["u/7", "u/5"], "text": ["seven", "five"]}), path)
    files = ["README.md", "data/test-00000-of-00001.parquet", "data/train-00000-of-00010.parquet"]
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, repo_type: files)
    monkeypatch.setattr("kvbench.hub.hub_unreachable", lambda: None)  # the hub is this fake, reachable offline
    fetched = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name, repo_type: fetched.append(name) or str(path))
    assert [d.id for d in PG19Task().documents()] == ["5", "7"]
    assert fetched == ["data/test-00000-of-00001.parquet"]


def test_first_tokens_equals_tokenizing_the_whole_text(tokenizer):
    text = " ".join(f"word{i}" for i in range(3000))
    assert pg19_data.first_tokens(tokenizer, text, 500) == tokenizer(text).input_ids[:500]
    assert pg19_data.first_tokens(tokenizer, "short text", 500) == tokenizer("short text").input_ids


def test_task_evaluate_with_fullkv_equals_one_full_forward_of_the_documents_tokens():
    """The whole task path (essay tokens, prefill rule, records) on the tiny model: FullKV's streamed NLLs sum to a
    single full forward's."""
    from omegaconf import OmegaConf

    from kvbench.models import load_model, spec_from_config

    loaded = load_model(spec_from_config(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml")))
    task = PG19Task(source="essays", max_tokens=64, n_books=1)
    sample = task.samples(loaded.tokenizer)[0]
    ids = loaded.tokenizer(pg19_data.essays("pg19")[0].text).input_ids[:64]
    assert task._ids[sample.id] == ids
    new_session = lambda: CompressionSession(loaded.model, build_method({"name": "fullkv"}, FULL), FULL)  # noqa: E731
    record = task.evaluate([sample], EngineAnswerer(loaded, new_session, FULL))[0]
    with torch.no_grad():
        direct = -_full_forward_logprobs(loaded.model, ids).double()
    assert record["n_predicted"] == 63 and record["prompt_tokens"] == 1 and record["decode_steps"] == 62
    assert record["nll_sum"] == pytest.approx(float(direct.sum()), abs=1e-3)
    assert record["score"] == pytest.approx(math.exp(float(direct.mean())), rel=1e-5)
    k = record["curve"]["positions"][5]
    assert record["curve"]["cum_nll"][5] == pytest.approx(float(direct[:k].mean()), abs=1e-5)


def test_essays_job_on_the_tiny_model(tmp_path):
    scores, records = run_job_in(tmp_path, ["model=tiny-random", "task=pg19", "task.source=essays",
                                            "task.max_tokens=40", "task.n_books=2", "method=streamingllm", "budget=16"])
    assert [r["id"] for r in records] == ["essays/addiction", "essays/aord"]
    assert scores["score"] == round(math.exp(sum(r["nll_sum"] for r in records) / 78), 4)
    assert all(r["n_predicted"] == 39 and r["prompt_tokens"] == 16 and r["decode_steps"] == 23 for r in records)
    per_token = 4 * 2 * 16 * 2 * 4  # tiny-random: layers x kv heads x head dim x (K, V) x fp32 bytes
    assert all(r["resident_kv_bytes_final"] == 16 * per_token for r in records)  # held at the budget
    assert scores["curve"]["positions"][-1] == 39
    assert scores["decode_ms_per_token"] > 0


@pytest.mark.slow
def test_smollm2_essays_fullkv_snapkv_streamingllm(tmp_path):
    """SmolLM2 on a 160-token essay: SnapKV with the default prefill (= budget) never evicts (prefill-only), so it
    matches FullKV; StreamingLLM keeps 64 tokens and pays in perplexity."""
    common = ["task=pg19", "task.source=essays", "task.max_tokens=160", "task.n_books=1", "budget=64"]
    results = {}
    for method in ("fullkv", "snapkv", "streamingllm"):
        scores, records = run_job_in(tmp_path / method, [*common, f"method={method}"])
        results[method] = (scores["score"], records[0]["resident_kv_bytes_final"])
    per_token = 30 * 3 * 64 * 2 * 4
    assert results["fullkv"][1] == results["snapkv"][1] == 159 * per_token
    assert results["streamingllm"][1] == 64 * per_token
    assert results["snapkv"][0] == pytest.approx(results["fullkv"][0], rel=1e-3)
    assert results["streamingllm"][0] > results["fullkv"][0]
    assert np.isfinite(results["fullkv"][0]) and results["fullkv"][0] < 100
