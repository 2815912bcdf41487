"""LongBench v1 and LongBench-E, as THUDM/LongBench@2e00731 ``LongBench/pred.py`` + ``eval.py`` run them.

Per dataset (all data in ``prompts.json``): ``prompt = dataset2prompt[dataset].format(**row)``; the raw prompt is
middle-truncated, then wrapped in the chat template except for trec/triviaqa/samsum/lsht/lcc/repobench-p; greedy
decoding up to ``dataset2maxlen[dataset]`` new tokens, samsum stopping at "\\n"; the first line (after
``lstrip('\\n')``) of trec/triviaqa/samsum/lsht predictions is scored; per sample the max of the dataset's metric over
the answers; per dataset ``round(100 * mean, 2)``. reference/benchmarks.md section 1; README.md in this folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvbench.metrics.longbench import first_line
from kvbench.tasks import check_common, check_names, check_str, protocol_fields
from kvbench.tasks.base import Sample, Task, question_after
from kvbench.tasks.longbench.data import (
    check_data_dir,
    default_data_dir,
    download_official,
    file_name,
    missing_files,
    read_rows,
)
from kvbench.tasks.longbench.protocol import (
    CATEGORIES,
    CHINESE,
    DATASET2MAXLEN,
    DATASET2METRIC,
    DATASET2PROMPT,
    ENGLISH,
    FIRST_LINE,
    LONGBENCH_E,
    NEWLINE_STOP,
    NO_CHAT_TEMPLATE,
    VARIANTS,
    category_of,
)
from kvbench.tasks.longbench.scoring import category_means, record_score, summarize


@dataclass
class LongBenchTask(Task):
    """LongBench v1 (``variant: longbench``) or LongBench-E (``variant: longbench_e``, files ``<dataset>_e.jsonl``,
    scores also per length bucket).

    datasets: sub-datasets in order (default: the 16 English ones of the KV-compression papers).
    data_dir: a directory with the official ``<dataset>.jsonl`` / ``<dataset>_e.jsonl`` files of ``data.zip``;
        null downloads ``data.zip`` from the hub dataset THUDM/LongBench once into the kvbench cache.
    chat_template: true = official (the model's chat template, except for the six datasets pred.py leaves raw);
        false = raw prompts for every dataset (base models).
    stop_strings: extra stops for every dataset (official: none; samsum's "\\n" is per sample).
    truncate_to: prompt budget of the middle truncation (``model2maxlen``); null = the model's max_input_tokens.

    Generation length is per dataset (``dataset2maxlen``): ``sample.max_new_tokens`` and
    ``sample.meta["max_new_tokens"]``; ``task.max_new_tokens`` is the largest over the selected datasets.
    """

    name: ClassVar[str] = "longbench"
    separable_question: ClassVar[bool] = True  # every dataset2prompt template ends with what follows {context}
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "longbench"  # per sample: the dataset's official metric (0-1); datasets x100

    datasets: list[str] = field(default_factory=lambda: list(ENGLISH))
    variant: str = "longbench"
    data_dir: str | None = None
    chat_template: bool = True
    stop_strings: list[str] = field(default_factory=list)
    truncate_to: int | None = None

    # ---- fields and files ----
    @property
    def max_new_tokens(self) -> int:  # type: ignore[override]
        """The largest ``dataset2maxlen`` of the selected datasets (each sample carries its own)."""
        return max(DATASET2MAXLEN[d] for d in self.datasets)

    def file_names(self) -> list[str]:
        return [file_name(dataset, self.variant) for dataset in self.datasets]

    def validate(self) -> None:
        check_str(self.name, "variant", self.variant, VARIANTS)
        self._check_datasets()
        check_common(self)
        if self.data_dir is not None:
            check_str(self.name, "data_dir", self.data_dir)
            check_data_dir(self.name, self.data_dir, self.file_names())
            return
        directory = default_data_dir()  # downloaded on first use by samples(); if already here, check it
        if directory.is_dir() and missing_files(directory, self.file_names()):
            check_data_dir(self.name, str(directory), self.file_names())

    def _check_datasets(self) -> None:
        valid = LONGBENCH_E if self.variant == "longbench_e" else list(DATASET2PROMPT)
        check_names(self.name, "datasets", self.datasets, valid, f"{self.variant} datasets")

    def prepare_data(self) -> None:
        self.data_path()

    def data_path(self) -> Path:
        """The directory with the requested files: ``data_dir``, or the cache (downloading data.zip once)."""
        if self.data_dir is not None:
            return check_data_dir(self.name, self.data_dir, self.file_names())
        directory = default_data_dir()
        if not directory.is_dir():
            download_official(self.name, directory)
        return check_data_dir(self.name, str(directory), self.file_names())

    # ---- samples ----
    def samples(self, tokenizer: Any = None) -> list[Sample]:
        """Every row of every selected dataset, in ``datasets`` order and file order (no tokenizer needed)."""
        directory = self.data_path()
        out: list[Sample] = []
        for dataset in self.datasets:
            path = directory / file_name(dataset, self.variant)
            seen: set[str] = set()
            for index, row in enumerate(read_rows(path, self.name)):
                sample = self.make_sample(dataset, index, row)
                if sample.id in seen:  # keep ids unique (records are resumed by id)
                    sample.id = f"{sample.id}#{index}"
                seen.add(sample.id)
                out.append(sample)
        return out

    def make_sample(self, dataset: str, index: int, row: dict[str, Any]) -> Sample:
        """One official row -> Sample: the official prompt, answers, and the per-dataset protocol in meta."""
        max_new = DATASET2MAXLEN[dataset]
        stops = ["\n"] if dataset in NEWLINE_STOP else None
        meta = {
            "dataset": dataset,
            "index": index,
            "_id": row.get("_id"),
            "language": row.get("language"),
            "length": row.get("length"),
            "all_classes": row.get("all_classes"),
            "category": category_of(dataset),
            "metric": DATASET2METRIC[dataset],
            "max_new_tokens": max_new,
            "stop_strings": list(stops if stops is not None else self.stop_strings),
            "chat_template": bool(self.chat_template and dataset not in NO_CHAT_TEMPLATE),
        }
        prompt = DATASET2PROMPT[dataset].format(**row)
        return Sample(
            id=f"{dataset}/{row.get('_id') or index}",
            prompt=prompt,
            question=question_after(prompt, row["context"]) if row.get("context") else None,
            answers=[str(answer) for answer in row["answers"]],
            meta=meta,
            max_new_tokens=max_new,
            stop_strings=stops,
        )

    def chat_template_for(self, sample: Sample) -> bool:
        """Whether this sample's prompt goes into the chat template (pred.py: not for the six few-shot/code ones)."""
        return bool(sample.meta.get("chat_template", self.chat_template))

    # ---- scoring ----
    def postprocess(self, prediction: str, sample: Sample) -> str:
        """eval.py: the first line after ``lstrip('\\n')`` for trec/triviaqa/samsum/lsht; otherwise unchanged
        (the official pipeline strips nothing)."""
        return first_line(prediction) if sample.meta["dataset"] in FIRST_LINE else prediction

    def score(self, prediction: str, sample: Sample) -> float:
        """The dataset's official metric, max over the answers (0-1): ``scoring.record_score``, the function
        ``python -m kvbench.score`` uses."""
        return record_score(sample.meta["dataset"], prediction, sample.answers, sample.meta.get("all_classes"))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``score``: plain mean over datasets of the per-dataset scores (as the KV papers report);
        ``datasets``: eval.py's ``round(100 * mean, 2)``; ``categories``: {language: {category: mean}} and
        ``leaderboard_avg``: {language: mean of the category means} (the official README's "Avg");
        LongBench-E adds ``buckets`` {dataset: {0-4k, 4-8k, 8k+}} (eval.py ``scorer_e``) and ``bucket_avg``."""
        per_dataset = self._group(records)
        scores = {d: [float(r["score"]) for r in rs] for d, rs in per_dataset.items()}
        lengths = ({d: [r["meta"]["length"] for r in rs] for d, rs in per_dataset.items()}
                   if self.variant == "longbench_e" else None)
        return summarize(scores, lengths)

    def _group(self, records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            groups.setdefault(record["meta"]["dataset"], []).append(record)
        order = {d: i for i, d in enumerate(self.datasets)}
        return dict(sorted(groups.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_dir"}  # where, not what
        prompts = {d: DATASET2PROMPT[d] for d in self.datasets}
        return {
            **super().protocol(),
            **fields,
            "dataset2maxlen": {d: DATASET2MAXLEN[d] for d in self.datasets},
            "dataset2metric": {d: DATASET2METRIC[d] for d in self.datasets},
            "no_chat_template": sorted(NO_CHAT_TEMPLATE & set(self.datasets)),
            "first_line": sorted(FIRST_LINE & set(self.datasets)),
            "newline_stop": sorted(NEWLINE_STOP & set(self.datasets)),
            "prompts_sha256": hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16],
            "scorers": {"rouge": "pltrdy rouge==1.0.1, exceptions -> 0", "code_sim": "fuzzywuzzy ratio, difflib"},
        }


@dataclass
class LongBenchETask(LongBenchTask):
    """LongBench-E: the 13 datasets with ``<dataset>_e.jsonl`` files, scored per length bucket as well."""

    name: ClassVar[str] = "longbench_e"

    datasets: list[str] = field(default_factory=lambda: list(LONGBENCH_E))
    variant: str = "longbench_e"


@dataclass
class LongBenchZhTask(LongBenchTask):
    """The five Chinese LongBench datasets (the official ZH leaderboard also averages in lcc and repobench-p)."""

    name: ClassVar[str] = "longbench_zh"

    datasets: list[str] = field(default_factory=lambda: list(CHINESE))


__all__ = [
    "CATEGORIES", "CHINESE", "DATASET2MAXLEN", "DATASET2METRIC", "DATASET2PROMPT", "ENGLISH", "FIRST_LINE",
    "LONGBENCH_E", "NO_CHAT_TEMPLATE", "LongBenchETask", "LongBenchTask", "LongBenchZhTask", "category_means",
]
