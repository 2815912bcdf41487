"""Run (or resume, or skip) one planned job: load the model, run the samples not yet recorded batch by batch, append
each record as it finishes, then write the scores and the meta. The command line (``kvbench.run``), the sweep worker
and the tests call ``run_job``; it never calls them."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.errors import DataError, KVBenchError
from kvbench.jobs.answer import EngineAnswerer
from kvbench.jobs.plan import Job, plan_job, staged
from kvbench.jobs.records import job_meta, job_meta_end, job_scores, resolved_config

log = logging.getLogger("kvbench")


def _finished(cfg: DictConfig, job: Any, jobdir: Any) -> dict[str, Any] | None:
    """The scores of a job that is finished already (logged and its table printed as skipped), else None."""
    scores = jobdir.finished_scores(cfg.limit)
    if scores is not None:
        log.info("finished already: %s", jobdir.path)
        _print_table(cfg, job, scores, jobdir, skipped=True)
    return scores


def run_job(cfg: DictConfig, loaded: Any = None, prepared: Job | None = None) -> dict[str, Any]:
    """Run (or resume, or skip) one job; returns its scores.

    ``loaded``: None loads the job's model here; a LoadedModel, or a callable ``spec -> LoadedModel`` (the sweep
    worker's model cache), shares a model that is already in memory. Timings never include the load.
    ``prepared``: the same job as the caller planned it and passed through ``refuse_before_loading`` (kvbench.run's
    preflight): its task, whose data is read already, is used instead of preparing the data a second time; a job
    with another key or task config is ignored."""
    import torch
    from tqdm import tqdm

    from kvbench.store import JobDir

    job = plan_job(cfg)
    data_ready = prepared is not None and same_task(prepared, job)
    if data_ready:
        job.task = prepared.task
    results_dir = Path(cfg.paths.results_dir)
    jobdir = JobDir(results_dir, job.parts, job.key)
    done_scores = _finished(cfg, job, jobdir)
    if done_scores is not None:
        return done_scores
    refuse_before_loading(job, jobdir, data_ready=data_ready)

    from kvbench.engine import CompressionSession

    torch.manual_seed(cfg.seed)
    with jobdir, _interruptible(jobdir) as progress:
        done_scores = _finished(cfg, job, jobdir)  # another process may have finished it before this one took the lock
        if done_scores is not None:
            return done_scores
        shared = loaded is not None
        try:
            loaded = _obtain_model(job.spec, loaded)
            samples = job.task.samples(loaded.tokenizer)
        except KVBenchError:  # a model or data refused while loading: no empty job directory is left behind
            jobdir.discard_if_empty()
            raise
        lengths = _job_lengths(job, samples, loaded)  # before the limit: a sample's slots are the whole job's
        if cfg.limit is not None:
            samples = samples[: cfg.limit]  # a limit counts prompts; each is n rows when sampled
        samples, rows_of = expand_samples(samples, job.sampling, cfg.seed)
        progress["planned"] = len(samples)
        records = jobdir.read_records(repair=True)
        done = {r["id"] for r in records}
        todo = [s for s in samples if s.id not in done]
        meta = job_meta(job, jobdir.hash, loaded, cfg, started=time.time())
        meta["model"]["shared_load"] = shared  # loaded once by a sweep worker for several jobs (its record has it)
        if todo or not (jobdir.path / "meta.json").exists():  # a run that adds nothing leaves the job's files alone
            jobdir.set_aside_scores(cfg.limit)  # a summary of another limit would describe a subset of the records
            jobdir.write_config(OmegaConf.to_yaml(OmegaConf.create({"key": job.key,
                                                                    "resolved": resolved_config(cfg)})))
            jobdir.write_meta(meta)
        bar = tqdm(total=len(samples), initial=len(samples) - len(todo), desc=f"{job.method.name}@{job.budget_label}",
                   unit="sample", disable=None)
        def new_session() -> CompressionSession:
            return CompressionSession(loaded.model, job.method, job.budget, position_mode=cfg.position_mode,
                                      tokenizer=loaded.tokenizer,
                                      sliding_layers=cfg.get("sliding_layers", "auto"),
                                      compile=job.decode == "graph", job_lengths=lengths,
                                      job_rows=None if lengths is None else min(cfg.batch_size, len(todo)))

        answerer = EngineAnswerer(loaded, new_session, job.budget)  # answers the requests of tasks with own loops
        strict = bool(cfg.get("strict", False))
        jobdir.clear_errors()
        try:
            for start in range(0, len(todo), cfg.batch_size):
                batch = todo[start : start + cfg.batch_size]
                try:
                    done_records = _run_batch(job, batch, loaded, new_session, answerer, rows_of)
                except (KVBenchError, torch.OutOfMemoryError):
                    raise  # the user's input or the machine: the whole job stops (a sweep records it)
                except Exception as exc:
                    if strict:
                        raise
                    done_records = []
                    for sample in batch:  # isolate the failing sample(s): a batch's rows are retried alone once
                        try:
                            if len(batch) == 1:
                                raise exc
                            done_records += _run_batch(job, [sample], loaded, new_session, answerer, rows_of)
                        except (KVBenchError, torch.OutOfMemoryError):
                            raise
                        except Exception as row_exc:
                            log.error("sample %s failed: %s: %s", sample.id, type(row_exc).__name__, row_exc)
                            jobdir.append_error(_sample_error(sample, row_exc))
                            bar.update(1)
                for record in done_records:
                    _append(jobdir, record)
                    bar.update(1)
        except KVBenchError:
            jobdir.discard_if_empty()  # stopped before its first record: nothing is stored (earlier records stay)
            raise
        bar.close()
        stored = jobdir.read_records()
        records = [r for r in stored if r["id"] in {s.id for s in samples}]
        # the job's summary describes all its stored records; a limit run over fewer writes its own beside it
        subset = cfg.limit is not None and len(records) < len(stored)
        scores = job_scores(job, records, samples, cfg)
        errors = jobdir.read_errors()
        scores["n_failed"] = len(errors)
        scores["failed_ids"] = [e["id"] for e in errors]
        if errors:
            log.error("%d sample(s) failed (ids in scores.json, causes in %s); the scores cover the others and a "
                      "rerun retries them", len(errors), jobdir.errors_path)
        if subset:
            jobdir.write_subset_scores(scores)
            log.info("limit=%d covers %d of the job's %d stored records: its scores are in %s (scores.json, which "
                     "describes them all, is unchanged)", cfg.limit, len(records), len(stored),
                     jobdir.subset_scores_path(cfg.limit))
        else:
            meta.update(job_meta_end(loaded, records, finished=time.time()))
            jobdir.write_meta(meta)
            jobdir.write_scores(scores)
    _log_wandb(cfg, job, scores, records, meta)
    _print_table(cfg, job, scores, jobdir, skipped=False)
    return scores


def _job_lengths(job: Job, samples: list, loaded: Any) -> tuple[int, int] | None:
    """For a captured decode (``engine.decode=graph``) of a generate-then-score task: the longest prompt of every
    sample of the job (as ``encode_sample`` feeds it) and the most new tokens any of them may take. The session sizes
    the layers whose slot count follows the prompt (FullKV, ratio budgets, prompts within the budget) for these, so
    the job's samples replay one compiled graph over the same buffers; without them each bucket of 256 prompt tokens
    would compile a graph of its own (a minute of inductor per graph for an 8B model), in the job's order, and a
    bucket met again after another would record its CUDA graph again over new buffers. None for an eager decode, a
    staged job and a task with its own evaluation loop (its requests are not the samples' prompts)."""
    from kvbench.tasks.base import Task
    from kvbench.tasks.encoding import encode_sample

    if job.decode != "graph" or staged(job.cfg) or type(job.task).evaluate is not Task.evaluate or not samples:
        return None
    longest = max(len(encode_sample(job.task, s, loaded.tokenizer, job.spec)) for s in samples)
    return longest, max(job.task.max_new_tokens_for(s) for s in samples)


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C during a job, with what it kept: ``python -m kvbench.run`` prints it as one line and exits 130. A
    KeyboardInterrupt still, so whatever stops on Ctrl-C (a sweep, a test runner) stops on it."""


@contextlib.contextmanager
def _interruptible(jobdir: Any):
    """Turn Ctrl-C inside a job into ``JobInterrupted`` saying how many of its records are kept (all finished
    records are on disk: each is fsynced as it finishes) and that a rerun resumes."""
    progress: dict[str, int] = {}
    try:
        yield progress
    except KeyboardInterrupt:
        try:
            kept = len(jobdir.read_records())
        except KVBenchError:
            kept = 0
        if not kept:
            jobdir.discard_if_empty()
        planned = f" of {progress['planned']}" if "planned" in progress else ""
        raise JobInterrupted(f"interrupted: {kept}{planned} records are kept in {jobdir.path}; run the same command "
                             "again to resume") from None


def same_task(prepared: Job, job: Job) -> bool:
    """Whether ``prepared`` is ``job`` planned earlier with the same task config (``task.data_dir`` included, which
    the job key leaves out), so that its task's data serves ``job``."""
    return prepared.key == job.key and (OmegaConf.to_container(prepared.cfg.task, resolve=True)
                                        == OmegaConf.to_container(job.cfg.task, resolve=True))


def refuse_before_loading(job: Job, jobdir: Any, data_ready: bool = False) -> None:
    """Refusals made before the model loads (``kvbench.run`` makes them before Hydra too, for one job): a model family
    whose attention no method can reach (known from its local config or hub id, without the network), a corrupted
    record (one line pointing at ``store verify --clean``), a job another process is running, missing task data (a
    download fails here; skipped with ``data_ready``: the task's data was prepared by an earlier call)."""
    from kvbench.models.loading import refuse_known_architecture
    from kvbench.store import JobLockedError

    refuse_known_architecture(job.spec)
    job.method.fetch_assets()  # a named file (TriAttention's statistics) cached or downloaded, else one line
    jobdir.read_records()
    if jobdir.lock_held():  # another process runs it: say so now, not after this one has loaded the model
        raise JobLockedError(f"job {jobdir.path} is being run by another process; skipping it")
    if not data_ready:
        job.task.prepare_data()


def _obtain_model(spec: Any, loaded: Any) -> Any:
    """The job's model: loaded here, taken from the caller's model cache, or the caller's loaded model."""
    from kvbench.models import load_model

    if loaded is None:
        return load_model(spec)
    if callable(loaded):
        return loaded(spec)
    if loaded.spec != spec:
        raise ValueError(f"the model passed in is {loaded.spec.name!r} but the job needs {spec.name!r} ({spec})")
    return loaded


@dataclass(frozen=True)
class Row:
    """Where a row of a sampled job comes from: the prompt's sample id, the row's index among its n, its seed."""

    sample_of: str
    index: int
    seed: int


def expand_samples(samples: list, sampling: Any, job_seed: int) -> tuple[list, dict[str, Row]]:
    """The rows a job generates: its samples as they are when greedy; when sampled, each sample ``n`` times (ids
    ``<id>#<k>`` for n > 1, the id unchanged for n == 1), in prompt order, with each row's ``Row`` by id (its seed
    from ``sample_seed``: the same whatever the batch, the order of work or a resume)."""
    from dataclasses import replace

    from kvbench.engine.sampling import sample_seed

    if sampling is None:
        return samples, {}
    rows, rows_of = [], {}
    for sample in samples:
        for k in range(sampling.n):
            row = sample if sampling.n == 1 else replace(sample, id=f"{sample.id}#{k}")
            if row.id in rows_of:
                raise DataError(f"sample id {row.id!r} occurs twice in the task's samples (n={sampling.n})")
            rows.append(row)
            rows_of[row.id] = Row(sample.id, k, sample_seed(job_seed, sample.id, k))
    return rows, rows_of


def _run_batch(job: Job, batch: list, loaded: Any, new_session: Any, answerer: Any,
               rows_of: dict[str, Row] | None = None) -> list[dict[str, Any]]:
    """Records of one batch: the task's own evaluation (its requests answered by ``answerer``), or generation then
    scoring. ``rows_of``: a sampled job's rows (``expand_samples``), whose seeds the generation draws with."""
    from kvbench.engine import greedy_generate
    from kvbench.tasks.encoding import decode_prediction, encode_sample

    custom = job.task.evaluate(batch, answerer)  # perplexity / loglikelihood tasks, LongBench v2's CoT
    if custom is not None:
        return [{**_RECORD_DEFAULTS, "batch_size": len(batch), **record} for record in custom]
    if staged(job.cfg):
        return [_run_staged(job, sample, loaded, new_session) for sample in batch]
    prompts = [encode_sample(job.task, s, loaded.tokenizer, job.spec) for s in batch]
    limits = [job.task.max_new_tokens_for(s) for s in batch]
    should_stop = _stop_checker([job.task.stop_strings_for(s) for s in batch], limits, loaded.tokenizer)
    rows = [rows_of[s.id] for s in batch] if job.sampling is not None else None
    with new_session() as sess:
        out = greedy_generate(loaded.model, prompts, max(limits), loaded.eos_token_ids,
                              loaded.tokenizer.pad_token_id, should_stop, sampling=job.sampling,
                              seeds=[r.seed for r in rows] if rows else None)
    stats = sess.stats
    records = []
    for row, sample in enumerate(batch):
        raw = decode_prediction(job.task, out.tokens[row], loaded.tokenizer, sample)
        prediction = job.task.postprocess(raw, sample)
        record = {
            "id": sample.id,
            "prediction": prediction,
            "raw_prediction": raw,
            "answers": sample.answers,
            "score": job.task.score(prediction, sample),
            "meta": sample.meta,
            "prompt_tokens": len(prompts[row]),
            "new_tokens": len(out.tokens[row]),
            "prefill_seconds": out.prefill_seconds / len(batch),
            "decode_seconds": out.decode_seconds / len(batch),
            "decode_steps": out.decode_steps,
            "batch_size": len(batch),
            "resident_kv_bytes": stats.resident_kv_bytes_after_prefill // len(batch),
            "resident_kv_bytes_final": out.resident_kv_bytes_final // len(batch),
            "layer_entries": stats.layer_entries_after_prefill,
            "attended_tokens_mean": round(stats.attended_tokens_mean, 2),
            # [decode step, entries per layer] where the slope changes (SessionStats.resident_curve): a saw-tooth
            # under decode_compression, two points for a cache that only grows
            "resident_kv_curve": stats.resident_curve,
        }
        if rows is not None:  # sampled: where the row comes from, its seed, and the answer maj@n votes with
            record.update(sample_of=rows[row].sample_of, sample_index=rows[row].index, seed=rows[row].seed,
                          answer_key=job.task.majority_key(prediction, sample))
        method_stats = job.method.sample_stats(row)
        if method_stats:
            record["method_stats"] = method_stats
        records.append(record)
    return records


def _run_staged(job: Job, sample: Any, loaded: Any, new_session: Any) -> dict[str, Any]:
    """The record of one sample under question=after_compression (and turns=N): the context is prefilled and
    compressed alone, then each turn's question is a continued forward (``engine.generate.staged_generate``)."""
    from dataclasses import replace

    from kvbench.engine.generate import staged_generate
    from kvbench.tasks.encoding import decode_prediction, encode_follow_up, encode_split

    task, tokenizer = job.task, loaded.tokenizer
    turns = int(job.cfg.get("turns", 1))
    if len(sample.follow_ups) < turns - 1 or (turns > 1 and len(sample.turn_answers) < turns):
        raise ValueError(f"sample {sample.id!r} has {len(sample.follow_ups) + 1} question(s); turns={turns}")
    context, question = encode_split(task, sample, tokenizer, job.spec)
    feeds = [question] + [encode_follow_up(task, sample, k, tokenizer, job.spec) for k in range(1, turns)]
    views = [replace(sample, answers=sample.turn_answers[k]) if turns > 1 else sample for k in range(turns)]
    limits = [task.max_new_tokens_for(v) for v in views]
    checker = _stop_checker([task.stop_strings_for(v) for v in views], limits, tokenizer)
    with new_session() as sess:
        out = staged_generate(loaded.model, context, feeds, limits, loaded.eos_token_ids, checker,
                              history=job.cfg.get("turn_history", "keep"))
    stats = sess.stats
    per_turn = []
    for k, (view, turn) in enumerate(zip(views, out.turns)):
        raw = decode_prediction(task, turn.tokens, tokenizer, view)
        prediction = task.postprocess(raw, view)
        per_turn.append({
            "turn": k + 1, "prediction": prediction, "raw_prediction": raw, "answers": view.answers,
            "score": task.score(prediction, view), "fed_tokens": turn.fed_tokens, "new_tokens": len(turn.tokens),
            "question_seconds": turn.question_seconds, "decode_seconds": turn.decode_seconds,
            "resident_after_question": turn.layer_entries_after_question,
            "resident_kv_bytes_after_question": turn.resident_kv_bytes_after_question,
            "resident_final": turn.layer_entries_final, "resident_kv_bytes_final": turn.resident_kv_bytes_final,
        })
    first, last = out.turns[0], out.turns[-1]
    record = {
        "id": sample.id,
        "prediction": per_turn[0]["prediction"],
        "raw_prediction": per_turn[0]["raw_prediction"],
        "answers": sample.answers,
        # one score per sample: the mean over its turns (each turn's in turn_scores)
        "score": sum(t["score"] for t in per_turn) / len(per_turn),
        "meta": sample.meta,
        "prompt_tokens": len(context) + len(question),
        "context_tokens": len(context),
        "question_tokens": len(question),
        "new_tokens": sum(len(t.tokens) for t in out.turns),
        "prefill_seconds": out.prefill_seconds + first.question_seconds,
        "decode_seconds": sum(t.decode_seconds for t in out.turns),
        "decode_steps": sum(t.decode_steps for t in out.turns),
        "batch_size": 1,
        # resident KV after the context's compression (what "resident_kv_bytes" means for every job) ...
        "resident_kv_bytes": out.resident_kv_bytes_after_compression,
        "resident_kv_bytes_final": last.resident_kv_bytes_final,
        "layer_entries": out.layer_entries_after_compression,
        "resident_after_compression": out.layer_entries_after_compression,
        # ... and after the question joined the cache (entries per layer)
        "resident_after_question": first.layer_entries_after_question,
        "resident_kv_bytes_after_question": first.resident_kv_bytes_after_question,
        "attended_tokens_mean": round(stats.attended_tokens_mean, 2),
    }
    if turns > 1:
        record["turn_scores"] = [t["score"] for t in per_turn]
        record["turns"] = per_turn
    method_stats = job.method.sample_stats(0)
    if method_stats:
        record["method_stats"] = method_stats
    return record


def _sample_error(sample: Any, exc: BaseException) -> dict[str, Any]:
    import traceback

    return {"id": sample.id, "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc)[-6:]), "time": time.time()}


def _append(jobdir: Any, record: dict[str, Any]) -> None:
    """Append a record; a full disk is the user's problem to fix, said in one line (earlier records are intact)."""
    import errno

    try:
        jobdir.append_record(record)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"no space left on the device writing {jobdir.samples_path}; the records written "
                            "before are intact, free space and run the job again to resume") from None
        raise


_RECORD_DEFAULTS = {
    "prediction": "", "answers": [], "prompt_tokens": 0, "new_tokens": 0, "prefill_seconds": 0.0,
    "decode_seconds": 0.0, "decode_steps": 0, "resident_kv_bytes": 0, "resident_kv_bytes_final": 0,
    "layer_entries": [], "attended_tokens_mean": 0.0,
}


def _stop_checker(stops: list[list[str]], limits: list[int], tokenizer: Any):
    """A row stops at its own token limit, or once its last few tokens decode to text containing one of its stop
    strings (rows of a batch may come from sub-datasets with different protocols)."""

    def should_stop(row: int, tokens: list[int]) -> bool:
        if len(tokens) >= limits[row]:
            return True
        return bool(stops[row]) and any(stop in tokenizer.decode(tokens[-8:]) for stop in stops[row])

    return should_stop


def _log_wandb(cfg: DictConfig, job: Job, scores: dict, records: list[dict], meta: dict) -> None:
    if cfg.logger.name != "wandb":
        return
    from kvbench.loggers import log_job_to_wandb

    log_job_to_wandb(cfg, job, scores, records, meta)


def _print_table(cfg: DictConfig, job: Job, scores: dict, jobdir: Any, skipped: bool) -> None:
    if not cfg.print_table:
        return
    ms = scores.get("decode_ms_per_token")
    rows = [
        ("method", "budget", "task", scores.get("metric", "score"), "resident KV bytes", "prefill s", "decode ms/tok"),
        (scores["method"], scores["budget"], scores["task"], f"{scores['score']:.2f}",
         f"{scores['resident_kv_bytes_mean']:,.0f}", f"{scores['prefill_seconds_mean']:.2f}",
         "-" if ms is None else f"{ms:.1f}"),
    ]
    if "pass@1" in scores:  # a sampled job: pass@1 and maj@n over its n samples per prompt, and the output length
        n = scores.get("n_samples_per_prompt", 1)
        rows[0] = rows[0][:4] + ("pass@1", f"maj@{n}", "output tokens") + rows[0][4:]
        rows[1] = rows[1][:4] + (f"{scores['pass@1']:.4f}", f"{scores['maj@n']:.4f}",
                                 f"{scores['new_tokens_mean']:.1f}") + rows[1][4:]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    note = " (finished earlier; skipped)" if skipped else ""
    per = f" ({scores['n_prompts']} prompts x {scores['n_samples_per_prompt']})" if "pass@1" in scores else ""
    header = f"\n{job.spec.name}: {scores['n_samples']} samples{per}{note}\n"
    print(header + "\n".join(lines) + f"\nresults: {jobdir.path}\n")
