"""``python -m kvbench.run``: compose -> validate -> skip if finished -> load -> run samples -> store -> table.

Everything the user can get wrong is checked before a model loads, and reported as one line with exit code 2.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.budget import Budget
from kvbench.config import CONF_DIR, register_resolvers
from kvbench.errors import ConfigError, DataError, KVBenchError, NotAvailableError

log = logging.getLogger("kvbench")
GROUPS = ("model", "method", "task", "launcher", "logger", "experiment")


# ---- fast checks on the command line (before Hydra composes anything) ---------------------------------------------
def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def precheck_overrides(argv: list[str]) -> None:
    """Reject unknown group options and malformed budgets in one line (Hydra would print a multi-line error).

    Every bad choice on the command line is named at once."""
    problems = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.partition("=")
        key = key.lstrip("+~")
        if key in GROUPS:
            options = _group_options(key)
            bad = [choice for choice in _split_sweep(value) if choice and choice not in options]
            problems += [_unknown_option_message(key, choice, options) for choice in bad]
        elif key == "budget":
            for choice in _split_sweep(value):
                Budget.parse(_yaml_scalar(choice))
    if problems:
        raise ConfigError("; ".join(problems))


def _split_sweep(value: str) -> list[str]:
    if value.startswith(("range(", "choice(", "glob(", "interval(")):
        return []  # Hydra sweep functions: let Hydra expand them
    return [v.strip() for v in value.split(",")]


def _yaml_scalar(text: str) -> Any:
    return OmegaConf.create({"v": text})["v"] if text else text


def _unknown_option_message(group: str, choice: str, options: list[str]) -> str:
    from kvbench.methods import METHODS
    from kvbench.tasks import TASKS

    registry = {"method": METHODS, "task": TASKS}.get(group)
    if registry is not None and choice in registry.pending:
        reason = registry.pending[choice]
        return f"{group} {choice!r} is not implemented yet ({reason}); available: {', '.join(options)}"
    return f"unknown {group} {choice!r}; valid {group}s: {', '.join(options)}"


# ---- the job -------------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """A fully validated job: everything needed to run it, nothing loaded yet."""

    cfg: DictConfig
    budget: Budget
    method: Any
    task: Any
    spec: Any
    key: dict[str, Any]
    parts: tuple[str, str, str, str]

    @property
    def budget_label(self) -> str:
        return self.parts[3]


def plan_job(cfg: DictConfig) -> Job:
    """Validate the composed config and build the job key. Never loads a model or data."""
    from kvbench.engine.options import POSITION_MODES
    from kvbench.methods import build_method
    from kvbench.models import spec_from_config
    from kvbench.tasks import build_task

    budget = Budget.parse(cfg.budget)
    method_cfg = OmegaConf.to_container(cfg.method, resolve=True)
    if method_cfg.get("name") == "fullkv":
        budget = Budget("full", float("inf"))
    missing, method, task = [], None, None
    try:
        method = build_method(method_cfg, budget)
    except NotAvailableError as exc:
        missing.append(str(exc).split("; implemented")[0])
    try:
        task = build_task(OmegaConf.to_container(cfg.task, resolve=True))
    except NotAvailableError as exc:
        missing.append(str(exc).split("; implemented")[0])
    if missing:  # say everything that is missing at once, not one piece per attempt
        raise NotAvailableError(" and ".join(missing))
    spec = spec_from_config(OmegaConf.to_container(cfg.model, resolve=True))
    if method.requires_cuda:
        _check_cuda_method(method.name, spec)
    if cfg.position_mode not in POSITION_MODES:
        raise ConfigError(f"position_mode={cfg.position_mode!r} is not valid; valid: {', '.join(POSITION_MODES)}")
    for name in ("batch_size", "seed"):
        value = cfg[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "batch_size" else 0):
            raise ConfigError(f"{name}={value!r} must be an integer >= {1 if name == 'batch_size' else 0}")
    if cfg.limit is not None and (not isinstance(cfg.limit, int) or cfg.limit < 1):
        raise ConfigError(f"limit={cfg.limit!r} must be a positive integer or null")
    if cfg.batch_size > 1 and not method.supports_batching:
        raise ConfigError(f"method {method.name!r} is defined per sequence; use batch_size=1 (got {cfg.batch_size})")
    label = method.budget_label(budget) or budget.label()  # POD's window, not the unused budget, names its jobs
    model_key = {k: v for k, v in asdict(spec).items() if k not in ("device", "notes")}
    key = {
        "kvbench_result_format": 1,
        "model": model_key,
        "method": method.describe(),
        "budget": label,
        "task": {**task.protocol(), "fields": _task_fields(task)},
        "position_mode": cfg.position_mode,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
    }
    return Job(cfg, budget, method, task, spec, key, (spec.name, task.name, method.name, label))


def _check_cuda_method(method: str, spec: Any) -> None:
    """A method that moves KV between host and GPU (``requires_cuda``) refuses a model that would run elsewhere."""
    from kvbench.models import resolve_device

    device = resolve_device(spec.device)
    if device != "cuda":
        why = "torch sees no CUDA device here" if spec.device == "auto" else f"model.device={spec.device!r}"
        raise NotAvailableError(
            f"method {method!r} needs the model on a CUDA device (it offloads KV to host memory and prefetches it "
            f"on a side CUDA stream); model {spec.name!r} would run on {device!r} ({why}); run it on a GPU machine "
            "with model.device=auto or cuda"
        )


def _task_fields(task: Any) -> dict[str, Any]:
    import dataclasses

    if not dataclasses.is_dataclass(task):
        return {}
    return {f.name: getattr(task, f.name) for f in dataclasses.fields(task) if f.name != "data_dir"}


def run_job(cfg: DictConfig, loaded: Any = None) -> dict[str, Any]:
    """Run (or resume, or skip) one job; returns its scores.

    ``loaded``: None loads the job's model here; a LoadedModel, or a callable ``spec -> LoadedModel`` (the sweep
    worker's model cache), shares a model that is already in memory. Timings never include the load."""
    import torch
    from tqdm import tqdm

    from kvbench.store import JobDir

    job = plan_job(cfg)
    results_dir = Path(cfg.paths.results_dir)
    jobdir = JobDir(results_dir, job.parts, job.key)
    done_scores = jobdir.finished_scores(cfg.limit)
    if done_scores is not None:
        log.info("finished already: %s", jobdir.path)
        _print_table(cfg, job, done_scores, jobdir, skipped=True)
        return done_scores

    from kvbench.engine import CompressionSession

    torch.manual_seed(cfg.seed)
    job.task.prepare_data()  # a missing download fails here, before the model loads
    with jobdir:
        shared = loaded is not None
        loaded = _obtain_model(job.spec, loaded)
        samples = job.task.samples(loaded.tokenizer)
        if cfg.limit is not None:
            samples = samples[: cfg.limit]
        records = jobdir.read_records(repair=True)
        done = {r["id"] for r in records}
        todo = [s for s in samples if s.id not in done]
        jobdir.write_config(OmegaConf.to_yaml(OmegaConf.create({"key": job.key, "resolved": _resolved(cfg)})))
        meta = _meta(job, jobdir.hash, loaded, cfg, started=time.time())
        meta["model"]["shared_load"] = shared  # loaded once by a sweep worker for several jobs (its record has it)
        jobdir.write_meta(meta)
        bar = tqdm(total=len(samples), initial=len(samples) - len(todo), desc=f"{job.method.name}@{job.budget_label}",
                   unit="sample", disable=None)
        def new_session() -> CompressionSession:
            return CompressionSession(loaded.model, job.method, job.budget, position_mode=cfg.position_mode)

        strict = bool(cfg.get("strict", False))
        jobdir.clear_errors()
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]
            try:
                done_records = _run_batch(job, batch, loaded, new_session)
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
                        done_records += _run_batch(job, [sample], loaded, new_session)
                    except (KVBenchError, torch.OutOfMemoryError):
                        raise
                    except Exception as row_exc:
                        log.error("sample %s failed: %s: %s", sample.id, type(row_exc).__name__, row_exc)
                        jobdir.append_error(_sample_error(sample, row_exc))
                        bar.update(1)
            for record in done_records:
                _append(jobdir, record)
                bar.update(1)
        bar.close()
        records = [r for r in jobdir.read_records() if r["id"] in {s.id for s in samples}]
        scores = _scores(job, records, samples, cfg)
        errors = jobdir.read_errors()
        scores["n_failed"] = len(errors)
        scores["failed_ids"] = [e["id"] for e in errors]
        if errors:
            log.error("%d sample(s) failed (ids in scores.json, causes in %s); the scores cover the others and a "
                      "rerun retries them", len(errors), jobdir.errors_path)
        meta.update(_meta_end(loaded, records, finished=time.time()))
        jobdir.write_meta(meta)
        jobdir.write_scores(scores)
    _log_wandb(cfg, job, scores, records, meta)
    _print_table(cfg, job, scores, jobdir, skipped=False)
    return scores


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


