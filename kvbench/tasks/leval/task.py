"""LEval (An et al., ACL 2024), as OpenLMLab/LEval@cd34b05 ``Baselines/llama2-chat-test.py`` prompts it and
``Evaluation/auto_eval.py`` scores it; the 20 sub-tasks in one task.

One sample per (document, instruction) of the rows whose ``evaluation`` is exam, f1 or rouge (GPT-4/human-judged rows
are skipped, as the ``exam_eval`` / ``ngram_eval`` runs do). The prompt is the dataset's template around the document
(``prompts.json``: ``templates``, ``dataset2template``, ``system_prompts``); the *document alone* is cut to the token
budget by whole words from its end (codeU: from its start) in steps of 250 words, and the question stays; greedy
decoding of 512 new tokens; the raw generation is scored (``scoring.py``). sci_fi asks each question twice: with the
document (loyalty) and, raw and without it, about the real world (fact). README.md in this folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvbench.errors import DataError
from kvbench.tasks import check_bool, check_common, check_names, check_str, protocol_fields
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.leval.data import hub_file, local_files, read_documents
from kvbench.tasks.leval.scoring import DATASET2METRIC, DATASETS, PROTOCOL, SCI_FI, question_score, score_records
from kvbench.tasks.text import middle_truncate

CLOSED = frozenset(PROTOCOL["closed_ended"])
TEMPLATES: dict[str, str] = PROTOCOL["templates"]
LLAMA2: dict[str, str] = PROTOCOL["llama2"]
PROMPT_FORMATS = ("chat", "llama2")
TRUNCATIONS = ("official", "middle")


@dataclass
class LEvalSample(Sample):
    """A Sample whose prompt is ``head + document + tail`` (after ``format_quirk``), so the task can cut the document
    alone. ``instruction`` is what upstream's ``str.format(document=..., inst=...)`` receives."""

    head: str = ""
    document: str = ""
    tail: str = ""
    instruction: str = ""
    keep_end: bool = False
    format_quirk: bool = False

    def render(self, document: str) -> str:
        text = self.head + document + self.tail
        if not self.format_quirk:
            return text
        try:  # upstream formats the whole message; a literal "{x}" raises and leaves it as it was
            return text.format(document=document, inst=self.instruction)
        except Exception:
            return text


def cut_document(document: str, tokenizer: Any, max_tokens: int, keep_end: bool, step: int) -> str:
    """``llama2-chat-test.py``: while the document has more than ``max_tokens`` tokens (counted as upstream,
    ``tokenizer(document)`` with the tokenizer's special tokens), keep its first ``max_tokens - cnt`` words (split on
    " "; the last ones for code), ``cnt`` growing by ``step``. Empty once no word would be kept (upstream loops)."""
    cnt = 0
    while len(tokenizer.encode(document)) > max_tokens:
        keep = max_tokens - cnt
        if keep <= 0:
            return ""
        words = document.split(" ")
        document = " ".join(words[-keep:] if keep_end else words[:keep])
        cnt += step
    return document


