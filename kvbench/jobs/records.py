"""What a job writes besides its records: ``scores.json`` (the task's aggregate over the records plus the efficiency
means: ``record_scores``, which ``kvbench.store verify`` recomputes from samples.jsonl) and ``meta.json`` (versions,
hardware, the engine's reading of the model, timings, memory)."""

from __future__ import annotations

import os
import resource
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.config import git_sha
from kvbench.jobs.plan import Job
from kvbench.store.scores import record_scores


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def job_scores(job: Job, records: list[dict], samples: list, cfg: DictConfig) -> dict[str, Any]:
    from kvbench.store import ids_digest

    return {
        "model": job.spec.name,
        "method": job.method.name,
        "budget": job.budget_label,
        "task": job.task.name,
        "task_version": job.task.version,
        "metric": job.task.metric,
        **record_scores(job.task, records),
        "limit": cfg.limit,
        "sample_ids_digest": ids_digest([s.id for s in samples]),
    }


def job_meta(job: Job, job_hash: str, loaded: Any, cfg: DictConfig, started: float) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    import kvbench
    from kvbench.engine.architecture import describe as describe_layers

    hardware = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        hardware["cuda_device"] = torch.cuda.get_device_name(0)
    return {
        "job_hash": job_hash,
        "git_sha": git_sha(),
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
        # question placement and turns: only when not the defaults (as in the job key)
        **({"question": job.key["question"]} if "question" in job.key else {}),
        **({"turns": job.key["turns"], "turn_history": job.key["turn_history"]} if "turns" in job.key else {}),
        # sampled decoding (as in the job key; absent when greedy), each row's seed is in its record
        **({"sampling": job.key["sampling"]} if "sampling" in job.key else {}),
        # how each layer attends (full / sliding<w>) and which layers the method compresses (sliding_layers policy)
        "engine": describe_layers(loaded.model, cfg.get("sliding_layers", "auto")),
        "started": started,
    }


def job_meta_end(loaded: Any, records: list[dict], finished: float) -> dict[str, Any]:
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
