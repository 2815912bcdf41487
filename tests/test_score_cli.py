"""``python -m kvbench.score``: hand-computed scores of small predictions files, a kvbench job's own records scored
again (same numbers as its scores.json), and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench import score as cli
from kvbench.config import CONF_DIR, register_resolvers

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
TREC = ["Abbreviation", "Animal", "City", "Country", "Individual", "Other", "Other location", "Other location type",
        "Date", "Description of a person"]


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in records),
                    encoding="utf-8")
    return path


def _main(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(value) -> str:
    return json.dumps(value, sort_keys=True)


def _scores(capsys, path: Path, benchmark: str, *extra) -> dict:
    code, out, err = _main(capsys, path, "--benchmark", benchmark, "--out", "-", *extra)
    assert code == 0, err
    return json.loads(out)


def test_benchmark_map_is_the_contract():
    assert list(cli.BENCHMARKS) == ["longbench", "longbench_e", "infinitebench", "ruler", "leval", "zeroscrolls",
                                    "longbench_v2", "needle", "needle_retrieval_head", "needle_kvpress", "passkey",
                                    "2stageretr", "math500", "aime24", "aime25"]
    for name in ("infinitebench", "ruler", "leval", "zeroscrolls", "longbench_v2"):
        assert cli.BENCHMARKS[name] == f"kvbench.tasks.{name}.scoring:score_records"


# ---- hand-computed scores -------------------------------------------------------------------------------------------
LONGBENCH_RECORDS = [
    {"dataset": "hotpotqa", "prediction": "Barcelona", "answers": ["Barcelona"]},            # 1
    {"dataset": "hotpotqa", "prediction": "Paris France", "answers": ["Paris"]},             # P 1/2, R 1: 2/3
    {"dataset": "trec", "prediction": "Individual\nWho wrote it", "answers": ["Individual"],  # first line: 1
     "all_classes": TREC},
    {"dataset": "trec", "prediction": "Other location type", "answers": ["Other location type"],  # the quirk: 1/2
     "all_classes": ["Other", "Other location", "Other location type"]},
    {"dataset": "passage_count", "prediction": "5 or 6", "answers": ["5"]},                  # 1 of 2 numbers
    {"dataset": "lcc", "prediction": "\n    return a + b\n", "answers": ["    return a + b"]},  # 1
]


def test_longbench(tmp_path, capsys):
    path = _write(tmp_path / "preds.jsonl", LONGBENCH_RECORDS)
    out = _scores(capsys, path, "longbench")
    assert out["benchmark"] == "longbench" and out["n"] == 6
    assert out["datasets"] == {"hotpotqa": 83.33, "trec": 75.0, "passage_count": 50.0, "lcc": 100.0}
    assert list(out["datasets"]) == ["hotpotqa", "trec", "passage_count", "lcc"]  # the official dataset order
    assert out["counts"]["trec"] == 2
    assert out["score"] == 77.08  # (83.33 + 75 + 50 + 100) / 4 = 77.0825
    assert out["categories"] == {"en": {"multi_doc_qa": 83.33, "few_shot": 75.0, "synthetic": 50.0, "code": 100.0}}
    assert out["leaderboard_avg"] == {"en": 77.08}


def test_longbench_table_and_out_file(tmp_path, capsys):
    path = _write(tmp_path / "preds.jsonl", LONGBENCH_RECORDS)
    code, table, err = _main(capsys, path, "--benchmark", "longbench", "--out", tmp_path / "scores.json")
    assert code == 0 and err == ""
    rows = [[cell.strip() for cell in line.split("|")] for line in table.splitlines() if "|" in line]
    assert rows[0] == ["dataset", "n", "score"]
    assert ["hotpotqa", "2", "83.33"] in rows and ["trec", "2", "75.00"] in rows
    assert "score: 77.08" in table.splitlines()
    assert json.loads((tmp_path / "scores.json").read_text())["datasets"]["trec"] == 75.0


def test_longbench_e_buckets_and_suffixed_names(tmp_path, capsys):
    records = [{"dataset": "hotpotqa_e", "prediction": p, "answers": ["Barcelona"], "length": n}
               for p, n in [("Barcelona", 1000), ("Madrid", 5000), ("Barcelona", 9000), ("Barcelona", 3999)]]
    out = _scores(capsys, _write(tmp_path / "e.jsonl", records), "longbench_e")
    assert out["datasets"] == {"hotpotqa": 75.0}
    assert out["buckets"] == {"hotpotqa": {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}}
    assert out["bucket_avg"] == {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}


def test_infinitebench(tmp_path, capsys):
    records = [
        {"dataset": "passkey", "prediction": "71432.", "answers": ["71432"]},                       # 1
        {"dataset": "passkey", "prediction": "The key is 5297", "answers": ["05297"]},              # 0 (strings)
        {"dataset": "code_run", "prediction": "The value is 14.", "answers": ["14"]},               # 1 (int restored)
        {"dataset": "code_run", "prediction": "14 it is", "answers": [14]},                         # 0 (last word)
        {"dataset": "longbook_choice_eng", "prediction": "A. no, the answer is D",                  # 0 (first letter)
         "answers": ["Sunday"], "options": ["Monday", "Friday", "Saturday", "Sunday"]},
        {"dataset": "longbook_choice_eng", "prediction": "D", "answers": ["Sunday", "D"]},          # 1
        {"dataset": "math_calc", "prediction": "[35, 47, 40]", "answers": [[35, 47, 39]]},          # 2/3
        {"dataset": "longbook_qa_chn", "prediction": "北京是中国的首都", "answers": ["北京"]},          # 0.4
    ]
    out = _scores(capsys, _write(tmp_path / "ib.jsonl", records), "infinitebench")
    assert out["datasets"] == {"passkey": 50.0, "longbook_choice_eng": 50.0, "longbook_qa_chn": 40.0,
                               "math_calc": 66.67, "code_run": 50.0}
    assert out["official_mean"]["math_calc"] == pytest.approx(2 / 3)
    assert out["score"] == round((50 + 50 + 40 + 66.67 + 50) / 5, 2) == 51.33


def test_infinitebench_official_results_file(tmp_path, capsys):
    """The upstream results files have no dataset, 'prediction' or 'pred', and 'ground_truth' or 'label'."""
    rows = [{"id": 0, "prediction": "[1, 35, 47, 39]", "ground_truth": [[35, 47, 39]]},
            {"id": 1, "pred": " [1, 4, 8]\n", "label": [[1, 4, 9]]}]
    path = _write(tmp_path / "preds_math_calc.jsonl", rows)
    assert _scores(capsys, path, "infinitebench", "--dataset", "math_calc")["datasets"] == {"math_calc": 33.33}
    # compute_scores.py --model_name gpt4 drops the first number: 3/3 and 0/3 ([4, 8] vs [1, 4, 9])
    out = _scores(capsys, path, "infinitebench", "--dataset", "math_calc", "--math-calc-drop-first")
    assert out["datasets"] == {"math_calc": 50.0}


# ---- a kvbench job's records give its own scores ---------------------------------------------------------------------
def _run_job(tmp_path, monkeypatch, overrides):
    """A job on the tiny random model (its predictions are noise, generated up to each dataset's max length: the
    datasets are chosen for short generations)."""
    from kvbench.jobs import run_job

    monkeypatch.setenv("KVBENCH_RESULTS_DIR", str(tmp_path / "results"))
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=tiny-random", "method=snapkv", "budget=64",
                                                       "print_table=false", *overrides])
    scores = run_job(cfg)
    (samples,) = (tmp_path / "results" / "runs").glob("*/*/*/*/*/samples.jsonl")
    return scores, samples


@pytest.mark.parametrize(
    ("overrides", "benchmark", "keys"),
    [
        (["task=longbench", f"task.data_dir={FIXTURES / 'longbench'}",
          "task.datasets=[passage_retrieval_en,lcc,multifieldqa_zh]"],
         "longbench", ("datasets", "counts", "score", "categories", "leaderboard_avg")),
        (["task=longbench_e", f"task.data_dir={FIXTURES / 'longbench'}", "task.datasets=[hotpotqa,trec]", "limit=3"],
         "longbench_e", ("datasets", "score", "buckets", "bucket_avg")),
        (["task=infinitebench", f"task.data_dir={FIXTURES / 'infinitebench'}",
          "task.datasets=[passkey,longbook_choice_eng,math_find,code_run,code_debug]"],
         "infinitebench", ("datasets", "official_mean", "counts", "score")),
    ],
    ids=["longbench", "longbench_e", "infinitebench"],
)
def test_job_records_rescore_to_the_job_scores(tmp_path, monkeypatch, capsys, overrides, benchmark, keys):
    job_scores, samples = _run_job(tmp_path, monkeypatch, overrides)
    capsys.readouterr()
    direct = _scores(capsys, samples, benchmark)  # samples.jsonl as it is (meta.dataset, meta.label, ...)
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    derived = [{"dataset": r["meta"]["dataset"], "prediction": r["prediction"], "answers": r["answers"],
                "all_classes": r["meta"].get("all_classes"), "length": r["meta"].get("length"),
                "options": r["meta"].get("options")} for r in records]
    plain = _scores(capsys, _write(tmp_path / "derived.jsonl", derived), benchmark)
    for key in keys:  # compared as JSON: an empty LongBench-E bucket is nan in all three
        assert _json(direct[key]) == _json(job_scores[key]) == _json(plain[key]), key
    assert job_scores["n_samples"] == direct["n"] == len(records)


@pytest.mark.parametrize("name", ["leval", "zeroscrolls"])
def test_other_benchmarks_rescore_their_task_records(tmp_path, capsys, name):
    """LEval and ZeroSCROLLS records as a job writes them (meta.dataset, LEval's meta.part and meta.question_index)
    give the task's own aggregate through the CLI."""
    from kvbench.tasks import build_task

    module = __import__(f"test_task_{name}")  # their fixture datasets
    task = build_task({"name": name, "data_dir": str(FIXTURES / name), "datasets": module.FIXTURE_DATASETS})
    samples = task.samples(None)
    predictions = [s.answers[0] if i % 2 == 0 else "no idea" for i, s in enumerate(samples)]
    records = [{"id": s.id, "prediction": p, "answers": s.answers, "score": task.score(p, s), "meta": s.meta}
               for p, s in zip(predictions, samples, strict=True)]
    expected = task.aggregate(records)
    out = _scores(capsys, _write(tmp_path / "samples.jsonl", records), name)
    assert _json(out["datasets"]) == _json(expected["datasets"]) and out["score"] == expected["score"]
    if name == "zeroscrolls":
        corpus = _scores(capsys, tmp_path / "samples.jsonl", name, "--rouge-aggregation", "corpus")
        task.rouge_aggregation = "corpus"
        assert _json(corpus["datasets"]) == _json(task.aggregate(records)["datasets"])


# ---- bad input: one line, exit code 2 -------------------------------------------------------------------------------
GOOD = {"dataset": "hotpotqa", "prediction": "x", "answers": ["x"]}


@pytest.mark.parametrize(
    ("lines", "argv", "message"),
    [
        (None, ["--benchmark", "longbench"], "does not exist"),
        ([GOOD, '{"dataset": "hotpotqa", "prediction": '], ["--benchmark", "longbench"], "line 2 is not JSON"),
        ([GOOD, "[1, 2]"], ["--benchmark", "longbench"], "line 2 is not a JSON object"),
        ([], ["--benchmark", "longbench"], "has no records"),
        ([GOOD, {"dataset": "hotpotqa", "answers": ["x"]}], ["--benchmark", "longbench"], "line 2 has no 'prediction'"),
        ([{"dataset": "hotpotqa", "prediction": 3, "answers": ["x"]}], ["--benchmark", "longbench"], "non-string"),
        ([{"dataset": "hotpotqa", "prediction": "x"}], ["--benchmark", "longbench"], "line 1 has no 'answers'"),
        ([{"prediction": "x", "answers": ["x"]}], ["--benchmark", "longbench"], "--dataset"),
        ([GOOD, {**GOOD, "dataset": "hotpotqq"}], ["--benchmark", "longbench"],
         "line 2: unknown LongBench dataset 'hotpotqq'; valid: narrativeqa, qasper"),
        ([{**GOOD, "dataset": "narrativeqa"}], ["--benchmark", "longbench_e"], "valid: qasper, multifieldqa_en"),
        ([{**GOOD, "dataset": "trec"}], ["--benchmark", "longbench"], "line 1: no 'all_classes' field"),
        ([{**GOOD, "answers": "x"}], ["--benchmark", "longbench"], "'answers' must be list"),
        ([GOOD], ["--benchmark", "longbench_e"], "line 1: no 'length' field"),
        ([{**GOOD, "dataset": "passage_retrieval_en"}], ["--benchmark", "longbench"], "cannot score"),
        ([{"dataset": "code_run", "prediction": "1", "answers": ["one"]}], ["--benchmark", "infinitebench"],
         "line 1: code_run: cannot use answer"),
        ([{"dataset": "code_debug", "prediction": "B", "answers": ["f"]}], ["--benchmark", "infinitebench"],
         "line 1: code_debug"),
        ([{**GOOD, "dataset": "passkeys"}], ["--benchmark", "infinitebench"], "valid: passkey, number_string"),
        ([GOOD], ["--benchmark", "longbenchh"], "unknown benchmark 'longbenchh'; valid benchmarks: longbench,"),
        ([GOOD], [], "--benchmark"),
        ([GOOD], ["--benchmark", "longbench", "--math-calc-drop-first"], "infinitebench only"),
        ([GOOD], ["--benchmark", "longbench", "--rouge-aggregation", "corpus"], "zeroscrolls only"),
        ([GOOD], ["--benchmark", "zeroscrolls"], "valid ZeroSCROLLS datasets"),
    ],
)
def test_bad_input(tmp_path, capsys, lines, argv, message):
    path = tmp_path / "preds.jsonl"
    if lines is not None:
        _write(path, lines)
    code, out, err = _main(capsys, path, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


LINE = json.dumps(GOOD).encode()
NOT_UTF8 = b'{"dataset": "hotpotqa", "prediction": "'  # then b"\xff\xfe", which no UTF-8 text holds


@pytest.mark.parametrize(("before", "newline", "line"), [([], b"\n", 1), ([LINE, LINE], b"\n", 3),
                                                        ([LINE], b"\r\n", 2), ([LINE], b"\r", 2)])
def test_bytes_that_are_not_utf8_are_one_line_naming_where(tmp_path, capsys, before, newline, line):
    path = tmp_path / "preds.jsonl"
    head = b"".join(b + newline for b in before)
    path.write_bytes(head + NOT_UTF8 + b'\xff\xfe", "answers": ["x"]}' + newline + LINE + newline)
    code, out, err = _main(capsys, path, "--benchmark", "longbench")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {path} line {line} is not UTF-8 (byte offset {len(head) + len(NOT_UTF8)} in the "
                          "file: invalid start byte"), err


def test_a_file_that_cannot_be_read_is_one_line(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path / "preds.jsonl", [GOOD])

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    code, _, err = _main(capsys, path, "--benchmark", "longbench")
    assert code == 2 and err == f"error: predictions file {str(path)!r} cannot be read (Permission denied)\n"


def test_a_file_name_that_is_not_utf8_is_written_as_text(tmp_path, capsys):
    """Such a name reaches Python with surrogate escapes; the JSON written with --out must still be UTF-8."""
    path = os.fsdecode(os.fsencode(tmp_path) + b"/preds\xff.jsonl")
    _write(Path(path), [GOOD])
    code, _, err = _main(capsys, path, "--benchmark", "longbench", "--out", tmp_path / "scores.json")
    assert code == 0, err
    written = json.loads((tmp_path / "scores.json").read_text(encoding="utf-8"))
    assert written["predictions"].endswith("preds\ufffd.jsonl")


def test_benchmark_not_landed_yet(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(cli.BENCHMARKS, "ruler", "kvbench.tasks.not_written_yet.scoring:score_records")
    code, _, err = _main(capsys, _write(tmp_path / "p.jsonl", [GOOD]), "--benchmark", "ruler")
    assert code == 2 and err == ("error: benchmark 'ruler' is not available yet "
                                 "(kvbench.tasks.not_written_yet.scoring does not exist)\n")
    monkeypatch.setitem(cli.BENCHMARKS, "ruler", "kvbench.tasks.longbench.scoring:no_such_function")
    code, _, err = _main(capsys, _write(tmp_path / "p.jsonl", [GOOD]), "--benchmark", "ruler")
    assert code == 2 and "not available yet" in err


@pytest.mark.parametrize(("content", "message"), [(LINE + b"\n{not json\n", "line 2 is not JSON"),
                                                 (b"\xff\xfe" + LINE + b"\n", "line 1 is not UTF-8 (byte offset 0 ")])
def test_command_line_exit_code_and_no_traceback(tmp_path, content, message):
    path = tmp_path / "preds.jsonl"
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "kvbench.score", str(path), "--benchmark", "longbench"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


# ---- kvbench's generated tasks: the task's own metric and aggregate ------------------------------------------------
MINIATURE = ROOT / "results" / "cpu_miniature" / "runs" / "smollm2-135m"


@pytest.mark.parametrize(("folder", "benchmark", "keys"), [("needle", "needle", ("score", "grid")),
                                                          ("passkey", "passkey", ("score", "grid")),
                                                          ("2stageretr", "2stageretr", ("score", "by_dict_len"))])
def test_committed_smollm2_records_rescore_to_their_scores(capsys, folder, benchmark, keys):
    """Every committed SmolLM2 job of the CPU miniature (real, varied predictions) scores again to its scores.json."""
    jobs = sorted(p.parent for p in (MINIATURE / folder).glob("*/*/*/scores.json"))
    assert jobs, f"no committed {folder} runs under {MINIATURE}"
    for job in jobs:
        expected = json.loads((job / "scores.json").read_text())
        got = _scores(capsys, job / "samples.jsonl", benchmark)
        for key in keys:
            assert _json(got[key]) == _json(expected[key]), (job, key)
        assert got["datasets"] == {benchmark: expected["score"]} and got["n"] == expected["n_samples"]


@pytest.mark.parametrize("name", ["needle_retrieval_head", "needle_kvpress"])
def test_needle_protocol_jobs_rescore_to_their_scores(tmp_path, monkeypatch, capsys, name):
    job_scores, samples = _run_job(tmp_path, monkeypatch, [f"task={name}", "task.context_lengths=[300]",
                                                           "task.n_depths=2", "task.max_new_tokens=8"])
    capsys.readouterr()
    got = _scores(capsys, samples, name)
    assert _json(got["grid"]) == _json(job_scores["grid"]) and got["score"] == job_scores["score"]


def test_generated_tasks_by_hand(tmp_path, capsys):
    passkey = [{"prediction": "The pass key is 71432.", "answers": ["71432"], "context_length": 1000, "depth": 50},
               {"prediction": "71433", "answers": ["71432"], "context_length": 1000, "depth": 0},
               {"prediction": "It is 09006", "answers": ["09006"], "meta": {"context_length": 2000, "depth": 0}}]
    out = _scores(capsys, _write(tmp_path / "p.jsonl", passkey), "passkey")
    assert out["score"] == 66.67 and out["grid"] == {"1000": {"0": 0.0, "50": 100.0}, "2000": {"0": 100.0}}
    # ROUGE-1 F x10: reference 4 unigrams, prediction 3 of them + 1 other -> P = R = 3/4 -> F = 0.75 -> 7.5
    needle = [{"prediction": "eat a sandwich there", "answers": ["eat a sandwich today"], "context_length": 500,
               "depth": 0}]
    assert _scores(capsys, _write(tmp_path / "n.jsonl", needle), "needle")["score"] == 7.5
    retr = [{"prediction": "Blue.", "answers": ["blue"], "dict_len": 40},
            {"prediction": "red", "answers": ["green"], "dict_len": 60}]
    out = _scores(capsys, _write(tmp_path / "r.jsonl", retr), "2stageretr")
    assert out["score"] == 50.0 and out["by_dict_len"] == {"40": 100.0, "60": 0.0}


def test_generated_tasks_need_their_cell_fields(tmp_path, capsys):
    path = _write(tmp_path / "p.jsonl", [{"prediction": "71432", "answers": ["71432"], "context_length": 1000}])
    code, _, err = _main(capsys, path, "--benchmark", "passkey")
    assert code == 2 and err.count("\n") == 1 and "'depth'" in err and "context_length x depth" in err
