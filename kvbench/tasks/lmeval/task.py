"""lm-evaluation-harness tasks run on kvbench's compressed model, one document per record (resumable).

What lm-eval's ``simple_evaluate`` + ``evaluate`` do, done per document so that kvbench's runner can store and resume
records: the task is built from lm-eval's own YAML (prompts, few-shot sampler, filters, ``process_results``,
aggregation) with ``num_fewshot`` and the few-shot seed set as ``simple_evaluate`` sets them (default seed 1234);
``build_all_requests`` builds every document's requests once (so ``limit=N`` gives the contexts lm-eval's
``--limit N`` gives); per document the requests go through ``KVBenchLM``, then every filter ensemble, then
``task.process_results`` per filter; the aggregate is lm-eval's ``_compute_task_aggregations`` over the stored
per-document values (``"metric,filter"`` keys and ``_stderr``, as lm-eval reports them). Nothing of lm-eval's
prompts or scorers is rewritten. reference/benchmarks.md section 6; README.md in this folder.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvbench.errors import ConfigError, DataError
from kvbench.hub import failure
from kvbench.tasks import check_bool, check_int, check_str, protocol_fields
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.lmeval import data
from kvbench.tasks.lmeval.harness import BOOTSTRAP_ITERS, SPLIT_KEYS, plain, read_task_yaml, tasks_dir


@dataclass
class LMEvalTask(Task):
    """One lm-eval task; subclasses name the lm-eval tasks they accept (``LM_EVAL_TASKS``: name -> (YAML path in
    ``lm_eval/tasks``, local-file layout in ``data.FILES``, default primary metric)).

    lm_eval_task: the lm-eval task name.
    primary_metric: ``"metric,filter"`` reported as ``score`` (null: the default of ``lm_eval_task``).
    num_fewshot: null = the YAML's (lm-eval's default); a task fixed at 0 shots in its YAML refuses others.
    fewshot_seed: ``simple_evaluate``'s ``fewshot_random_seed`` (1234).
    data_dir: local files (``data.FILES``); null = the hub dataset, as lm-eval loads it.
    gen_kwargs: lm-eval's ``--gen_kwargs``: null, or a mapping that updates the YAML's ``generation_kwargs`` (e.g.
        ``task.gen_kwargs={max_gen_toks:64}``); sampling is refused.
    max_gen_toks: HFLM's default generation length where the generation kwargs set none (256).
    max_length: context + generation limit (HFLM ``max_length``); null = the model's ``context_length``.
    apply_chat_template: lm-eval's ``--apply_chat_template`` (false: plain prompts, as D2O and lm-eval's default).
    """

    version: ClassVar[str] = "1"
    LM_EVAL_TASKS: ClassVar[dict[str, tuple[str, str, str]]] = {}

    lm_eval_task: str = ""
    primary_metric: str | None = None
    num_fewshot: int | None = None
    fewshot_seed: int = 1234
    data_dir: str | None = None
    gen_kwargs: dict[str, Any] | None = None
    max_gen_toks: int = 256
    max_length: int | None = None
    apply_chat_template: bool = False

    def __post_init__(self) -> None:
        self._task: Any = None
        self._docs: dict[int, Any] = {}
        self._instances: dict[int, list[Any]] = {}
        self._lm: Any = None

    # ---- configuration ----
    @property
    def metric(self) -> str:  # type: ignore[override]
        return self.primary_metric or self.LM_EVAL_TASKS.get(self.lm_eval_task, ("", "", "score"))[2]

    def yaml_path(self) -> Path:
        return tasks_dir() / self.LM_EVAL_TASKS[self.lm_eval_task][0]

    def validate(self) -> None:
        check_str(self.name, "lm_eval_task", self.lm_eval_task, tuple(self.LM_EVAL_TASKS))
        cfg = read_task_yaml(self.yaml_path())  # NotAvailableError first when lm-eval is missing
        metrics = [m["metric"] for m in cfg.get("metric_list") or []]
        filters = [f["name"] for f in cfg.get("filter_list") or []] or ["none"]
        metric, _, filt = self.metric.partition(",")
        if metric not in metrics or filt not in filters:
            valid = ", ".join(f"{m},{f}" for f in filters for m in metrics)
            raise ConfigError(f"task {self.name!r}: primary_metric={self.metric!r} is not reported by lm-eval task "
                              f"{self.lm_eval_task!r}; valid: {valid}")
        if self.num_fewshot is not None:
            check_int(self.name, "num_fewshot", self.num_fewshot, minimum=0)
            if cfg.get("num_fewshot") == 0 and self.num_fewshot != 0:
                raise ConfigError(f"task {self.name!r}: lm-eval task {self.lm_eval_task!r} is fixed at 0 shots in "
                                  f"its YAML (simple_evaluate ignores num_fewshot); got num_fewshot={self.num_fewshot}")
        check_int(self.name, "fewshot_seed", self.fewshot_seed, minimum=0)
        if self.gen_kwargs is not None and (not isinstance(self.gen_kwargs, dict) or self.gen_kwargs.get("do_sample")):
            raise ConfigError(f"task {self.name!r}: gen_kwargs must be null or a mapping without sampling (kvbench "
                              f"decodes greedily); got {self.gen_kwargs!r}")
        check_int(self.name, "max_gen_toks", self.max_gen_toks)
        if self.max_length is not None:
            check_int(self.name, "max_length", self.max_length, minimum=2)
        check_bool(self.name, "apply_chat_template", self.apply_chat_template)
        if self.data_dir is not None:
            check_str(self.name, "data_dir", self.data_dir)
            data.check_files(self.name, self.data_dir, self.LM_EVAL_TASKS[self.lm_eval_task][1], self.splits(cfg))

    def splits(self, cfg: dict[str, Any]) -> list[str]:
        """The dataset splits the run reads: the evaluation split, and the few-shot split when shots > 0."""
        needed = [cfg.get("test_split") or cfg.get("validation_split")]
        shots = self.num_fewshot if self.num_fewshot is not None else (cfg.get("num_fewshot") or 0)
        fewshot = cfg.get("fewshot_config") or {}
        if shots > 0 and not fewshot.get("samples"):
            needed.append(cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split"))
        return list(dict.fromkeys(s for s in needed if s))

    # ---- the lm-eval task ----
    def prepare_data(self) -> None:
        """Build lm-eval's task (it loads its dataset now: before any model loads)."""
        if self._task is not None:
            return
        from kvbench.tasks.lmeval import squad_metrics

        squad_metrics.install()
        from lm_eval.api.task import ConfigurableTask
        from lm_eval.tasks._yaml_loader import load_yaml

        path = self.yaml_path()
        cfg = load_yaml(path, resolve_func=True)
        for key in ("tag", "group", "task_list"):
            cfg.pop(key, None)
        if self.data_dir is not None:
            needed = self.splits(cfg)
            cfg.update(data.dataset_override(self.name, self.data_dir, self.LM_EVAL_TASKS[self.lm_eval_task][1],
                                             needed))
            cfg.update({key: None for key in SPLIT_KEYS if cfg.get(key) and cfg[key] not in needed})
        cfg["metadata"] = {**(cfg.get("metadata") or {}), "config_source": str(path)}
        try:
            task = ConfigurableTask(config=cfg)
        except OSError as exc:  # offline hub, missing or unreadable files
            where = (f"the local files of data_dir={self.data_dir!r}" if self.data_dir is not None
                     else f"the hub dataset {cfg.get('dataset_path')}")
            raise DataError(f"task {self.name!r}: lm-eval could not load {where} ({failure(exc)}); "
                            f"put the dataset's files in a directory and set task.data_dir=<directory> (README: "
                            f"kvbench/tasks/lmeval)") from None
        if self.num_fewshot is not None:
            task.set_config(key="num_fewshot", value=self.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=self.fewshot_seed)
        if self.gen_kwargs and task.get_config("output_type") == "generate_until":
            task.set_config(key="generation_kwargs", value=dict(self.gen_kwargs), update=True)
        self._task = task

    def samples(self, tokenizer: Any) -> list[Sample]:
        from kvbench.tasks.lmeval.lm import chat_template_fn

        self.prepare_data()
        task = self._task
        chat = chat_template_fn(tokenizer) if self.apply_chat_template else None
        name = getattr(tokenizer, "name_or_path", "") if chat else ""
        task.build_all_requests(limit=None, rank=0, world_size=1, apply_chat_template=self.apply_chat_template,
                                chat_template=chat, tokenizer_name=name)
        self._instances = {}
        for instance in task.instances:
            self._instances.setdefault(instance.doc_id, []).append(instance)
        out = []
        for doc_id, doc in task.doc_iterator(rank=0, limit=None, world_size=1):
            requests = sorted(self._instances[doc_id], key=lambda inst: inst.idx)
            self._instances[doc_id], self._docs[doc_id] = requests, doc
            target = task.doc_to_target(doc)
            answers = [str(t) for t in target] if isinstance(target, list) else [str(target)]
            meta = {"doc_id": doc_id, "lm_eval_task": self.lm_eval_task, "request_type": requests[0].request_type,
                    "requests": len(requests)}
            out.append(Sample(id=f"{self.lm_eval_task}/{doc_id}", prompt=requests[0].args[0], answers=answers,
                              meta=meta))
        return out

    # ---- running and scoring ----
    def evaluate(self, batch: list[Sample], answerer: Any) -> list[dict[str, Any]]:
        from kvbench.tasks.lmeval.lm import KVBenchLM

        if self._lm is None or self._lm.answerer is not answerer:
            self._lm = KVBenchLM(answerer, self.max_length or answerer.spec.context_length, self.max_gen_toks)
        return [self._evaluate_doc(sample) for sample in batch]

    def _evaluate_doc(self, sample: Sample) -> dict[str, Any]:
        doc_id = sample.meta["doc_id"]
        requests, doc, lm = self._instances[doc_id], self._docs[doc_id], self._lm
        lm.request_stats = []
        for request in requests:
            request.resps, request.filtered_resps = [], {}
        for reqtype in dict.fromkeys(r.request_type for r in requests):  # as evaluate(): by type, K copies each
            cloned = [r for r in requests if r.request_type == reqtype for _ in range(r.repeats)]
            for response, request in zip(getattr(lm, reqtype)(cloned, disable_tqdm=True), cloned, strict=True):
                request.resps.append(response)
        for ensemble in self._task._filters:
            ensemble.apply(requests)
        metrics: dict[str, Any] = {}
        for filter_key in requests[0].filtered_resps:
            values = self._task.process_results(doc, [r.filtered_resps[filter_key] for r in requests])
            metrics.update({f"{metric},{filter_key}": plain(value) for metric, value in values.items()})
        primary_filter = self.metric.partition(",")[2]
        filtered = requests[0].filtered_resps.get(primary_filter, requests[0].resps)
        stats = lm.request_stats
        return {
            "id": sample.id,
            "score": float(metrics[self.metric]),
            "metrics": metrics,
            "prediction": filtered if isinstance(filtered, str) else json.dumps(plain(filtered)),
            "raw_prediction": requests[0].resps[0] if isinstance(requests[0].resps[0], str) else "",
            "responses": [plain(r.resps) for r in requests],
            "answers": sample.answers,
            "meta": sample.meta,
            "batch_size": 1,
            "prompt_tokens": max(s["prompt_tokens"] for s in stats),
            "new_tokens": sum(s["new_tokens"] for s in stats),
            "prefill_seconds": sum(s["prefill_seconds"] for s in stats),
            "decode_seconds": sum(s["decode_seconds"] for s in stats),
            "decode_steps": sum(s["decode_steps"] for s in stats),
            "resident_kv_bytes": sum(s["resident_kv_bytes"] for s in stats) // len(stats),
            "resident_kv_bytes_final": sum(s["resident_kv_bytes_final"] for s in stats) // len(stats),
            "layer_entries": stats[0]["layer_entries"],
            "attended_tokens_mean": round(sum(s["attended_tokens_mean"] for s in stats) / len(stats), 2),
        }

    def score(self, prediction: str, sample: Sample) -> float:
        raise TypeError(f"task {self.name!r} is scored by lm-eval's process_results in evaluate()")

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """lm-eval's aggregation of the per-document values: ``metrics`` = ``{"metric,filter": value,
        "metric_stderr,filter": value or "N/A"}``; ``score`` = the primary metric (lm-eval's scale)."""
        from lm_eval.evaluator_utils import _compute_task_aggregations

        self.prepare_data()
        raw: dict[tuple[str, str], list] = {}
        for record in records:
            for key, value in record["metrics"].items():
                metric, _, filter_key = key.partition(",")
                raw.setdefault((metric, filter_key), []).append(value)
        agg, _ = _compute_task_aggregations(self._task, raw, bootstrap_iters=BOOTSTRAP_ITERS) if raw else ({}, 0)
        agg = {key: plain(value) for key, value in agg.items()}
        return {"score": agg.get(self.metric, float("nan")), "n": len(records), "metrics": agg,
                "lm_eval_task": self.lm_eval_task}

    def protocol(self) -> dict[str, Any]:
        cfg = read_task_yaml(self.yaml_path())
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_dir"}  # where, not what
        shots = self.num_fewshot if self.num_fewshot is not None else (cfg.get("num_fewshot") or 0)
        return {**super().protocol(), **fields, "primary_metric": self.metric, "resolved_num_fewshot": shots,
                "lm_eval": importlib.metadata.version("lm-eval"),
                "lm_eval_task_version": (cfg.get("metadata") or {}).get("version")}


__all__ = ["LMEvalTask"]
