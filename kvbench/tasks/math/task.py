"""MATH-500, AIME 2024 and AIME 2025: reasoning benchmarks whose KV cache grows during a long chain of thought.

One protocol, three datasets (``task=math500|aime24|aime25``). The defaults reproduce TriAttention's evaluation
(WeianMao/triattention c3744ee6, ``triattention/configs/shared/runner_defaults.yaml`` and ``scripts/worker.py``), the
one the issue's experiment grid follows (DeepSeek-R1-Distill-Qwen-7B and Qwen3-8B, budgets 512-4096):

- prompt ``rkv`` (R-KV's "You are given a math problem ..." template, which TriAttention copies) without a chat
  template (TriAttention ``use_chat_template: false``; R-KV tokenizes the raw prompt);
- sampling temperature 0.6, top-p 0.95, n = 8 samples per AIME problem and 1 per MATH-500 problem (B's runner
  consumes ``sampling``; top-k is left to the caller: TriAttention leaves it to HF's generation config);
- ``max_length`` 32768 (AIME) / 8192 (MATH-500) tokens of prompt plus generation, as TriAttention's and R-KV's
  ``max_length``: each sample gets ``max_length - prompt tokens`` new tokens (never more than ``max_new_tokens``);
- the answer is read after ``</think>`` (``think``), graded by math-verify (``kvbench.tasks.math.grader``).

kvpress's protocol is ``prompt=kvpress chat_template=true`` with greedy decoding (``sampling.temperature=0``) and
``max_length=null max_new_tokens=32000`` (AIME 2025) / ``4096`` (MATH-500); R-KV's is greedy with ``max_length`` 16384
(AIME 2024) / 8192 (MATH-500). README.md lists every difference, graders included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvbench.errors import ConfigError
from kvbench.tasks import check_bool, check_common, check_int, check_str, mean_score, protocol_fields
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.math import data, grader

PROMPTS: dict[str, dict[str, str]] = {
    k: v for k, v in json.loads((Path(__file__).with_name("prompts.json")).read_text(encoding="utf-8")).items()
    if not k.startswith("_")
}
#: MATH-500's seven subjects (``subset`` values -> the dataset's ``subject``)
MATH_SUBJECTS = {
    "algebra": "Algebra", "counting_and_probability": "Counting & Probability", "geometry": "Geometry",
    "intermediate_algebra": "Intermediate Algebra", "number_theory": "Number Theory", "prealgebra": "Prealgebra",
    "precalculus": "Precalculus",
}
AIME_PARTS = ("I", "II")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "n")


def check_sampling(task: str, value: Any) -> None:
    """``sampling``: null (greedy) or a mapping of temperature >= 0, 0 < top_p <= 1, top_k >= 0, n >= 1 (any of
    them null: not set by the task)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ConfigError(f"task {task!r}: sampling must be null or a mapping of {', '.join(SAMPLING_KEYS)}; "
                          f"got {value!r}")
    unknown = [k for k in value if k not in SAMPLING_KEYS]
    if unknown:
        raise ConfigError(f"task {task!r}: sampling has unknown key(s) {', '.join(map(str, unknown))}; valid keys: "
                          f"{', '.join(SAMPLING_KEYS)}")
    checks = {
        "temperature": (lambda v: isinstance(v, (int, float)) and v >= 0, "a number >= 0"),
        "top_p": (lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "a number in (0, 1]"),
        "top_k": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: off)"),
        "n": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    }
    for key, item in value.items():
        ok, what = checks[key]
        if item is not None and (isinstance(item, bool) or not ok(item)):
            raise ConfigError(f"task {task!r}: sampling.{key} must be {what}; got {item!r}")


