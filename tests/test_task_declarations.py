"""Tasks are declared once, in their own folder (``task_spec.py``, kvbench.tasks.spec): the registry, the re-scoring
CLI's benchmarks, the rescoring cell fields and the README's task rows are derived from the declarations, and a task
kept outside the repository (its folder and one config, found through ``KVBENCH_TASK_PATH``) is seen by all of them
without editing a kvbench file."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import score as cli
from kvbench.errors import ConfigError
from kvbench.report import readme
from kvbench.tasks import TASKS, build_task, rescoring, spec

ROOT = Path(__file__).resolve().parents[1]

TOY_SPEC = '''
"""The toy task's declaration."""

from kvbench.tasks.spec import ReadmeRow, Rescorer, TaskEntry, TaskSpec

SPEC = TaskSpec(
    tasks=(TaskEntry("toyecho", ".task:ToyEchoTask",
                     Rescorer(".task:rescore", single_task=True, cell_fields=("n_words",))),),
    readme=(ReadmeRow(configs=("toyecho",), protocol="echo the last word of a generated list",
                      metric="exact match × 100"),),
)
'''
TOY_TASK = '''
"""A toy task: the prompt lists words, the answer is the last one."""

from dataclasses import dataclass
from typing import Any

from kvbench.tasks import check_common, check_int, mean_score, protocol_fields
from kvbench.tasks.base import Sample, Task


@dataclass
class ToyEchoTask(Task):
    name: str = "toyecho"
    metric: str = "exact_match"
    n_words: int = 3
    max_new_tokens: int = 4

    def samples(self, tokenizer: Any) -> list[Sample]:
        words = [f"w{i}" for i in range(self.n_words)]
        return [Sample(id="0", prompt=" ".join(words), answers=[words[-1]], meta={"n_words": self.n_words})]

    def score(self, prediction: str, sample: Sample) -> float:
        return 100.0 * (prediction.strip() == sample.answers[0])

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {"score": mean_score(records)}

    def protocol(self) -> dict[str, Any]:
        return protocol_fields(self)

    def validate(self) -> None:
        check_common(self)
        check_int(self.name, "n_words", self.n_words)


def rescore(records: list[dict[str, Any]]) -> dict[str, Any]:
    from kvbench.tasks.rescoring import score_with_task

    return score_with_task("toyecho", records)
