"""``python -m kvbench.score PREDICTIONS.jsonl --benchmark NAME [--out scores.json]``: re-score predictions.

Scores a predictions file from any harness with kvbench's official-equivalent scorers, so numbers from elsewhere can
be compared with kvbench's and with the official code's. One JSON object per line:

    {"dataset": "hotpotqa", "prediction": "Barcelona", "answers": ["Barcelona"]}
    {"dataset": "trec", "prediction": "Individual", "answers": ["Individual"], "all_classes": ["Abbreviation", ...]}
    {"dataset": "qasper", "prediction": "...", "answers": ["..."], "length": 5310}        # LongBench-E buckets
    {"dataset": "code_run", "prediction": "The value is 14", "answers": [14]}             # InfiniteBench

kvbench's generated tasks (``needle``, ``needle_retrieval_head``, ``needle_kvpress``, ``passkey``, ``2stageretr``)
are scored by the task's own metric and aggregate (kvbench/tasks/rescoring.py); their records need no ``dataset``
but ``context_length`` and ``depth`` (``dict_len`` for 2stageretr), top-level or in ``meta``:

    {"prediction": "The pass key is 71432.", "answers": ["71432"], "context_length": 1000, "depth": 50}

Accepted as well: a kvbench job's ``samples.jsonl`` as it is (``dataset``, ``all_classes``, ``length``, ``options``,
``label``, and LEval's ``part`` and ``question_index`` are read from each record's ``meta``), and the official
InfiniteBench results files ``preds_<task>.jsonl`` (``pred``/``prediction`` with ``label``/``ground_truth``; name the
task with ``--dataset``), and LongBench v2's ``results/<model>.jsonl`` of ``pred.py`` (``response``, ``answer``,
``difficulty``, ``length``; ``--benchmark longbench_v2``, ``--compensated`` for result.py's switch).

Each benchmark package provides ``kvbench/tasks/<bench>/scoring.py`` with ``score_records(records) -> {"datasets":
{name: score}, ...aggregates}``, loaded lazily and named by the task's declaration (its ``task_spec.py``'s
``Rescorer``: ``--benchmark`` takes every declared one, also from ``KVBENCH_TASK_PATH``); a benchmark whose module has
not landed exits 2 with one line. Any bad input (missing or unreadable file, bytes that are not UTF-8, a line that is
not JSON, a missing field, an unknown dataset or benchmark) is one line on stderr and exit code 2. The scores are
printed as a table; ``--out FILE`` also writes them as JSON (``-``: JSON on stdout instead of the table).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any, NoReturn

from kvbench.errors import DataError, KVBenchError
from kvbench.tasks.records import json_lines, utf8_lines

ALIASES = {"prediction": ("prediction", "pred"), "answers": ("answers", "ground_truth")}
FROM_META = ("dataset", "all_classes", "length", "options", "label", "part", "question_index")


def benchmarks() -> dict[str, str]:
    """``{benchmark: "module:function"}``: every task whose declaration (``kvbench/tasks/<task>/task_spec.py``, see
    kvbench.tasks.spec) names a re-scorer, in the declared order (the official scorers, then kvbench's generated
    tasks); the same dict while the task search path is unchanged. Also ``BENCHMARKS``."""
    return _derived()[0]


def _derived() -> tuple[dict[str, str], tuple[str, ...], dict[str, dict[str, tuple[str, ...]]]]:
    from kvbench.tasks import spec

    path = spec.search_path()
    if path not in _DERIVED:
        found = spec.rescorers()
        _DERIVED[path] = ({name: r.target for name, r in found.items()},
                          tuple(name for name, r in found.items() if r.single_task),  # no 'dataset' needed
                          {name: dict(r.aliases) for name, r in found.items() if r.aliases})
    return _DERIVED[path]


_DERIVED: dict[tuple, tuple] = {}
#: the module attributes derived from the task declarations: BENCHMARKS (benchmark -> "module:function"),
#: SINGLE_TASK (benchmarks whose records need no 'dataset') and BENCHMARK_ALIASES (per benchmark where its upstream
#: files name fields otherwise: LongBench v2's results (pred.py) hold the response as ``response`` and the extracted
#: letter as ``pred``, which must not be scored as the response, the key as ``answer``)
_DERIVED_NAMES = ("BENCHMARKS", "SINGLE_TASK", "BENCHMARK_ALIASES")


def __getattr__(name: str) -> Any:
    if name in _DERIVED_NAMES:
        return _derived()[_DERIVED_NAMES.index(name)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UsageError(KVBenchError):
    """A bad command line (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{message} (python -m kvbench.score --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m kvbench.score", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("predictions", help="JSONL file: one prediction per line (see module docstring)")
    parser.add_argument("--benchmark", required=True, help=f"one of {', '.join(benchmarks())}")
    parser.add_argument("--out", help="write the scores as JSON to this file ('-': to stdout instead of the table)")
    parser.add_argument("--dataset", help="dataset of records without one (e.g. an official preds_<task>.jsonl)")
    parser.add_argument("--math-calc-drop-first", action="store_true",
                        help="InfiniteBench math_calc: drop the first predicted number, as compute_scores.py does for "
                             "--model_name gpt4 (its default model name)")
    parser.add_argument("--rouge-aggregation", choices=("instance", "corpus"),
                        help="ZeroSCROLLS ROUGE aggregation (the task's rouge_aggregation; default: instance)")
    parser.add_argument("--compensated", action="store_true",
                        help="LongBench v2: a response without an extractable answer scores 0.25 (result.py's switch)")
    return parser


def load_scorer(benchmark: str) -> Any:
    """The ``score_records`` function of ``benchmark`` (ConfigError-like one-liners for unknown or missing ones)."""
    known = benchmarks()
    if benchmark not in known:
        raise UsageError(f"unknown benchmark {benchmark!r}; valid benchmarks: {', '.join(known)}")
    module_name, _, function = known[benchmark].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UsageError(f"benchmark {benchmark!r} is not available yet ({module_name} does not exist)") from None
        raise
    scorer = getattr(module, function, None)
    if scorer is None:
        raise UsageError(f"benchmark {benchmark!r} is not available yet ({module_name} has no {function})")
    return scorer


def read_records(path: str, default_dataset: str | None = None,
                 aliases: dict[str, tuple[str, ...]] | None = None) -> list[dict[str, Any]]:
    """The records of a predictions file, with field aliases resolved (``aliases``: a benchmark's own, default
    ``ALIASES``), ``meta`` fields lifted and ``_line`` set; checks that each has a dataset, a string prediction and
    answers (or a label)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"predictions file {path!r} does not exist")
    lines = _text_lines(file, path)
    records = [_normalize(raw, number, path, default_dataset, aliases or ALIASES)
               for number, raw in json_lines(lines, path)]
    if not records:
        raise DataError(f"predictions file {path!r} has no records")
    return records


def _text_lines(file: Path, path: str) -> list[str]:
    """The file's lines, each decoded as UTF-8 on its own (``utf8_lines``); an unreadable file is a DataError."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise DataError(f"predictions file {path!r} cannot be read ({exc.strerror or exc})") from None
    return utf8_lines(data, path)


def _normalize(raw: dict[str, Any], number: int, path: str, default_dataset: str | None,
               aliases: dict[str, tuple[str, ...]] = ALIASES) -> dict[str, Any]:
    record = dict(raw)
    meta = raw.get("meta") if isinstance(raw.get("meta"), dict) else {}
    for name in FROM_META:
        if record.get(name) is None and meta.get(name) is not None:
            record[name] = meta[name]
    if record.get("dataset") is None and default_dataset is not None:
        record["dataset"] = default_dataset
    for name, keys in aliases.items():
        if record.get(name) is None:
            record[name] = next((raw[k] for k in keys if raw.get(k) is not None), None)
    where = f"{path} line {number}"
    if record.get("dataset") is None:
        raise DataError(f"{where} has no 'dataset' field (nor meta.dataset); pass --dataset for a single-dataset file")
    if not isinstance(record["dataset"], str):
        raise DataError(f"{where}: 'dataset' must be a string; got {record['dataset']!r:.60}")
    if not isinstance(record.get("prediction"), str):
        missing = record.get("prediction") is None
        raise DataError(f"{where} " + ("has no 'prediction' field" if missing else "has a non-string 'prediction'"))
    if record.get("answers") is None and record.get("label") is None:
        raise DataError(f"{where} has no 'answers' field")
    record["_line"] = number
    return record


def format_table(benchmark: str, scores: dict[str, Any]) -> str:
    """Per-dataset scores (with counts where given), then every other summary on its own line."""
    datasets, counts = scores.get("datasets", {}), scores.get("counts", {})
    rows = [("dataset", "n", "score")] + [(d, str(counts.get(d, "")), _fmt(v)) for d, v in datasets.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{benchmark}: {scores.get('n', sum(counts.values()))} predictions"]
    lines += [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(2, "-+-".join("-" * w for w in widths))
    for key, value in scores.items():
        if key not in ("datasets", "counts", "n", "official_mean"):
            lines.append(f"{key}: {_fmt(value) if not isinstance(value, dict) else json.dumps(value)}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) and not math.isnan(value) else str(value)


def _text(path: str) -> str:
    """``path`` as UTF-8 text: a file name whose bytes are not UTF-8 reaches Python with surrogate escapes, which no
    UTF-8 output can hold (writing ``--out`` would fail); they become U+FFFD, as the name is only shown."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        scorer = load_scorer(args.benchmark)
        options = {}
        if args.math_calc_drop_first:
            if args.benchmark != "infinitebench":
                raise UsageError("--math-calc-drop-first applies to --benchmark infinitebench only")
            options["math_calc_drop_first"] = True
        if args.rouge_aggregation:
            if args.benchmark != "zeroscrolls":
                raise UsageError("--rouge-aggregation applies to --benchmark zeroscrolls only")
            options["rouge_aggregation"] = args.rouge_aggregation
        if args.compensated:
            if args.benchmark != "longbench_v2":
                raise UsageError("--compensated applies to --benchmark longbench_v2 only")
            options["compensated"] = True
        _, single_task, aliases = _derived()
        default = args.dataset or (args.benchmark if args.benchmark in single_task else None)
        records = read_records(args.predictions, default, aliases.get(args.benchmark))
        try:
            scores = scorer(records, **options)
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # scorers that do not raise DataError
            raise DataError(f"{args.benchmark} could not score {args.predictions}: {type(exc).__name__}: {exc}") \
                from None
    except KVBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    result = {"benchmark": args.benchmark, "predictions": _text(args.predictions), **scores}
    text = json.dumps(result, indent=2, ensure_ascii=False) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    if args.out:
        try:
            Path(args.out).write_text(text, encoding="utf-8")
        except OSError as exc:
            print(f"error: cannot write --out {args.out!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    print(format_table(args.benchmark, scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