@dataclass
class MathTask(Task):
    """A reasoning math benchmark: one problem per sample, answer graded by math-verify, score = accuracy x 100.

    data_dir: a folder with the official file(s) (``kvbench.tasks.math.data.SOURCES``), or null for the hub dataset.
    subset: ``all``, a MATH-500 subject (``algebra``, ``number_theory`` ...) or an AIME part (``I``, ``II``).
    prompt: a key of ``prompts.json`` (``rkv``: R-KV / TriAttention, ``kvpress``, ``deepseek_r1``).
    system: a system prompt for the chat template (null: none; TriAttention's chat mode would use "You are a helpful
        assistant.", only with its ``use_chat_template: true``).
    chat_template: apply the model's chat template (TriAttention and R-KV: false; kvpress: true).
    enable_thinking: the chat template's ``enable_thinking`` variable (Qwen3's: false answers without thinking, as
        kvpress's evaluation renders it); null: the template's default, the variable not passed (left out of the key).
    think: ``after_close`` (the answer is read after the last ``</think>``; a trace cut inside thinking has none) or
        ``ignore`` (the whole output, as the three reference scripts read it).
    max_new_tokens / max_length: new tokens per sample are ``min(max_new_tokens, max_length - prompt tokens)``;
        ``max_length`` null: ``max_new_tokens`` alone (kvpress's ``max_new_tokens``).
    sampling: the reference evaluation's decoding (temperature, top_p, top_k, n); null: greedy. The job's sampling is
        this updated by the top-level ``sampling`` group (interfaces of issue 40).
    """

    name: ClassVar[str] = "math"
    version: ClassVar[str] = "1"
    #: fields left out of the job key while null (results stored before they existed keep their hash)
    keyed_when_set: ClassVar[tuple[str, ...]] = ("enable_thinking",)
    metric: ClassVar[str] = "math_verify_accuracy"
    benchmark: ClassVar[str] = "math500"
    score_scale: ClassVar[float] = 100.0  # 0/1 per problem, accuracy in percent (R-KV's and TriAttention's acc)

    data_dir: str | None = None
    subset: str = "all"
    prompt: str = "rkv"
    system: str | None = None
    chat_template: bool = False
    enable_thinking: bool | None = None
    think: str = "after_close"
    max_new_tokens: int = 32768
    max_length: int | None = 32768
    sampling: dict[str, Any] | None = field(
        default_factory=lambda: {"temperature": 0.6, "top_p": 0.95, "top_k": None, "n": 8})
    stop_strings: list[str] = field(default_factory=list)
    truncate_to: int | None = None

    # ---- configuration ----
    def subsets(self) -> tuple[str, ...]:
        return ("all", *(MATH_SUBJECTS if self.benchmark == "math500" else AIME_PARTS))

    def validate(self) -> None:
        check_common(self)
        check_str(self.name, "subset", self.subset, self.subsets())
        check_str(self.name, "prompt", self.prompt, tuple(PROMPTS))
        if self.system is not None:
            check_str(self.name, "system", self.system)
        check_bool(self.name, "chat_template", self.chat_template)
        if self.enable_thinking is not None:
            check_bool(self.name, "enable_thinking", self.enable_thinking)
            if not self.chat_template:
                raise ConfigError(f"task {self.name!r}: enable_thinking={self.enable_thinking} is a chat template "
                                  "variable; it needs chat_template=true (null: the template's default)")
        check_str(self.name, "think", self.think, grader.THINK_MODES)
        if self.max_length is not None:
            check_int(self.name, "max_length", self.max_length, minimum=2)
        check_sampling(self.name, self.sampling)
        if self.data_dir is not None:
            check_str(self.name, "data_dir", self.data_dir)
            data.local_files(self.name, self.benchmark, self.data_dir)

    # ---- data ----
    def files(self) -> list[Path]:
        if self.data_dir is not None:
            return data.local_files(self.name, self.benchmark, self.data_dir)
        return data.hub_files(self.name, self.benchmark)

    def prepare_data(self) -> None:
        self.files()

    def problems(self) -> list[dict[str, Any]]:
        """The selected problems (``subset``) in file order."""
        rows = data.read_problems(self.files(), self.name, self.benchmark)
        if self.subset == "all":
            return rows
        if self.benchmark == "math500":
            return [r for r in rows if r["meta"].get("subject") == MATH_SUBJECTS[self.subset]]
        unknown = [r["id"] for r in rows if r["meta"].get("part") is None]
        if unknown:
            raise ConfigError(f"task {self.name!r}: subset={self.subset!r} needs each problem's AIME part, which "
                              f"the data does not give for {unknown[0]!r} (use subset=all)")
        return [r for r in rows if r["meta"]["part"] == self.subset]

    def render(self, problem: str) -> str:
        """The user text of one problem (before any chat template)."""
        return PROMPTS[self.prompt]["template"].replace("{problem}", problem)

    def _templated(self, tokenizer: Any) -> bool:
        return bool(self.chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None))

    def _chat_text(self, tokenizer: Any, prompt: str) -> str:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **self.chat_template_kwargs())

    def chat_template_kwargs(self) -> dict[str, Any]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    def prompt_tokens(self, tokenizer: Any, prompt: str) -> int:
        """Tokens of the encoded prompt, counted as ``kvbench.tasks.encoding.encode_sample`` encodes it (chat template
        on: the rendered template without added special tokens; off: the raw prompt with the tokenizer's own)."""
        if self._templated(tokenizer):
            return len(tokenizer.encode(self._chat_text(tokenizer, prompt), add_special_tokens=False))
        return len(tokenizer.encode(prompt))

    def think_opened(self, tokenizer: Any) -> bool:
        """Whether the chat template's generation header opens a ``<think>`` block (DeepSeek-R1-Distill's does), so
        that a prediction without ``</think>`` was cut inside its reasoning."""
        if not self._templated(tokenizer):
            return False
        return self._chat_text(tokenizer, "x").rstrip().endswith(grader.THINK_OPEN)

    def samples(self, tokenizer: Any = None) -> list[Sample]:
        opened = self.think_opened(tokenizer)
        out = []
        for row in self.problems():
            prompt = self.render(row["problem"])
            budget = None
            if self.max_length is not None and tokenizer is not None:
                used = self.prompt_tokens(tokenizer, prompt)
                budget = min(self.max_new_tokens, self.max_length - used)
                if budget < 1:
                    raise ConfigError(f"task {self.name!r}: problem {row['id']!r} has {used} prompt tokens, which "
                                      f"leave nothing of max_length={self.max_length}; raise max_length")
            out.append(Sample(
                id=row["id"], prompt=prompt, answers=[row["answer"]], system=self.system, max_new_tokens=budget,
                meta={**row["meta"], "think_opened": opened},
            ))
        return out

    # ---- scoring ----
    def region(self, prediction: str, sample: Sample) -> str | None:
        return grader.answer_region(prediction, self.think, bool(sample.meta.get("think_opened")))

    def score(self, prediction: str, sample: Sample) -> float:
        """1.0 when math-verify finds the answer region equivalent to the reference answer, else 0.0."""
        return 1.0 if grader.is_correct(self.region(prediction, sample), sample.answers[0]) else 0.0

    def majority_key(self, prediction: str, sample: Sample) -> str:
        """The canonical parsed answer (maj@n votes on it; "" for no answer)."""
        return grader.canonical_answer(self.region(prediction, sample))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Accuracy x 100 over all records (R-KV's and TriAttention's ``acc`` scale) and the grader that gave it."""
        return {"score": mean_score(records, scale=self.score_scale, digits=2), "n": len(records),
                "grader": f"math-verify {grader.math_verify_version()}"}

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items()
                  if k != "data_dir" and not (k in self.keyed_when_set and v is None)}
        source = data.SOURCES[self.benchmark]
        return {**super().protocol(), **fields, "prompt_template": PROMPTS[self.prompt]["template"],
                "data": {"hub": source.hub, "revision": source.revision},
                "grader": f"math-verify {grader.math_verify_series()}"}


@dataclass
class Math500Task(MathTask):
    """MATH-500 (HuggingFaceH4/MATH-500): TriAttention's 8192 tokens and one sample per problem."""

    name: ClassVar[str] = "math500"
    benchmark: ClassVar[str] = "math500"
    max_new_tokens: int = 8192
    max_length: int | None = 8192
    sampling: dict[str, Any] | None = field(
        default_factory=lambda: {"temperature": 0.6, "top_p": 0.95, "top_k": None, "n": 1})


@dataclass
class Aime24Task(MathTask):
    """AIME 2024 I + II (HuggingFaceH4/aime_2024): TriAttention's 32768 tokens and 8 samples per problem."""

    name: ClassVar[str] = "aime24"
    benchmark: ClassVar[str] = "aime24"


@dataclass
class Aime25Task(MathTask):
    """AIME 2025 I + II (opencompass/AIME2025): TriAttention's 32768 tokens and 8 samples per problem."""

    name: ClassVar[str] = "aime25"
    benchmark: ClassVar[str] = "aime25"


__all__ = ["AIME_PARTS", "MATH_SUBJECTS", "PROMPTS", "Aime24Task", "Aime25Task", "Math500Task", "MathTask",
           "check_sampling"]
