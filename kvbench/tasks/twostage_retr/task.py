"""2StageRetr, OmniKV's synthetic two-step retrieval task (antgroup/OmniKV, ICLR 2025).

Generator: ``tiny_runs/make_2_stage_questions.py`` (a dict of colors + an addition whose result is the key to look
up). Evaluation: ``benchmark/long_bench/cot_pred.py`` (greedy, 200 new tokens, correct if any answer occurs in the
output case-insensitively), with the prompt templates of ``configs/template_for_chat.py``.
reference/benchmarks.md section 8.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.errors import ConfigError
from kvbench.metrics import substring_any
from kvbench.tasks import check_bool, check_common, check_int, check_int_list, check_str, mean_score, protocol_fields
from kvbench.tasks.base import Sample, Task, question_from

# ---- the protocol as data (OmniKV, verbatim) ----
COLORS = (
    "red", "green", "blue", "yellow", "orange", "purple", "pink", "brown", "black", "white", "gray", "cyan",
    "magenta", "indigo", "violet", "beige", "maroon", "navy", "olive", "teal", "lime", "silver", "gold",
)
DICT_LENGTHS = (40, 50, 60, 70, 80, 90, 100, 140, 180, 200)
INSTRUCTION = (
    "Let's play a game. You have a dict and a mathematical addition equation. "
    "The keys of a dictionary can be any number. "
    "You need to find the corresponding key value in the dictionary "
    "after performing the addition and output the value corresponding to that key."
)
COT_SENTENCE = (
    "MUST first output the result of the addition, and then answer the corresponding value based on the result."
)
# cot_pred.py, cot=False: the generator's own CoT sentence is replaced ...
DIRECT_SENTENCE = "Directly answer the corresponding color based on the equation result."
# ... and this is appended to the chat template (after the assistant header).
DIRECT_PREFIX = (
    "The equation result should be used as a key to find the value in the dictionary.\n"
    "Then, i will directly give the color. The corresponding color is"
)
# template "llama" (the model's chat template): system prompts and assistant prefixes of llama_cot_2stage / llama.
LLAMA_COT_SYSTEM = "You are a helpful assistant. "  # trailing space as in llama_cot_2stage
LLAMA_SYSTEM = "You are a helpful assistant."
LLAMA_COT_PREFIX = (
    "First, for a precise answer, we can break down this multi-hop question into two to four sub-questions, "
    "as follows:"
)
# template "yi" (raw strings; Yi-9B-200K has no chat template). cot_pred.py swaps in the 2stage-specific template
# only for llama, so Yi CoT runs use the generic "yi_cot" template.
YI_COT_HEAD = (
    "You are helpful assistant who thinks step by step.\nYou will give your final answer in less than 80 words.\n"
)
YI_COT_PREFIX = "\nEvidence (less than 5 steps) then final answer: Step 1:"
YI_HEAD = "You are helpful assistant.\n"
TEMPLATES = ("llama", "yi")


def make_one(rng: random.Random, dict_len: int) -> tuple[str, str, dict[str, int]]:
    """OmniKV ``make_one``: (prompt, answer color, {key, num_a, num_b}), same random calls in the same order."""
    d = {i: rng.choice(COLORS) for i in range(dict_len)}
    final_answer = rng.randint(0, dict_len - 1)
    num_a = rng.randint(0, final_answer)
    num_b = final_answer - num_a
    prompt = INSTRUCTION + f" The Dict is {d}\n" + f"The equation is {num_a} + {num_b} = ?\n" + COT_SENTENCE
    return prompt, d[final_answer], {"key": final_answer, "num_a": num_a, "num_b": num_b}


@dataclass
class TwoStageRetrTask(Task):
    """OmniKV 2StageRetr: accuracy (x100) of finding ``dict[a + b]`` in a color dict, CoT or direct.

    num_samples: 100 (OmniKV's ``__main__``; the function default is 150), dict sizes cycling ``dict_lengths``.
    seed: OmniKV's generator sets no seed and its jsonl is not published, so kvbench draws its own fixed set with
        ``random.Random(seed)``, calling ``choice``/``randint`` exactly as ``make_one`` does.
    cot: true (default) = OmniKV's multi-step experiments (``shells/temp_2stage.py`` runs only ``*.cot.json``
        configs; cot requires the chat template there): the assistant turn starts with the ``llama_cot_2stage``
        prefix. false = the MUST sentence is replaced by "Directly answer ..." and the assistant turn starts with
        "The equation result should be used ... The corresponding color is".
    template: "llama" = the model's chat template with OmniKV's Llama-3 system prompt and prefixes (needs
        chat_template=true when cot); "yi" = OmniKV's raw Yi strings (``yi_cot`` / ``yi``), chat_template=false,
        and OmniKV used max_new_tokens=50 for Yi.
    """

    name: ClassVar[str] = "2stageretr"
    separable_question: ClassVar[bool] = True  # the equation follows the dict
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "substring_any"
    score_scale: ClassVar[float] = 100.0  # 0/1 per sample, accuracy in percent

    num_samples: int = 100
    dict_lengths: list[int] = field(default_factory=lambda: list(DICT_LENGTHS))
    seed: int = 42
    cot: bool = True
    template: str = "llama"
    max_new_tokens: int = 200
    chat_template: bool = True
    stop_strings: list[str] = field(default_factory=list)
    truncate_to: int | None = None

    def validate(self) -> None:
        check_common(self)
        check_int(self.name, "num_samples", self.num_samples)
        check_int_list(self.name, "dict_lengths", self.dict_lengths)
        check_int(self.name, "seed", self.seed, minimum=0)
        check_bool(self.name, "cot", self.cot)
        check_str(self.name, "template", self.template, TEMPLATES)
        if self.template == "llama" and self.cot and not self.chat_template:
            raise ConfigError(
                "task '2stageretr': cot=true needs chat_template=true with template=llama (OmniKV asserts "
                "use_chat_template when cot); got chat_template=false"
            )
        if self.template == "yi" and self.chat_template:
            raise ConfigError(
                "task '2stageretr': template=yi is OmniKV's raw Yi prompt; set chat_template=false (got true)"
            )

    def render(self, generated: str) -> tuple[str, str | None, str]:
        """(user prompt, system prompt, assistant prefix) for the configured template and mode."""
        text = generated if self.cot else generated.replace(COT_SENTENCE, DIRECT_SENTENCE)
        if self.template == "yi":
            if self.cot:
                return YI_COT_HEAD + text, None, YI_COT_PREFIX
            return YI_HEAD + text, None, DIRECT_PREFIX
        if self.cot:
            return text, LLAMA_COT_SYSTEM, LLAMA_COT_PREFIX
        # Without a chat template OmniKV sends the bare prompt (the appended text lives in the template).
        return text, LLAMA_SYSTEM, (DIRECT_PREFIX if self.chat_template else "")

    def samples(self, tokenizer: Any) -> list[Sample]:
        rng = random.Random(self.seed)
        out = []
        for i in range(self.num_samples):
            dict_len = self.dict_lengths[i % len(self.dict_lengths)]
            generated, answer, meta = make_one(rng, dict_len)
            prompt, system, prefix = self.render(generated)
            out.append(
                Sample(
                    id=f"S{i:03d}_N{dict_len}",
                    prompt=prompt,
                    question=question_from(prompt, "The equation is "),
                    answers=[answer],
                    meta={"dict_len": dict_len, **meta},
                    system=system,
                    assistant_prefix=prefix,
                )
            )
        return out

    def score(self, prediction: str, sample: Sample) -> float:
        return substring_any(prediction, sample.answers)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Accuracy x100 (OmniKV prints correct/N in [0, 1]) and per dict size."""
        by_len: dict[int, list[dict[str, Any]]] = {}
        for record in records:
            by_len.setdefault(int((record.get("meta") or {})["dict_len"]), []).append(record)
        return {
            "score": mean_score(records, scale=self.score_scale, digits=2),
            "n": len(records),
            "by_dict_len": {str(k): mean_score(v, scale=100.0, digits=2) for k, v in sorted(by_len.items())},
        }

    def protocol(self) -> dict[str, Any]:
        return {**super().protocol(), **protocol_fields(self)}


__all__ = ["COLORS", "DICT_LENGTHS", "TwoStageRetrTask", "make_one"]
