"""InfiniteBench (∞Bench, Zhang et al., ACL 2024) as OpenBMB/InfiniteBench@88b3daa runs open models.

``src/eval_yarn_mistral.py`` (the protocol of every open model upstream): ``create_prompt`` fills
``yarn_mistral_templates[task]`` (no chat template), the whole prompt is middle-truncated to ``TRUNCATE_LEN = 128 *
1024`` tokens (first and last half, decoded and re-encoded), greedy generation up to
``DATA_NAME_TO_MAX_NEW_TOKENS[task]`` tokens, the decoded generation is scored as is by ``compute_scores.py``
against ``get_answer(row)``; a task's score is the plain mean. Templates, max new tokens and answer prefixes are
data in ``prompts.json``; the scorers are in ``kvbench/metrics/infinitebench.py``. reference/benchmarks.md
section 2; README.md in this folder.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvbench.errors import ConfigError, DataError
from kvbench.metrics.infinitebench import MULTIPLE_CHOICE, official_label, score_one
from kvbench.tasks import check_common, check_names, protocol_fields
from kvbench.tasks.base import Sample, Task, question_after
from kvbench.tasks.infinitebench.data import check_data_dir, download_official, file_name, read_rows
from kvbench.tasks.infinitebench.scoring import summarize
from kvbench.tasks.records import group_in_order

PROTOCOL: dict[str, Any] = json.loads(Path(__file__).with_name("prompts.json").read_text(encoding="utf-8"))
TASKS: list[str] = PROTOCOL["tasks"]
TEMPLATES: dict[str, str] = PROTOCOL["templates"]
MAX_NEW_TOKENS: dict[str, int] = PROTOCOL["max_new_tokens"]
ANSWER_PREFIX: dict[str, str] = PROTOCOL["answer_prefix"]
TRUNCATE_LEN: int = PROTOCOL["truncate_len"]  # 131072
_FUNC_CALL = re.compile(r"func_[0-9]+\(\-?[0-9]+\)")
_TARGET = re.compile(r"The .+ of")


def prompt_fields(task: str, row: dict[str, Any]) -> dict[str, str]:
    """The template fields ``eval_utils.create_prompt`` fills for one row (a superset is harmless to ``format``).

    code_run: ``func_call`` = the first ``func_<n>(<int>)`` of ``input``, ``func`` its name; math_find: ``prefix =
    f"What is {target} in the following list?"`` with ``target = re.findall(r"The .+ of", input)[0].lower()[:-3]``;
    longbook_*: ``question = input``; longbook_choice_eng / code_debug: ``OPTION_A..D = options[0..3]``.
    """
    fields = {"context": row["context"], "input": row["input"], "question": row["input"]}
    if task in MULTIPLE_CHOICE:
        fields.update({f"OPTION_{letter}": row["options"][i] for i, letter in enumerate("ABCD")})
    if task == "code_run":
        calls = _FUNC_CALL.findall(row["input"])
        if not calls:
            raise DataError(f"code_run: no func_<n>(<int>) call in the input {row['input']!r:.100}")
        fields.update(func_call=calls[0], func=calls[0].split("(")[0])
    if task == "math_find":
        targets = _TARGET.findall(row["input"])
        if not targets:
            raise DataError(f"math_find: no 'The ... of' in the input {row['input']!r:.100}")
        fields["prefix"] = f"What is {targets[0].lower()[:-3]} in the following list?"
    return fields


@dataclass
class InfiniteBenchTask(Task):
    """InfiniteBench, the 12 tasks, with the official open-model protocol.

    datasets: tasks in order (default: all 12; e.g. ``[passkey, kv_retrieval, longbook_qa_eng]``).
    data_dir: a directory with the official ``<task>.jsonl`` files; null downloads each selected file once from the
        hub dataset xinrongzhang2022/InfiniteBench (hub cache).
    chat_template: false = official (raw template, no chat template); true = the template up to its answer prefix
        ("The pass key is", "Answer:", ...) as the user turn and that prefix starting the assistant turn.
    stop_strings: extra stops (official: none; generation ends at EOS or the task's max new tokens).
    truncate_to: middle-truncation budget of the raw prompt; 131072 = upstream ``TRUNCATE_LEN`` (yarn-mistral,
        chatglm3; its Yi scripts use 200000); null = the model config's ``max_input_tokens`` (e.g. OmniKV's 128500).
        Capped at the model's window minus the task's max new tokens.

    Max new tokens are per task (``sample.max_new_tokens``); ``task.max_new_tokens`` is the largest selected one.
    """

    name: ClassVar[str] = "infinitebench"
    separable_question: ClassVar[bool] = True  # what follows {context} (see inseparable)
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "infinitebench"  # per sample: the task's official scorer (0-1); tasks x100

    datasets: list[str] = field(default_factory=lambda: list(TASKS))
    data_dir: str | None = None
    chat_template: bool = False
    stop_strings: list[str] = field(default_factory=list)
    truncate_to: int | None = TRUNCATE_LEN

    @property
    def max_new_tokens(self) -> int:  # type: ignore[override]
        return max(MAX_NEW_TOKENS[d] for d in self.datasets)

    def validate(self) -> None:
        check_names(self.name, "datasets", self.datasets, TASKS, "InfiniteBench tasks")
        check_common(self)
        if self.data_dir is not None:
            if not isinstance(self.data_dir, str):
                raise ConfigError(f"task {self.name!r}: data_dir must be a path or null; got {self.data_dir!r}")
            check_data_dir(self.name, self.data_dir, list(self.datasets))

    def prepare_data(self) -> None:
        self.data_paths()

    def data_paths(self) -> dict[str, Path]:
        """``{task: path of <task>.jsonl}``: in ``data_dir``, or in the hub cache (downloaded once)."""
        if self.data_dir is not None:
            directory = check_data_dir(self.name, self.data_dir, list(self.datasets))
            return {d: directory / file_name(d) for d in self.datasets}
        return {d: download_official(self.name, d) for d in self.datasets}

    # ---- samples ----
    def samples(self, tokenizer: Any = None) -> list[Sample]:
        """Every row of every selected task, in ``datasets`` order and file order (no tokenizer needed)."""
        out: list[Sample] = []
        for dataset, path in self.data_paths().items():
            seen: set[str] = set()
            for index, row in enumerate(read_rows(path, self.name, needs_options=dataset in MULTIPLE_CHOICE)):
                try:
                    sample = self.make_sample(dataset, index, row)
                except DataError as exc:
                    raise DataError(f"task {self.name!r}: {path} line {row['_line']}: {exc}") from None
                if sample.id in seen:  # keep ids unique (records are resumed by id)
                    sample.id = f"{sample.id}#{index}"
                seen.add(sample.id)
                out.append(sample)
        return out

    def inseparable(self) -> list[str]:
        """math_calc's template ends with its context ("Expression: {context}\nValues:"): in chat mode "Values:" is
        the assistant prefix and nothing is left to ask after the context."""
        return ["math_calc"] if self.chat_template and "math_calc" in self.datasets else []

    def make_sample(self, dataset: str, index: int, row: dict[str, Any]) -> Sample:
        """One official row -> Sample: the filled template, the official label (``meta["label"]``, typed) and,
        in chat mode, the template's tail as the assistant prefix."""
        fields = prompt_fields(dataset, row)
        prompt = TEMPLATES[dataset].format(**fields)
        prefix = ANSWER_PREFIX[dataset].format(**fields) if self.chat_template else ""
        if prefix:
            prompt = prompt[: len(prompt) - len(prefix)].rstrip()
        label = official_label(dataset, row["answer"], row.get("options"))
        answers = [str(v) for v in label] if isinstance(label, list) else [str(label)]
        row_id = row.get("id")
        return Sample(
            id=f"{dataset}/{row_id if row_id is not None else index}",
            prompt=prompt,
            # what follows the context (empty for math_calc in chat mode, whose template ends with it: not separable)
            question=(question_after(prompt, fields["context"]) or None) if fields.get("context") else None,
            answers=answers,
            assistant_prefix=prefix,
            max_new_tokens=MAX_NEW_TOKENS[dataset],
            meta={"dataset": dataset, "index": index, "row_id": row_id, "label": label,
                  "options": row.get("options") or [], "max_new_tokens": MAX_NEW_TOKENS[dataset]},
        )

    # ---- scoring ----
    def postprocess(self, prediction: str, sample: Sample) -> str:
        """Unchanged: upstream scores the decoded generation as is (each scorer strips where it does)."""
        return prediction

    def score(self, prediction: str, sample: Sample) -> float:
        """The task's official scorer against the typed label (0-1)."""
        return score_one(sample.meta["dataset"], prediction, sample.meta["label"])

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``datasets``: per task ``round(100 * mean, 2)``; ``official_mean``: the unrounded mean in [0, 1] that
        ``compute_scores.py`` prints; ``score``: plain mean over tasks of ``datasets``."""
        groups = group_in_order(((r["meta"]["dataset"], float(r["score"])) for r in records), self.datasets)
        return summarize(groups)

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_dir"}  # where, not what
        templates = {d: TEMPLATES[d] for d in self.datasets}
        return {
            **super().protocol(),
            **fields,
            "max_new_tokens_per_task": {d: MAX_NEW_TOKENS[d] for d in self.datasets},
            "templates": "yarn_mistral_templates",
            "templates_sha256": hashlib.sha256(json.dumps(templates, sort_keys=True).encode()).hexdigest()[:16],
            "scorers": {"longbook_sum_eng": "rouge-score rougeLsum F, no stemmer (HF evaluate 'rouge' default)"},
        }


__all__ = ["ANSWER_PREFIX", "MAX_NEW_TOKENS", "TASKS", "TEMPLATES", "TRUNCATE_LEN", "InfiniteBenchTask",
           "prompt_fields"]
