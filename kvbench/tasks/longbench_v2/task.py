"""LongBench v2, as THUDM/LongBench@2e00731 ``pred.py`` + ``result.py`` run it (README.md in this folder).

Per item: ``prompt = fill(0shot.txt, row)`` (CoT: ``0shot_cot.txt``); the prompt, encoded with the tokenizer's special
tokens, is middle-truncated to ``truncate_to`` tokens (first ``n//2`` + last ``-n//2`` ids, decoded together skipping
special tokens) and sent as the user turn of the chat template; up to 128 new tokens (CoT: 1024, then a second
request ``fill(0shot_cot_ans.txt, row, cot)`` of up to 128); the stripped response's letter from ``extract_answer``
against ``answer``. Scores: accuracy × 100 overall, per difficulty (easy / hard) and per length (short / medium /
long), rounded to 1 decimal.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.tasks import check_bool, check_common, check_int, check_str, protocol_fields
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.encoding import decode_prediction, encode_sample
from kvbench.tasks.longbench_v2.data import load_hub, read_file
from kvbench.tasks.longbench_v2.protocol import (
    COT_MAX_NEW_TOKENS,
    HUB_REPO,
    HUB_SPLIT,
    MAX_LENGTH,
    MAX_NEW_TOKENS,
    SOURCE,
    TEMPLATE_0SHOT,
    TEMPLATE_0SHOT_COT,
    TEMPLATE_0SHOT_COT_ANS,
    fill,
    truncate_ids,
)
from kvbench.tasks.longbench_v2.scoring import extract_answer, judge, summarize
from kvbench.tasks.requests import Answerer, GenerateUntil


@dataclass
class LongBenchV2Task(Task):
    """LongBench v2's 503 four-choice questions (``pred.py`` without ``--rag`` / ``--no_context``).

    cot: false = ``pred.py``; true = ``pred.py --cot``: a chain of thought (``0shot_cot.txt``, up to
        ``cot_max_new_tokens``) and a second request for the answer (``0shot_cot_ans.txt`` with the CoT in ``$COT$``
        and no document, up to ``max_new_tokens``).
    data_file: a local ``data.json`` (JSON list, the official file) or ``.jsonl`` with the official fields; null loads
        the hub dataset THUDM/LongBench-v2, split train, with ``datasets.load_dataset`` (as pred.py does).
    chat_template: true = official (the prompt is the user message of a chat request); false = raw prompt.
    truncate_to: middle-truncation budget in tokens (``config/model2maxlen.json``: 120000 for the open models);
        capped at the model's context minus the new tokens; null = the model's max_input_tokens.
    max_new_tokens: the answer's budget (128); cot_max_new_tokens: the CoT's (1024).
    compensated: ``result.py``'s switch: a response without an extractable answer scores 0.25 instead of 0.
    """

    name: ClassVar[str] = "longbench_v2"
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "accuracy"

    cot: bool = False
    data_file: str | None = None
    chat_template: bool = True
    truncate_to: int | None = MAX_LENGTH
    max_new_tokens: int = MAX_NEW_TOKENS
    cot_max_new_tokens: int = COT_MAX_NEW_TOKENS
    stop_strings: list[str] = field(default_factory=list)
    compensated: bool = False

    def __post_init__(self) -> None:
        self._rows: dict[str, dict[str, Any]] = {}  # sample id -> row (the CoT's second step needs its fields)
        self._loaded: list[dict[str, Any]] | None = None

    # ---- fields and data ----
    def validate(self) -> None:
        check_bool(self.name, "cot", self.cot)
        check_bool(self.name, "compensated", self.compensated)
        check_int(self.name, "cot_max_new_tokens", self.cot_max_new_tokens)
        check_common(self)
        if self.data_file is not None:
            check_str(self.name, "data_file", self.data_file)
            self.rows()  # a missing or malformed local file fails before any model loads

    def prepare_data(self) -> None:
        self.rows()

    def rows(self) -> list[dict[str, Any]]:
        """The checked rows: ``data_file``, else the hub dataset (loaded once per task object)."""
        if self._loaded is None:
            self._loaded = read_file(self.data_file, self.name) if self.data_file is not None else load_hub(self.name)
        return self._loaded

    # ---- samples ----
    def samples(self, tokenizer: Any = None) -> list[Sample]:
        """One sample per row, in file order; ids are the rows' ``_id`` (``#<index>`` added to a repeated one)."""
        out: list[Sample] = []
        self._rows = {}
        for index, row in enumerate(self.rows()):
            sample_id = row["_id"] or str(index)
            if sample_id in self._rows:
                sample_id = f"{sample_id}#{index}"
            self._rows[sample_id] = row
            out.append(self.make_sample(sample_id, row))
        return out

    def make_sample(self, sample_id: str, row: dict[str, Any]) -> Sample:
        meta = {k: row[k] for k in ("_id", "domain", "sub_domain", "difficulty", "length", "answer")}
        meta["cot"] = self.cot
        return Sample(
            id=sample_id,
            prompt=fill(TEMPLATE_0SHOT_COT if self.cot else TEMPLATE_0SHOT, row),
            answers=[row["answer"]],
            meta=meta,
            max_new_tokens=self.cot_max_new_tokens if self.cot else self.max_new_tokens,
        )

    def answer_sample(self, sample: Sample, cot: str) -> Sample:
        """The CoT's second request: ``0shot_cot_ans.txt`` filled with the row and the first step's stripped output."""
        row = self._rows[sample.id]
        return Sample(id=sample.id, prompt=fill(TEMPLATE_0SHOT_COT_ANS, row, cot), answers=sample.answers,
                      meta=sample.meta, max_new_tokens=self.max_new_tokens)

    def truncate_prompt(self, sample: Sample, tokenizer: Any, max_tokens: int) -> str:
        """``query_llm``: ``tokenizer.encode(prompt)`` (special tokens included, as upstream counts them); if longer
        than the budget, ``ids[:n//2] + ids[-n//2:]`` decoded in one piece with ``skip_special_tokens=True``."""
        ids = list(tokenizer.encode(sample.prompt))
        if len(ids) <= max_tokens:
            return sample.prompt
        return tokenizer.decode(truncate_ids(ids, max_tokens), skip_special_tokens=True)

    # ---- the CoT's two requests ----
    def own_loop(self) -> bool:
        """Only the CoT runs its own two requests; without it the runner generates (and may sample)."""
        return self.cot

    def evaluate(self, batch: list[Sample], answerer: Answerer) -> list[dict[str, Any]] | None:
        """None without CoT (the runner generates and scores). With CoT: the first request (the document, under the
        job's method and budget), then the answer request (no document: a FullKV pass with the full cache, see
        README.md), one record per sample holding both."""
        if not self.cot:
            return None
        tokenizer = answerer.tokenizer
        stops = tuple(self.stop_strings)
        prompts = [encode_sample(self, s, tokenizer, answerer.spec) for s in batch]
        first = answerer.generate(GenerateUntil(tuple(map(tuple, prompts)), self.cot_max_new_tokens, stops))
        stats = first.stats
        cots = [decode_prediction(self, first.tokens[row], tokenizer, s).strip() for row, s in enumerate(batch)]
        answers = [self.answer_sample(s, cot) for s, cot in zip(batch, cots)]
        prompts2 = [encode_sample(self, s, tokenizer, answerer.spec) for s in answers]
        second = answerer.generate(GenerateUntil(tuple(map(tuple, prompts2)), self.max_new_tokens, stops,
                                                 full_cache=True))
        n = len(batch)
        records = []
        for row, sample in enumerate(batch):
            raw = decode_prediction(self, second.tokens[row], tokenizer, sample)
            prediction = self.postprocess(raw, sample)
            records.append({
                "id": sample.id,
                "prediction": prediction,
                "raw_prediction": raw,
                "answers": sample.answers,
                "score": self.score(prediction, sample),
                "meta": sample.meta,
                "cot": cots[row],
                "prompt_tokens": len(prompts[row]),
                "answer_prompt_tokens": len(prompts2[row]),
                "new_tokens": len(first.tokens[row]) + len(second.tokens[row]),
                "cot_new_tokens": len(first.tokens[row]),
                "answer_new_tokens": len(second.tokens[row]),
                "prefill_seconds": (stats.prefill_seconds + second.stats.prefill_seconds) / n,
                "decode_seconds": (stats.decode_seconds + second.stats.decode_seconds) / n,
                "decode_steps": stats.decode_steps + second.stats.decode_steps,
                "batch_size": n,
                "resident_kv_bytes": stats.resident_kv_bytes // n,
                "resident_kv_bytes_final": stats.resident_kv_bytes_final // n,
                "layer_entries": stats.layer_entries,
                "attended_tokens_mean": round(stats.attended_tokens_mean, 2),
            })
        return records

    # ---- scores ----
    def score(self, prediction: str, sample: Sample) -> float:
        """``judge``: 1 when ``extract_answer(prediction)`` is the row's answer, else 0 (0.25 for no answer with
        ``compensated``)."""
        return judge(prediction, sample.meta["answer"], self.compensated)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``result.py``: ``score`` (Overall), ``difficulty`` {easy, hard}, ``length`` {short, medium, long}, each
        accuracy × 100 rounded to 1 decimal; ``counts``; ``no_answer`` (responses without an extractable letter)."""
        out = summarize([(float(r["score"]), r["meta"]["difficulty"], r["meta"]["length"]) for r in records])
        out["no_answer"] = sum(extract_answer(str(r.get("prediction", ""))) is None for r in records)
        return out

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_file"}  # where, not what
        templates = [TEMPLATE_0SHOT_COT, TEMPLATE_0SHOT_COT_ANS] if self.cot else [TEMPLATE_0SHOT]
        return {
            **super().protocol(),
            **fields,
            "source": SOURCE,
            "data": f"{HUB_REPO} split {HUB_SPLIT} (or the same rows from task.data_file)",
            "prompts_sha256": hashlib.sha256("\0".join(templates).encode()).hexdigest()[:16],
            "extract": "pred.py extract_answer: strip '*', 'The correct answer is \\(([A-D])\\)' then "
                       "'The correct answer is ([A-D])'",
            "truncation": "tokenizer.encode(prompt) [:n//2] + [-n//2:], decoded skipping special tokens",
        }


__all__ = ["LongBenchV2Task"]