@dataclass
class LEvalTask(Task):
    """LEval's 20 sub-tasks (closed-ended exam tasks, open-ended QA and summarisation).

    datasets: sub-tasks in order (default all 20, as POD Table 1).
    data_dir: a directory with the official ``<dataset>.jsonl`` files (flat, GitHub or hub layout); null fetches them
        from the hub dataset L4NLP/LEval.
    prompt_format: "chat" = the official system prompt and message in the model's chat template (the generalisation of
        the per-model baseline scripts); "llama2" = the exact Llama-2 string of ``llama2-chat-test.py``, raw.
    system_role: chat only; false puts the system prompt in front of the user message (templates without a system
        role; the vicuna/longchat scripts do this).
    truncation: "official" cuts the document by words (budget = the document's tokens, upstream ``max_length``);
        "middle" middle-truncates the whole prompt (LongBench's rule).
    truncate_to: the token budget (upstream ``k * 1000 - 512``, e.g. 3488 for ``--max_length 4k``); null = the model's
        ``max_input_tokens``; always capped at ``context_length - max_new_tokens``.
    max_new_tokens: 512 (``LEval_config.max_new_tokens``, every dataset).
    """

    name: ClassVar[str] = "leval"
    separable_question: ClassVar[bool] = True  # the instruction follows the document (see inseparable)
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "leval"  # per sample: the dataset's metric (0-1); datasets x100 as auto_eval.py

    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    data_dir: str | None = None
    prompt_format: str = "chat"
    system_role: bool = True
    truncation: str = "official"
    truncate_to: int | None = None
    max_new_tokens: int = PROTOCOL["max_new_tokens"]
    stop_strings: list[str] = field(default_factory=list)

    @property
    def chat_template(self) -> bool:  # type: ignore[override]
        return self.prompt_format == "chat"

    # ---- fields and files ----
    def validate(self) -> None:
        check_names(self.name, "datasets", self.datasets, DATASETS, "LEval datasets")
        check_str(self.name, "prompt_format", self.prompt_format, PROMPT_FORMATS)
        check_str(self.name, "truncation", self.truncation, TRUNCATIONS)
        check_bool(self.name, "system_role", self.system_role)
        check_common(self)
        if self.data_dir is not None:
            check_str(self.name, "data_dir", self.data_dir)
            self.files()

    def files(self) -> dict[str, Path]:
        """{dataset: official file}: from ``data_dir`` (DataError if missing) or the hub (downloads once)."""
        groups = {d: "closed_ended" if d in CLOSED else "open_ended" for d in self.datasets}
        if self.data_dir is not None:
            return local_files(self.name, self.data_dir, groups, PROTOCOL)
        return {d: hub_file(self.name, d, group, PROTOCOL) for d, group in groups.items()}

    def prepare_data(self) -> None:
        self.files()

    # ---- samples ----
    def samples(self, tokenizer: Any = None) -> list[Sample]:
        """Every scored question of every selected dataset, in file order (sci_fi: loyalty, then fact)."""
        out: list[Sample] = []
        for dataset, path in self.files().items():
            question = 0
            for doc_index, row in enumerate(read_documents(path, self.name)):
                if row["evaluation"] not in PROTOCOL["scored_evaluations"]:
                    continue  # GPT-4 / human-judged rows
                wanted = "exam" if dataset in CLOSED else DATASET2METRIC[dataset]
                if row["evaluation"] != wanted:
                    raise DataError(f"task {self.name!r}: {path} document {doc_index} has evaluation "
                                      f"{row['evaluation']!r}, expected {wanted!r} for {dataset}")
                for q_index, (inst, out_) in enumerate(zip(row["instructions"], row["outputs"])):
                    out.extend(self.make_samples(dataset, doc_index, q_index, question, row["input"], inst, out_))
                    question += 1
        return out

    def make_samples(self, dataset: str, doc: int, q: int, question: int, document: str, inst: str,
                     answer: str) -> list[LEvalSample]:
        """The sample(s) of one question: the official prompt pieces, and sci_fi's fact question."""
        template = PROTOCOL["dataset2template"][dataset]
        before, after = TEMPLATES[template].split("{document}")
        before = before.replace("{inst}", inst)
        after = after.replace("{inst}", inst).replace("{n_words}", str(len(answer.split())))
        system = PROTOCOL["system_prompts"].get(dataset, PROTOCOL["system_prompts"]["_open_ended"])
        prefix = PROTOCOL["answer_prefix"].get(template, "")
        end = "" if dataset in PROTOCOL["no_end_of_instruction"] else LLAMA2["E_INST"]
        if self.prompt_format == "llama2":
            head = LLAMA2["B_INST"] + LLAMA2["B_SYS"] + system + LLAMA2["E_SYS"] + before
            tail, system, prefix = after + end + prefix, None, ""
        elif self.system_role:
            head, tail = before, after
        else:
            head, tail, system = system + before, after, None
        meta = {"dataset": dataset, "metric": DATASET2METRIC[dataset], "doc_index": doc, "question_index": question,
                "max_new_tokens": self.max_new_tokens}
        sample = LEvalSample(
            id=f"{dataset}/{doc}-{q}", prompt="", answers=[answer], meta=meta, system=system, assistant_prefix=prefix,
            max_new_tokens=self.max_new_tokens, head=head, document=document, tail=tail, instruction=inst,
            keep_end=dataset in PROTOCOL["keep_document_end"], format_quirk=dataset in PROTOCOL["format_quirk"])
        sample.prompt = sample.render(document)
        if document and tail and sample.prompt.endswith(tail):
            sample.question = tail
        if dataset != SCI_FI:
            return [sample]
        fact = PROTOCOL["sci_fi_fact"]
        fact_prompt = inst.replace(fact["replace"], fact["by"]) + fact["append"]
        sample.id, sample.meta = f"{sample.id}/loyalty", {**meta, "part": "loyalty"}
        return [sample, LEvalSample(id=f"{dataset}/{doc}-{q}/fact", prompt=fact_prompt, answers=[answer],
                                    meta={**meta, "part": "fact", "chat_template": False},
                                    max_new_tokens=self.max_new_tokens, tail=fact_prompt)]

    def inseparable(self) -> list[str]:
        """sci_fi's fact question is asked without the document: it has no context to compress before it."""
        return [SCI_FI] if SCI_FI in self.datasets else []

    def chat_template_for(self, sample: Sample) -> bool:
        """The chat template for ``prompt_format=chat``, except sci_fi's fact question (upstream feeds it raw)."""
        return bool(sample.meta.get("chat_template", self.chat_template))

    def truncate_prompt(self, sample: Sample, tokenizer: Any, max_tokens: int) -> str:
        """``truncation=official``: the document cut by ``cut_document`` to ``max_tokens``, the rest kept whole;
        ``middle``: the whole prompt middle-truncated."""
        if self.truncation == "middle" or not isinstance(sample, LEvalSample) or not sample.document:
            return middle_truncate(sample.prompt, tokenizer, max_tokens)
        step = PROTOCOL["truncation_step_words"]
        return sample.render(cut_document(sample.document, tokenizer, max_tokens, sample.keep_end, step))

    # ---- scoring ----
    def postprocess(self, prediction: str, sample: Sample) -> str:
        """Unchanged: upstream scores the raw generation (``process_output_mc`` looks at leading characters)."""
        return prediction

    def score(self, prediction: str, sample: Sample) -> float:
        return question_score(sample.meta["dataset"], prediction, sample.answers, sample.meta.get("part"))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``scoring.score_records`` of the records (rouge is recomputed from the predictions, not averaged)."""
        rows = [{"dataset": r["meta"]["dataset"], "prediction": r["prediction"], "answers": r["answers"],
                 "part": r["meta"].get("part"), "question_index": r["meta"]["question_index"]} for r in records]
        return {**score_records(rows), "n": len(records)}

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_dir"}
        blob = json.dumps({k: v for k, v in PROTOCOL.items() if not k.startswith("_")}, sort_keys=True)
        return {**super().protocol(), **fields, "dataset2metric": {d: DATASET2METRIC[d] for d in self.datasets},
                "prompts_sha256": hashlib.sha256(blob.encode()).hexdigest()[:16],
                "scorers": {"rouge": "rouge-score, no stemmer", "exam": "em.py with auto_eval.py pre-processing"}}


__all__ = ["LEvalSample", "LEvalTask", "cut_document"]
