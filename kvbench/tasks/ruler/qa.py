"""RULER question answering (``scripts/data/synthetic/qa.py``): ``qa_1`` (SQuAD v2 dev) and ``qa_2`` (HotpotQA dev).

Every distinct paragraph of the dataset is a document (sorted). A question's gold document(s) are always in the
prompt; SQuAD first adds the other paragraphs of the same article, then random documents; the documents are
shuffled with the seed and numbered ``"Document {i}:\\n{document}"``. Sample ``i`` asks question ``i`` (answerable
questions only, in file order). Scored with string_match_part: any reference in the prediction counts.

Files (official names, as ``json/download_qa_dataset.sh`` saves them, or the original download names):
``squad.json`` / ``dev-v2.0.json`` and ``hotpotqa.json`` / ``hotpot_dev_distractor_v1.json`` in ``task.data_dir``;
with ``data_dir`` null they are downloaded once from the URLs that script uses into the kvbench cache.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import urllib.request
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kvbench import assets
from kvbench.errors import DataError
from kvbench.tasks.ruler.common import GENERATORS, Prompting, binary_search, fit_sample
from kvbench.tasks.ruler.resources import read_json

DOCUMENT_PROMPT = "Document {i}:\n{document}"
FILES = {"squad": ("squad.json", "dev-v2.0.json"), "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json")}
URLS = {  # download_qa_dataset.sh (HotpotQA falls back to a pinned hub copy)
    "squad": ("https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json",),
    "hotpotqa": (
        "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json",
        "https://huggingface.co/datasets/namlh2004/hotpotqa/resolve/7e54db4656209750ff487f6fdf8e39a66dba136b/"
        "hotpot_dev_distractor_v1.json",
    ),
}


def read_squad(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``read_squad``: answerable questions with their paragraph and the article's other paragraphs."""
    data = read_json(path, "ruler")
    try:
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {doc: i for i, doc in enumerate(docs)}
        qas = []
        for article in data["data"]:
            article_docs = [index[p["context"]] for p in article["paragraphs"]]
            for paragraph in article["paragraphs"]:
                own = index[paragraph["context"]]
                for qa in paragraph["qas"]:
                    if not qa["is_impossible"]:
                        qas.append({"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                    "context": [own], "more_context": [i for i in article_docs if i != own]})
    except (KeyError, TypeError) as exc:
        raise DataError(f"task 'ruler': {path} is not SQuAD v2 JSON (missing {exc})") from None
    return qas, docs


def read_hotpotqa(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``read_hotpotqa``: each question with all its (distractor-setting) paragraphs, ``"{title}\\n{text}"``."""
    data = read_json(path, "ruler")
    try:
        docs = sorted({f"{title}\n{''.join(sentences)}" for d in data for title, sentences in d["context"]})
        index = {doc: i for i, doc in enumerate(docs)}
        qas = [{"query": d["question"], "outputs": [d["answer"]],
                "context": [index[f"{title}\n{''.join(sentences)}"] for title, sentences in d["context"]]}
               for d in data]
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"task 'ruler': {path} is not HotpotQA JSON ({exc})") from None
    return qas, docs


def find_file(dataset: str, data_dir: str | None) -> Path | None:
    directory = Path(data_dir).expanduser() if data_dir else assets.cache_dir() / "data" / "ruler"
    for name in FILES[dataset]:
        if (directory / name).is_file():
            return directory / name
    return None


def download(dataset: str) -> Path:
    """Fetch the official file into ``<kvbench cache>/data/ruler/`` (DataError naming task.data_dir offline)."""
    target = assets.cache_dir() / "data" / "ruler" / FILES[dataset][0]
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for url in URLS[dataset]:
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                payload = response.read()
            json.loads(payload)  # a proxy's error page is not the dataset
        except Exception as exc:  # offline, HTTP errors, not JSON: all mean "use a local copy"
            errors.append(f"{url}: {type(exc).__name__}")
            continue
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as tmp:
            tmp.write(payload)
        os.replace(tmp.name, target)  # atomic: concurrent jobs see nothing or the whole file
        return target
    raise DataError(
        f"task 'ruler': {dataset} data not found and could not be downloaded ({'; '.join(errors)}); put "
        f"{' or '.join(FILES[dataset])} into a directory and set task.data_dir=<that directory> "
        f"(or drop qa_1/qa_2 from task.tasks)"
    )


@cache
def load(dataset: str, data_dir: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    path = find_file(dataset, data_dir)
    if path is None:
        if data_dir is not None:
            raise DataError(f"task 'ruler': task.data_dir={data_dir!r} has no {' or '.join(FILES[dataset])} "
                            f"(official {dataset} file, needed by {'qa_1' if dataset == 'squad' else 'qa_2'})")
        path = download(dataset)
    return (read_squad if dataset == "squad" else read_hotpotqa)(path)


@dataclass
class QAGenerator:
    """``qa`` with ``dataset`` squad (qa_1) or hotpotqa (qa_2)."""

    dataset: str = "squad"
    data_dir: str | None = None

    def draw(self, index: int, num_docs: int, template: str, rng: random.Random, seed: int) -> tuple[str, list]:
        """``generate_input_output``: question ``index`` with ``num_docs`` documents."""
        qas, docs = load(self.dataset, self.data_dir)
        qa = qas[index]
        gold, more = qa["context"], qa.get("more_context", [])
        if num_docs < len(docs):
            if num_docs - len(gold) > len(more):
                taken = set(gold + more)
                extra = [i for i in range(len(docs)) if i not in taken]
                chosen = gold + more + rng.sample(extra, max(0, num_docs - len(gold) - len(more)))
            else:
                chosen = gold + rng.sample(more, num_docs - len(gold))
            documents = [docs[i] for i in chosen]
        else:
            repeats = (num_docs + len(docs) - 1) // len(docs)
            documents = (docs * repeats)[:num_docs]
        random.Random(seed).shuffle(documents)
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(documents))
        return template.format(context=context, query=qa["query"]), qa["outputs"]

    def samples(self, num_samples: int, max_seq_length: int, prompting: Prompting, seed: int,
                task: str = "qa") -> list[dict[str, Any]]:
        """``generate_samples`` (pre_samples 0): size on question 0, then question ``i`` for sample ``i``."""
        qas, _ = load(self.dataset, self.data_dir)
        if num_samples > len(qas):
            raise DataError(f"task 'ruler': {task} asks for {num_samples} samples but the {self.dataset} file has "
                            f"{len(qas)} answerable questions")
        rng = random.Random(seed)
        template = prompting.full_template("qa")
        new_tokens = GENERATORS["qa"]["tokens_to_generate"]
        incremental = 10

        def total(size: int) -> int:
            text, _ = self.draw(0, size, template, rng, seed)
            return prompting.count_prompt(text, "qa") + new_tokens

        per_doc = (total(incremental) - new_tokens) / incremental
        upper = max(int((max_seq_length / per_doc) * 3), incremental * 2)
        size = binary_search(total, incremental, upper, max_seq_length) or incremental
        rows = []
        for index in range(num_samples):
            def draw(units: int, index: int = index) -> tuple[tuple[str, list, int], int]:
                text, answer = self.draw(index, units, template, rng, seed)
                length = prompting.count_prompt(text, "qa") + new_tokens
                return (text, answer, length), length

            text, answer, length = fit_sample(draw, size, incremental, max_seq_length, task)
            prompt, prefix = prompting.split(text, "qa")
            rows.append({"index": index, "input": prompt, "outputs": answer, "length": length,
                         "answer_prefix": prefix})
        return rows


__all__ = ["DOCUMENT_PROMPT", "FILES", "QAGenerator", "load", "read_hotpotqa", "read_squad"]