def _run_batch(job: Job, batch: list, loaded: Any, new_session: Any) -> list[dict[str, Any]]:
    """Records of one batch: the task's own evaluation, or generation then scoring."""
    from kvbench.engine import greedy_generate
    from kvbench.tasks.encoding import decode_prediction, encode_sample

    custom = job.task.evaluate(batch, loaded, new_session)  # perplexity / loglikelihood tasks
    if custom is not None:
        return [{**_RECORD_DEFAULTS, "batch_size": len(batch), **record} for record in custom]
    prompts = [encode_sample(job.task, s, loaded.tokenizer, job.spec) for s in batch]
    limits = [job.task.max_new_tokens_for(s) for s in batch]
    should_stop = _stop_checker([job.task.stop_strings_for(s) for s in batch], limits, loaded.tokenizer)
    with new_session() as sess:
        out = greedy_generate(loaded.model, prompts, max(limits), loaded.eos_token_ids,
                              loaded.tokenizer.pad_token_id, should_stop)
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
        }
        method_stats = job.method.sample_stats(row)
        if method_stats:
            record["method_stats"] = method_stats
        records.append(record)
    return records


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


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def _scores(job: Job, records: list[dict], samples: list, cfg: DictConfig) -> dict[str, Any]:
    from kvbench.store import ids_digest

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in records) / len(records) if records else float("nan")

    new_tokens = sum(r["new_tokens"] for r in records)
    decode_steps = sum(r["decode_steps"] / r["batch_size"] for r in records)
    return {
        "model": job.spec.name,
        "method": job.method.name,
        "budget": job.budget_label,
        "task": job.task.name,
        "task_version": job.task.version,
        "metric": job.task.metric,
        **job.task.aggregate(records),
        "n_samples": len(records),
        "limit": cfg.limit,
        "sample_ids_digest": ids_digest([s.id for s in samples]),
        "resident_kv_bytes_mean": mean("resident_kv_bytes"),
        "prompt_tokens_mean": mean("prompt_tokens"),
        "prefill_seconds_mean": mean("prefill_seconds"),
        "decode_ms_per_token": (
            1000 * sum(r["decode_seconds"] for r in records) / decode_steps if decode_steps else None
        ),
        "new_tokens_total": new_tokens,
    }