'''
TOY_CONFIG = "name: toyecho\nn_words: 3\nmax_new_tokens: 4\n"


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A folder of task packages holding ``toyecho`` (``__init__.py``, ``task_spec.py``, ``task.py`` and its config
    ``conf/task/toyecho.yaml``), named by KVBENCH_TASK_PATH; sys.path and the imported toy modules are restored."""
    package = tmp_path / "tasks" / "toyecho"
    (package / "conf" / "task").mkdir(parents=True)
    (package / "__init__.py").write_text('"""toy"""\n')
    (package / "task_spec.py").write_text(textwrap.dedent(TOY_SPEC))
    (package / "task.py").write_text(textwrap.dedent(TOY_TASK))
    (package / "conf" / "task" / "toyecho.yaml").write_text(TOY_CONFIG)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(spec.PATH_VARIABLE, str(tmp_path / "tasks"))
    yield package
    for name in [m for m in sys.modules if m == "toyecho" or m.startswith("toyecho.")]:
        del sys.modules[name]


def test_the_lists_are_the_declarations():
    declared = [entry for s in spec.declarations() for entry in s.tasks]
    assert list(TASKS.entries) == [e.name for e in declared] and len(declared) == len({e.name for e in declared})
    assert all(s.package == f"kvbench.tasks.{s.folder.name}" for s in spec.declarations())
    assert cli.BENCHMARKS == {e.name: e.rescorer.target for e in sorted(
        (e for e in declared if e.rescorer), key=lambda e: e.rescorer.rank)}
    assert set(cli.SINGLE_TASK) == {"needle", "needle_retrieval_head", "needle_kvpress", "passkey", "2stageretr",
                                    "longbench_v2", "math500", "aime24", "aime25"}
    math = {"prediction": ("prediction", "output", "predicted_answer"), "answers": ("answers", "answer", "gt")}
    assert cli.BENCHMARK_ALIASES == {"longbench_v2": {"prediction": ("prediction", "response"),
                                                      "answers": ("answers", "answer")},
                                     "math500": math, "aime24": math, "aime25": math}
    assert rescoring.CELL_FIELDS == {"needle": ("context_length", "depth"),
                                     "needle_retrieval_head": ("context_length", "depth"),
                                     "needle_kvpress": ("context_length", "depth"),
                                     "passkey": ("context_length", "depth"), "2stageretr": ("dict_len",)}
    assert [c for row in readme.task_rows() for c in row["configs"]][:2] == ["needle", "needle_chat"]


def test_discovery_reads_only_the_declarations():
    """Listing the tasks executes each package's task_spec.py alone: no task module (PG-19's imports torch)."""
    import subprocess

    code = ("import sys; from kvbench.tasks import TASKS; assert 'pg19' in TASKS.entries; "
            "print(sorted(m for m in sys.modules if m.startswith('kvbench.tasks.') and m.count('.') > 2 "
            "or m in ('torch', 'datasets', 'transformers', 'kvbench.tasks.pg19')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stdout


def test_a_toy_task_from_its_own_folder_is_registered(toy):
    assert "toyecho" in TASKS.names() and TASKS.entries["toyecho"] == "toyecho.task:ToyEchoTask"
    task = build_task(OmegaConf.load(toy / "conf" / "task" / "toyecho.yaml"))
    assert type(task).__name__ == "ToyEchoTask" and task.n_words == 3 and task.max_new_tokens == 4
    assert [s.answers for s in task.samples(None)] == [["w2"]]
    with pytest.raises(ConfigError, match="n_words must be an integer >= 1; got 0"):
        build_task({"name": "toyecho", "n_words": 0})
    with pytest.raises(ConfigError, match="valid fields: .*n_words"):
        build_task({"name": "toyecho", "words": 3})


def test_a_toy_task_is_rescored_by_the_cli(toy, tmp_path, capsys):
    assert list(cli.BENCHMARKS)[-1] == "toyecho"  # an unranked declaration comes after the ranked ones
    assert rescoring.CELL_FIELDS["toyecho"] == ("n_words",) and "toyecho" in cli.SINGLE_TASK
    assert "toyecho" in cli.build_parser().format_help()
    predictions = tmp_path / "preds.jsonl"
    predictions.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prediction": " w2", "answers": ["w2"], "n_words": 3},
        {"prediction": "w1", "answers": ["w4"], "meta": {"n_words": 5}}]))
    assert cli.main([str(predictions), "--benchmark", "toyecho", "--out", "-"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["datasets"] == {"toyecho": 50.0} and scores["counts"] == {"toyecho": 2}
    predictions.write_text(json.dumps({"prediction": "w2", "answers": ["w2"]}) + "\n")
    assert cli.main([str(predictions), "--benchmark", "toyecho"]) == 2
    assert "line 1 has no 'n_words' (top-level or in meta); toyecho scores are per n_words" in capsys.readouterr().err
    assert cli.main([str(predictions), "--benchmark", "toyech"]) == 2
    assert "valid benchmarks: longbench, longbench_e, " in (err := capsys.readouterr().err) and "toyecho" in err


def test_a_toy_task_has_its_readme_row(toy):
    assert readme.task_configs(ROOT)["toyecho"] == "toyecho"
    assert readme.task_folder("toyecho") == toy.as_posix() + "/"
    block = readme.tasks_block(ROOT)
    assert block.splitlines()[-1] == (f"| `toyecho` | echo the last word of a generated list | exact match × 100 | "
                                      f"`{toy.as_posix()}/` |")
    assert "needle_chat" in block  # the repository's rows are still there


def test_the_search_path_is_read_again(toy, monkeypatch):
    assert "toyecho" in TASKS.entries and "toyecho" in cli.BENCHMARKS
    monkeypatch.delenv(spec.PATH_VARIABLE)
    assert "toyecho" not in TASKS.entries and "toyecho" not in cli.BENCHMARKS
    assert "toyecho" not in rescoring.CELL_FIELDS and "toyecho" not in readme.task_configs(ROOT)


def test_a_bad_declaration_or_folder_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(spec.PATH_VARIABLE, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="KVBENCH_TASK_PATH names .*missing.*, which is not a folder"):
        spec.declarations()
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / "task_spec.py").write_text(
        "from kvbench.tasks.spec import TaskEntry, TaskSpec\nSPEC = TaskSpec(tasks=(TaskEntry('passkey', '.t:T'),))\n")
    monkeypatch.setenv(spec.PATH_VARIABLE, str(tmp_path))
    with pytest.raises(ConfigError, match="task 'passkey' is declared twice: by kvbench.tasks.passkey and dup"):
        spec.declarations()
    (tmp_path / "dup" / "task_spec.py").write_text("SPEC = None\n")
    with pytest.raises(ConfigError, match=r"task_spec.py must define SPEC = TaskSpec\(...\); got None"):
        spec.declarations()


def test_a_toy_task_composes_through_hydra_searchpath(toy, monkeypatch):
    """``task=toyecho`` passes kvbench's override check and composes once Hydra is given the package's conf/."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.overrides import precheck_overrides

    searchpath = f"hydra.searchpath=[file://{(toy / 'conf').as_posix()}]"
    precheck_overrides(["task=toyecho", searchpath])
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["task=toyecho", searchpath])
    assert type(build_task(cfg.task)).__name__ == "ToyEchoTask"
    monkeypatch.delenv(spec.PATH_VARIABLE)
    with pytest.raises(ConfigError, match="unknown task 'toyecho'; valid tasks: 2stageretr, "):
        precheck_overrides(["task=toyecho"])


#: the tasks whose config selects datasets (or RULER's tasks) by name, with the field and one valid name
SELECTING = [("longbench", "datasets", "qasper"), ("leval", "datasets", "coursera"),
             ("zeroscrolls", "datasets", "qasper"), ("infinitebench", "datasets", "passkey"),
             ("ruler", "tasks", "niah_single_1")]


@pytest.mark.parametrize(("task", "field", "good"), SELECTING)
@pytest.mark.parametrize(("value", "expected"), [
    (["nope"], "{field} ['nope'] are not "),
    ([], "{field} must be a non-empty list of names; got []"),
    (["{good}", "{good}"], "{field} has duplicates: ['{good}', '{good}']"),
])
def test_a_bad_selection_of_datasets_is_one_line_naming_it(task, field, good, value, expected):
    """Every task that selects by name checks the list with ``tasks.check_names``: one line naming the value (and,
    for an unknown name, every valid one)."""
    value = [v.format(good=good) for v in value]
    with pytest.raises(ConfigError) as caught:
        build_task({"name": task, field: value})
    message = str(caught.value)
    assert "\n" not in message and f"task '{task}': " + expected.format(field=field, good=good) in message
    if value == ["nope"]:
        assert f"(valid: {good}" in message or f", {good}," in message or f", {good})" in message
    assert build_task({"name": task, field: [good]}) is not None
