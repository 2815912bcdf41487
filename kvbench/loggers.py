"""``logger=wandb``: one W&B run per finished job, grouped by sweep (an experiment becomes one dashboard group).

Logged: the config (the job key and the resolved config), the task's scores (every numeric leaf of scores.json,
e.g. ``scores/datasets/hotpotqa``), efficiency figures (resident KV bytes, prefill seconds, decode ms per token,
peak memory, model load seconds) and a per-sample table. Offline unless ``WANDB_API_KEY`` is set or
``logger.mode=online`` (conf/logger/wandb.yaml); offline runs land under ``<results>/logs/wandb`` and
``wandb sync`` uploads them later.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

SAMPLE_COLUMNS = ("id", "score", "prediction", "answers", "prompt_tokens", "new_tokens", "resident_kv_bytes",
                  "prefill_seconds", "decode_seconds", "attended_tokens_mean")
EFFICIENCY_KEYS = ("resident_kv_bytes_mean", "prompt_tokens_mean", "prefill_seconds_mean", "decode_ms_per_token",
                   "new_tokens_total")


def flatten_numbers(tree: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Numeric leaves of a nested mapping as ``prefix/a/b`` keys (bools and strings left out)."""
    out: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out.update(flatten_numbers(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


def job_metrics(scores: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, float]:
    """What a job logs: its scores under ``scores/`` and its efficiency figures under ``efficiency/``."""
    task_scores = {k: v for k, v in scores.items() if k not in EFFICIENCY_KEYS}
    metrics = flatten_numbers(task_scores, "scores")
    metrics.update({f"efficiency/{k}": scores[k] for k in EFFICIENCY_KEYS if isinstance(scores.get(k), (int, float))})
    metrics.update(flatten_numbers(meta.get("peak_memory", {}), "efficiency/peak_memory"))
    metrics.update(flatten_numbers(meta.get("timings", {}), "efficiency/timings"))
    load = (meta.get("model") or {}).get("load_seconds")
    if isinstance(load, (int, float)):
        metrics["efficiency/model_load_seconds"] = load
    return metrics


def log_job_to_wandb(cfg: DictConfig, job: Any, scores: dict[str, Any], records: list[dict[str, Any]],
                     meta: dict[str, Any]) -> None:
    import wandb

    model, task, method, budget = job.parts
    group = cfg.logger.group or cfg.get("sweep_name")
    run = wandb.init(
        project=cfg.logger.project, entity=cfg.logger.entity, mode=cfg.logger.mode, group=group, job_type=task,
        name=f"{model}/{task}/{method}/{budget}", tags=[*cfg.logger.tags, model, task, method],
        config={"job_hash": meta.get("job_hash"), "key": job.key,
                "resolved": OmegaConf.to_container(cfg, resolve=True)},
        dir=str(Path(cfg.paths.log_dir)), reinit="finish_previous",
    )
    metrics = job_metrics(scores, meta)
    run.log(metrics)
    run.summary.update({**metrics, "score": scores.get("score"), "metric": scores.get("metric"),
                        "n_samples": scores.get("n_samples"), "job_hash": meta.get("job_hash")})
    rows = [[_cell(r.get(c)) for c in SAMPLE_COLUMNS] for r in records]
    run.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)})
    run.finish()


def _cell(value: Any) -> Any:
    """W&B table cells: lists and dicts as text (answers are lists of strings)."""
    if isinstance(value, (list, dict)):
        import json

        return json.dumps(value, ensure_ascii=False)
    return value