def _git_sha() -> str | None:
    import subprocess

    from kvbench.config import project_root

    try:
        sha = subprocess.run(["git", "-C", project_root(), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        dirty = subprocess.run(["git", "-C", project_root(), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _meta(job: Job, job_hash: str, loaded: Any, cfg: DictConfig, started: float) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    import kvbench

    hardware = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        hardware["cuda_device"] = torch.cuda.get_device_name(0)
    return {
        "job_hash": job_hash,
        "git_sha": _git_sha(),
        "versions": {"kvbench": kvbench.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "hardware": hardware,
        "device": loaded.device,
        "protocol": job.task.protocol(),
        "method": job.method.describe(),
        "budget": {"kind": job.budget.kind, "value": job.budget.value, "label": job.budget_label},
        "model": {"name": job.spec.name, "layers": loaded.num_layers, "heads": loaded.num_heads,
                  "kv_heads": loaded.num_kv_heads, "head_dim": loaded.head_dim, "dtype": str(loaded.model.dtype),
                  "load_seconds": loaded.load_seconds},
        "seed": cfg.seed,
        "started": started,
    }


def _meta_end(loaded: Any, records: list[dict], finished: float) -> dict[str, Any]:
    import torch

    peak = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        peak["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return {
        "finished": finished,
        "peak_memory": peak,
        "timings": {
            "prefill_seconds_total": sum(r["prefill_seconds"] for r in records),
            "decode_seconds_total": sum(r["decode_seconds"] for r in records),
        },
        "resident_kv_bytes_mean": sum(r["resident_kv_bytes"] for r in records) / max(1, len(records)),
    }


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
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(str(v).ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    note = " (finished earlier; skipped)" if skipped else ""
    header = f"\n{job.spec.name}: {scores['n_samples']} samples{note}\n"
    print(header + "\n".join(lines) + f"\nresults: {jobdir.path}\n")


# ---- entry points ----------------------------------------------------------------------------------------------------
@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if cfg.get("sweep_chunk"):  # a worker launched by kvbench's sweeper: several jobs, one model load
        from kvbench.sweep.worker import run_worker

        return run_worker(cfg.sweep_chunk)
    if cfg.plan:  # list this one job and its state in the store; run nothing
        from kvbench.sweep.plan import format_listing, plan_config

        print(format_listing([plan_config(cfg)]))
        return None
    try:
        scores = run_job(cfg)
    except KVBenchError as exc:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            log.error("job failed: %s", exc)
            return None
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    return scores.get("score")


def _expose_hydra_plugins() -> None:
    """Make this checkout's ``hydra_plugins`` (kvbench's sweeper and launchers) visible to Hydra's plugin scan.

    A regular install puts ``hydra_plugins/kvbench_sweep`` into site-packages. An editable install (``pip install
    -e .``) maps the ``kvbench`` package only, so outside the checkout Hydra would not find the sweeper ("Unknown
    plugin class"). Then the checkout's root goes to the end of ``sys.path`` and of ``PYTHONPATH`` (submitit's
    worker processes unpickle the launcher from there)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    if not (root / "hydra_plugins" / "kvbench_sweep").is_dir() or importlib.util.find_spec(
            "hydra_plugins.kvbench_sweep") is not None:
        return
    sys.path.append(str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(root)) if p)


def main() -> None:
    register_resolvers()
    _expose_hydra_plugins()
    try:
        precheck_overrides(sys.argv[1:])
    except KVBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if _is_sweep(sys.argv[1:]):  # a paper's table names baselines that have not landed: list them, do not fail
        from kvbench.sweep.pending import register_pending_placeholders

        register_pending_placeholders()
    _hydra_main()
    sweeper = sys.modules.get("kvbench.sweep.sweeper")
    if sweeper is not None and sweeper.sweep_exit_code():
        sys.exit(sweeper.sweep_exit_code())


def _is_sweep(argv: list[str]) -> bool:
    """-m, or an experiment (experiments set hydra.mode=MULTIRUN)."""
    return any(a in ("-m", "--multirun") or a.lstrip("+").startswith("experiment=") for a in argv)


if __name__ == "__main__":
    main()
