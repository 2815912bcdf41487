"""ZeroSCROLLS (Shaham et al., Findings of EMNLP 2023) on its labeled validation split, prompted and truncated as
tau-nlp/zero_scrolls@c994676 ``experiments/`` does, scored as the paper's section 3.3 says.

The ``input`` field already holds the canonical prompt: instruction, context header, document, query header and
query, response header ("Answer:", "Summary:", ...). ``prompt_format=completion`` feeds it as is (DaVinci, Flan-T5);
``chat`` is the chat-model version (``openai_api.build_prompt``): "Do not provide any explanation." appended to the
instruction of every non-summarisation task, the response header dropped (``input[:query_end_index]``), the result
as the user message of the model's chat template. Too long a prompt keeps its head (``input[:query_start_index]``) up
to the budget and appends ``truncation_seperator + input[query_start_index:]`` (``process_model_input``). Greedy
decoding with the per-task generation budgets of ``experiments/api/api.py``. README.md in this folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvbench.errors import DataError
from kvbench.metrics.zeroscrolls import check_f1_backend
from kvbench.tasks import check_common, check_names, check_str, protocol_fields
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.text import middle_truncate
from kvbench.tasks.zeroscrolls.data import hub_source, local_source, read_examples
from kvbench.tasks.zeroscrolls.scoring import (
    DATASET2METRIC,
    DATASETS,
    PROTOCOL,
    ROUGE_AGGREGATIONS,
    example_score,
    score_records,
)

DATASET2MAXLEN: dict[str, int] = PROTOCOL["dataset2maxlen"]
SUMMARIZATION = frozenset(PROTOCOL["summarization_datasets"])
PROMPT_FORMATS = ("chat", "completion")
TRUNCATIONS = ("official", "middle")


@dataclass
class ZeroScrollsSample(Sample):
    """A Sample whose prompt is ``head + query``: ``head`` (instruction and document) is what truncation cuts,
    ``separator`` (the row's ``truncation_seperator``) goes between the cut head and ``query``."""

    head: str = ""
    query: str = ""
    separator: str = ""


def chat_input(row: dict[str, Any], dataset: str, request: str) -> tuple[str, int]:
    """``openai_api.build_prompt`` for chat models: (prompt, query start). Non-summarisation tasks get ``request``
    after the stripped instruction (text before the first blank line; indices shift by ``len(request) + 1``, as
    ``insert_format_request``); the prompt ends at the query's end (no response header)."""
    text, start, end = row["input"], row["query_start_index"], row["query_end_index"]
    if dataset not in SUMMARIZATION:
        cut = text.find("\n\n")
        if cut < 0:
            raise DataError(f"zeroscrolls {dataset} {row['id']}: input has no blank line after the instruction")
        text = f"{text[:cut].strip()} {request}{text[cut:]}"
        start, end = start + len(request) + 1, end + len(request) + 1
    return text[:end], start


@dataclass
class ZeroScrollsTask(Task):
    """ZeroSCROLLS, validation split.

    datasets: tasks in order (default all 10; KVMerger Table 6 uses gov_report, summ_screen_fd, qmsum, squality,
        qasper, narrative_qa, book_sum_sort).
    data_dir: directory with ``<dataset>/validation.jsonl`` or ``<dataset>.zip``; null fetches the zips from the hub.
    prompt_format: "chat" (chat models: format request, no response header, chat template) or "completion" (the
        ``input`` field as is, no chat template).
    truncation: "official" (keep the head, append separator + query) or "middle" (LongBench's middle truncation).
    truncate_to: prompt budget in tokens; null = the model's ``max_input_tokens``; always capped at
        ``context_length - max_new_tokens`` (upstream: window minus the task's generation budget).
    rouge_aggregation: "instance" (paper) or "corpus" (SCROLLS metric code), see ``scoring.py``.
    """

    name: ClassVar[str] = "zeroscrolls"
    separable_question: ClassVar[bool] = True  # the row's query follows its document (query_start_index)
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "zeroscrolls"  # per sample: the task's metric (0-1); datasets x100

    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    data_dir: str | None = None
    prompt_format: str = "chat"
    truncation: str = "official"
    truncate_to: int | None = None
    rouge_aggregation: str = "instance"
    stop_strings: list[str] = field(default_factory=list)

    @property
    def chat_template(self) -> bool:  # type: ignore[override]
        return self.prompt_format == "chat"

    @property
    def max_new_tokens(self) -> int:  # type: ignore[override]
        """The largest generation budget of the selected tasks (each sample carries its own)."""
        return max(DATASET2MAXLEN[d] for d in self.datasets)

    def validate(self) -> None:
        check_names(self.name, "datasets", self.datasets, DATASETS, "ZeroSCROLLS tasks")
        check_str(self.name, "prompt_format", self.prompt_format, PROMPT_FORMATS)
        check_str(self.name, "truncation", self.truncation, TRUNCATIONS)
        check_str(self.name, "rouge_aggregation", self.rouge_aggregation, ROUGE_AGGREGATIONS)
        check_common(self)
        if any(DATASET2METRIC[d] == "f1" for d in self.datasets):
            check_f1_backend()
        if self.data_dir is not None:
            check_str(self.name, "data_dir", self.data_dir)
            self.sources()

    def sources(self) -> dict[str, Path]:
        """{dataset: validation file or zip}: from ``data_dir`` (DataError if missing) or the hub (once)."""
        if self.data_dir is not None:
            return {d: local_source(self.name, self.data_dir, d) for d in self.datasets}
        return {d: hub_source(self.name, d) for d in self.datasets}

    def prepare_data(self) -> None:
        self.sources()

    def samples(self, tokenizer: Any = None) -> list[Sample]:
        """One sample per validation example (references merged by id), tasks in ``datasets`` order."""
        out: list[Sample] = []
        for dataset, path in self.sources().items():
            for row, answers in read_examples(path, self.name):
                out.append(self.make_sample(dataset, row, answers))
        return out

    def make_sample(self, dataset: str, row: dict[str, Any], answers: list[str]) -> ZeroScrollsSample:
        if self.prompt_format == "chat":
            text, start = chat_input(row, dataset, PROTOCOL["chat_format_request"])
        else:
            text, start = row["input"], row["query_start_index"]
        max_new = DATASET2MAXLEN[dataset]
        meta = {"dataset": dataset, "metric": DATASET2METRIC[dataset], "example_id": row["id"],
                "max_new_tokens": max_new}
        return ZeroScrollsSample(id=f"{dataset}/{row['id']}", prompt=text, answers=answers, meta=meta,
                                 max_new_tokens=max_new, head=text[:start], query=text[start:],
                                 question=text[start:] or None,
                                 separator=row["truncation_seperator"])

    def truncate_prompt(self, sample: Sample, tokenizer: Any, max_tokens: int) -> str:
        """``official``: the prompt if it fits; else the first ``max_tokens - |separator + query|`` tokens of the head
        (decoded) + separator + query. ``middle``: LongBench's middle truncation of the whole prompt."""
        if self.truncation == "middle" or not isinstance(sample, ZeroScrollsSample):
            return middle_truncate(sample.prompt, tokenizer, max_tokens)
        if len(tokenizer.encode(sample.prompt, add_special_tokens=False)) <= max_tokens:
            return sample.prompt
        suffix = sample.separator + sample.query
        keep = max(0, max_tokens - len(tokenizer.encode(suffix, add_special_tokens=False)))
        head = tokenizer.encode(sample.head, add_special_tokens=False)[:keep]
        return tokenizer.decode(head, skip_special_tokens=True) + suffix

    def postprocess(self, prediction: str, sample: Sample) -> str:
        """Unchanged (upstream scores the generation as returned)."""
        return prediction

    def score(self, prediction: str, sample: Sample) -> float:
        return example_score(sample.meta["dataset"], prediction, sample.answers)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [{"dataset": r["meta"]["dataset"], "prediction": r["prediction"], "answers": r["answers"]}
                for r in records]
        return {**score_records(rows, self.rouge_aggregation), "n": len(records)}

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_dir"}
        blob = json.dumps({k: v for k, v in PROTOCOL.items() if not k.startswith("_")}, sort_keys=True)
        return {**super().protocol(), **fields,
                "dataset2maxlen": {d: DATASET2MAXLEN[d] for d in self.datasets},
                "dataset2metric": {d: DATASET2METRIC[d] for d in self.datasets},
                "split": PROTOCOL["split"], "prompts_sha256": hashlib.sha256(blob.encode()).hexdigest()[:16],
                "scorers": {"rouge": "rouge-score, no stemmer", "f1": "SQuAD normalisation + unidecode"}}


__all__ = ["ZeroScrollsSample", "ZeroScrollsTask", "chat_input"]
