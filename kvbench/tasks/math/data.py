"""Data of the math tasks: the official files from the hub (pinned where a commit is known) or from ``task.data_dir``.

Where each reference evaluation takes its problems (README.md of this package says more):

- MATH-500: ``HuggingFaceH4/MATH-500`` ``test.jsonl`` (TriAttention ``triattention/evaluation/data_loader.py``; R-KV
  commits the same 500 rows as ``data/math.jsonl``; kvpress loads ``alessiodevoto/math500``, a copy with its
  ``context``/``question`` columns). Rows: ``problem, solution, answer, subject, level, unique_id``.
- AIME 2024: ``HuggingFaceH4/aime_2024`` (TriAttention; R-KV commits the same 30 problems, ids 60-89, as
  ``data/aime24.jsonl``). Rows: ``id, problem, solution, answer, url`` (R-KV's copy adds ``question``).
- AIME 2025: ``opencompass/AIME2025`` ``aime2025-I.jsonl`` + ``aime2025-II.jsonl`` (the source kvpress's
  ``evaluation/benchmarks/aime25/README.md`` names; kvpress loads its copy ``alessiodevoto/aime25``, TriAttention
  ``MathArena/aime_2025``). Rows: ``question, answer``.

A row is read with any of the field names these copies use (``problem``/``question``/``Problem``,
``answer``/``Answer``), so a file exported by any of the three harnesses loads as it is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import DataError
from kvbench.hub import dataset_file, dataset_snapshot
from kvbench.tasks.records import json_lines, utf8_lines


@dataclass(frozen=True)
class Source:
    """Where one benchmark's problems come from.

    hub: the hub dataset; revision: its pinned commit (README.md says where each sha comes from); hub_files: the files
        read from it (None: every ``*.parquet``/``*.jsonl`` of a snapshot, for datasets whose data files carry the
        hub's generated names); local: the file groups accepted under ``task.data_dir``, first complete group wins
        (each group is one layout: the hub's, R-KV's, TriAttention's); sha256: the expected digest of hub files
        where it is known (a downloaded file that differs is refused)."""

    hub: str
    revision: str | None
    hub_files: tuple[str, ...] | None
    local: tuple[tuple[str, ...], ...]
    sha256: tuple[tuple[str, str], ...] = ()


SOURCES: dict[str, Source] = {
    "math500": Source(
        hub="HuggingFaceH4/MATH-500",
        revision="ff5b20257d8185524591543f8ff5993951537bb8",  # main on 2024-11-15 ("Update README.md"), test.jsonl
        hub_files=("test.jsonl",),
        local=(("test.jsonl",), ("math500.jsonl",), ("math.jsonl",)),
    ),
    "aime24": Source(
        hub="HuggingFaceH4/aime_2024",
        revision="2fe88a2f1091d5048c0f36abc874fb997b3dd99a",  # main as the Hub API gave it on 2026-08-11 (README.md)
        hub_files=None,
        local=(("aime24.jsonl",), ("aime_2024.jsonl",), ("train.jsonl",), ("test.jsonl",)),
    ),
    "aime25": Source(
        hub="opencompass/AIME2025",
        revision="a6ad95f611d72cf628a80b58bd0432ef6638f958",  # as another harness pins it, with the files' digests
        hub_files=("aime2025-I.jsonl", "aime2025-II.jsonl"),
        local=(("aime2025-I.jsonl", "aime2025-II.jsonl"), ("aime25.jsonl",), ("aime_2025.jsonl",), ("test.jsonl",),
               ("train.jsonl",)),
        sha256=(("aime2025-I.jsonl", "b91b3c96f05d9635d2a0692b124ebe023c1ff59cb19c074275e6c4b349d0659e"),
                ("aime2025-II.jsonl", "16a2dcfbbf9db1b11f8a69a3ba5e4cac73e3641b19a37e2307e9c12240bbed5e")),
    ),
}

PROBLEM_FIELDS = ("problem", "question", "Problem", "Question")
ANSWER_FIELDS = ("answer", "Answer")
ID_FIELDS = ("unique_id", "id", "ID", "problem_idx", "idx")


def remedy(benchmark: str) -> str:
    names = " or ".join("+".join(group) for group in SOURCES[benchmark].local)
    return f"put the official file(s) ({names}) in a directory and set task.data_dir=<that directory>"


def local_files(task: str, benchmark: str, data_dir: str) -> list[Path]:
    """The first complete file group of ``SOURCES[benchmark].local`` under ``data_dir``, else any ``*.parquet`` there
    (the hub's export); one DataError naming the directory and the accepted names otherwise."""
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise DataError(f"task {task!r}: data_dir={data_dir!r} is not a directory ({remedy(benchmark)})")
    for group in SOURCES[benchmark].local:
        paths = [directory / name for name in group]
        if all(p.is_file() for p in paths):
            return paths
    parquet = sorted(directory.rglob("*.parquet"))
    if parquet:
        return parquet
    names = ", ".join("+".join(group) for group in SOURCES[benchmark].local)
    raise DataError(f"task {task!r}: data_dir={str(directory)!r} has none of {names} (nor a .parquet export)")


def hub_files(task: str, benchmark: str) -> list[Path]:
    """The benchmark's files from its hub dataset (the hub cache first; one refusal line when the hub cannot be
    reached, at once)."""
    source = SOURCES[benchmark]
    if source.hub_files is not None:
        paths = [dataset_file(task, source.hub, name, remedy(benchmark), revision=source.revision)
                 for name in source.hub_files]
        digests = dict(source.sha256)
        for name, path in zip(source.hub_files, paths):
            if name in digests and hashlib.sha256(path.read_bytes()).hexdigest() != digests[name]:
                raise DataError(f"task {task!r}: {name} of the hub dataset {source.hub}@{source.revision} is not the "
                                f"pinned file (sha256 differs from {digests[name][:12]}...); {remedy(benchmark)}")
        return paths
    folder = dataset_snapshot(task, source.hub, ["*.parquet", "*.jsonl"], remedy(benchmark), revision=source.revision)
    found = sorted(p for p in folder.rglob("*") if p.suffix in (".parquet", ".jsonl") and p.is_file())
    if not found:
        raise DataError(f"task {task!r}: the hub dataset {source.hub} holds no .parquet or .jsonl file; "
                        f"{remedy(benchmark)}")
    return found


def _rows(path: Path, task: str) -> list[tuple[int, dict[str, Any]]]:
    if path.suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise DataError(f"task {task!r}: cannot read {path} ({type(exc).__name__}: {exc})") from None
        return [(i + 1, json.loads(frame.iloc[i:i + 1].to_json(orient="records"))[0]) for i in range(len(frame))]
    return list(json_lines(utf8_lines(path.read_bytes(), f"task {task!r}: {path}"), f"task {task!r}: {path}"))


def _first(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((row[n] for n in names if row.get(n) not in (None, "")), None)


def aime_part(row: dict[str, Any], path: Path, index: int) -> str | None:
    """"I" or "II" for an AIME row: from its AoPS url, its file name (opencompass ``aime2025-II.jsonl``) or, for
    MathArena's 1-30 ``problem_idx``, the half it is in; None where nothing says."""
    url = str(row.get("url") or "")
    for part in ("II", "I"):
        if f"AIME_{part}_" in url or path.stem.endswith(f"-{part}"):
            return part
    idx = row.get("problem_idx")
    if isinstance(idx, int) and 1 <= idx <= 30:
        return "I" if idx <= 15 else "II"
    return None


def read_problems(paths: list[Path], task: str, benchmark: str) -> list[dict[str, Any]]:
    """``{"id", "problem", "answer", "meta"}`` per row of ``paths`` in file order; DataError for a row without a
    problem or an answer, or for duplicate ids."""
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()
    for path in paths:
        for number, row in _rows(path, task):
            problem, answer = _first(row, PROBLEM_FIELDS), _first(row, ANSWER_FIELDS)
            if not isinstance(problem, str) or answer is None:
                raise DataError(f"task {task!r}: {path} line {number} has no problem ({'/'.join(PROBLEM_FIELDS)}) "
                                f"or no answer ({'/'.join(ANSWER_FIELDS)})")
            ident = _first(row, ID_FIELDS)
            ident = str(ident) if ident is not None else f"{path.stem}-{number}"
            if ident in seen:
                raise DataError(f"task {task!r}: {path} line {number} repeats the id {ident!r}")
            seen.add(ident)
            meta: dict[str, Any] = {"source_file": path.name}
            if benchmark == "math500":
                meta.update({k: row[k] for k in ("subject", "level") if k in row})
            else:
                meta["part"] = aime_part(row, path, number)
            problems.append({"id": ident, "problem": problem, "answer": str(answer).strip(), "meta": meta})
    if not problems:
        raise DataError(f"task {task!r}: {', '.join(str(p) for p in paths)} hold no problems")
    return problems


__all__ = ["SOURCES", "Source", "aime_part", "hub_files", "local_files", "read_problems", "remedy"]
