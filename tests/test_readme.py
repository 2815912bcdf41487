"""The READMEs cannot go stale: their generated blocks are what `python -m kvbench.report readme` writes (from the
registries, the configs and the committed CPU miniature), every registered method and task has exactly one row,
every `field=value` the hand-written readings name is a value the method accepts, and no sentence says that a
registered method or task is missing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from kvbench.methods import METHODS
from kvbench.report import readme
from kvbench.report.cli import main as report_main
from kvbench.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
CONFIG_KEYS = set(yaml.safe_load((ROOT / "conf" / "config.yaml").read_text()) or {})


def _block(name: str, file: str = "README.md") -> str:
    text = (ROOT / file).read_text(encoding="utf-8")
    match = re.search(rf"<!-- kvbench:{name} -->\n(.*?)<!-- /kvbench:{name} -->", text, re.S)
    assert match, f"{file} has no generated block {name!r}"
    return match[1]


def test_generated_blocks_are_current():
    """Fails when a README's generated block differs from what the command writes: run
    `python -m kvbench.report readme` and commit."""
    assert readme.stale(ROOT) == []
    assert report_main(["readme", "--check", "--root", str(ROOT)]) == 0


def test_the_readmes_hold_every_block():
    for name in ("methods", "tasks", "miniature-claims"):
        _block(name)
    for name in ("miniature-summary", "miniature-verdicts", "miniature-provenance"):
        _block(name, "results/cpu_miniature/README.md")
    _block("query-agnostic-provenance", "results/cpu_miniature_query_agnostic/README.md")


def test_every_registered_method_has_exactly_one_row():
    rows = [line for line in _block("methods").splitlines() if line.startswith("| `")]
    names = [re.match(r"\| `([^`]+)` \|", line)[1] for line in rows]
    assert sorted(names) == sorted(METHODS.entries) and len(names) == len(set(names))
    entries = readme.data()["methods"]
    assert set(entries) == set(METHODS.entries), "readme.yaml: an entry per registered method, none other"


def _options(text: str) -> list[tuple[str, str]]:
    out = []
    for token in re.findall(r"`([^`]*)`", text):
        for part in re.split(r",\s*|\s+", token):
            match = re.match(r"^([a-z_]+)=(\S+)$", part)
            if match:
                out.append((match[1], match[2]))
    return out


def _parse(raw: str):
    value = yaml.safe_load(raw)
    return raw if isinstance(value, bool) and raw.lower() not in ("true", "false") else value  # `offload=on`


def _accepts(name: str, fields: dict) -> str | None:
    """None when the method builds with ``fields``, else the error."""
    try:
        METHODS.build(name, fields)
    except Exception as exc:  # ConfigError, NotAvailableError
        return str(exc)
    return None


@pytest.mark.parametrize("name", sorted(METHODS.entries))
def test_every_reading_named_is_a_value_the_method_accepts(name):
    """A renamed field or a removed choice fails here: each `field=value` of the hand-written readings must build the
    method, alone or with the other options of its clause (`variant=official_code` ... `bug_compat=true`), or be
    refused only for a missing input it names (`gate=calibrated needs a block_map`); top-level config options such
    as `position_mode` are named as such."""
    text = readme.data()["methods"][name].get("readings", "")
    cls = METHODS.get_class(name)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for clause in text.split(";"):
        together = {f: _parse(v) for f, v in _options(clause) if f not in CONFIG_KEYS}
        for field, value in _options(clause):
            if field in CONFIG_KEYS:
                continue
            assert field in fields, f"{name}: `{field}` is not a field (fields: {sorted(fields)})"
            error = _accepts(name, {field: _parse(value)})
            if error is not None and _accepts(name, together) is not None:
                assert f"{field}={value} needs" in error, f"{name}: `{field}={value}`: {error}"
    for token in re.findall(r"`([a-z_]+)`", text):  # a bare field name: still a field (or another method's name)
        assert token in fields or token in CONFIG_KEYS or token in METHODS.entries, f"{name}: `{token}`"


def test_the_reading_check_sees_a_bad_value():
    assert "is not valid" in _accepts("h2o", {"variant": "prefill_onyl"})
    assert "gate=calibrated needs" in _accepts("pod", {"gate": "calibrated"})  # valid, needs a calibrated map
    assert _parse("on") == "on" and _parse("true") is True and _parse("0") == 0
    assert _options("`variant=kvfactory` (x); `a=1`, `b=2`") == [("variant", "kvfactory"), ("a", "1"), ("b", "2")]


def test_every_task_config_and_registered_task_has_exactly_one_row():
    configs = readme.task_configs(ROOT)
    listed = [c for row in readme.task_rows() for c in row["configs"]]
    assert sorted(listed) == sorted(configs) and len(listed) == len(set(listed)), "one row per config under conf/task"
    assert set(TASKS.entries) <= set(configs.values()), "every registered task has a config"
    assert set(configs.values()) <= set(TASKS.entries), "every config names a registered task"
    rows = [line for line in _block("tasks").splitlines() if line.startswith("| `")]
    assert len(rows) == len(readme.task_rows())
    assert "tasks" not in readme.data(), "task rows are declared by the task packages (task_spec.py), not readme.yaml"
    for row in readme.task_rows():
        for config in row["configs"]:
            folder = readme.task_folder(configs[config])
            assert (ROOT / folder / "README.md").exists(), folder


def test_defaults_are_what_the_config_runs():
    """`defaults` is `conf/method/<name>.yaml` as the class resolves it (DynamicKV's null fields by its variant)."""
    text = readme.defaults("dynamickv", ROOT)
    assert "`window=8`" in text and "`schedule=paper`" in text and "`score_dtype=float32`" in text
    assert readme.defaults("fullkv", ROOT) == "—"
    assert "every decode step: selects what is attended" in readme.acts(METHODS.get_class("quest"))
    assert readme.acts(METHODS.get_class("fullkv")) == "nothing (keeps everything)"


STALE = re.compile(r"not available|until (?:they|it) lands?|pending|not (?:yet )?implemented|not landed|"
                   r"have not landed|stops? with a one-line message", re.I)


@pytest.mark.parametrize("file", readme.FILES)
def test_no_sentence_says_a_registered_method_or_task_is_missing(file):
    names = set(METHODS.entries) | set(TASKS.entries) | {
        "cam", "roco", "lm-infinite", "lminfinite", "sirllm", "infinitebench", "ruler", "leval", "zeroscrolls"}
    text = (ROOT / file).read_text(encoding="utf-8")
    bad = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if STALE.search(sentence):
            words = {w.lower() for w in re.findall(r"[A-Za-z][\w-]*", sentence)}
            named = sorted(words & names)
            if named:
                bad.append(f"{named}: {' '.join(sentence.split())[:200]}")
    assert not bad, bad


def test_render_replaces_only_between_markers_and_rejects_unknown_blocks(tmp_path):
    text = "keep\n<!-- kvbench:tasks -->\nold\n<!-- /kvbench:tasks -->\nkeep too\n"
    out = readme.render(text, ROOT)
    assert out.startswith("keep\n<!-- kvbench:tasks -->\n| task |")
    assert out.endswith("<!-- /kvbench:tasks -->\nkeep too\n")
    assert readme.render(out, ROOT) == out
    with pytest.raises(ValueError, match="unknown generated block 'nope'"):
        readme.render("<!-- kvbench:nope -->\n<!-- /kvbench:nope -->\n", ROOT)
    with pytest.raises(ValueError, match="unbalanced"):
        readme.render("<!-- kvbench:tasks -->\n", ROOT)


def test_the_run_sections_sample_output_is_the_default_jobs():
    """The README's sample output of `python -m kvbench.run` names the default job's directory (its config hash, which
    tests/test_protocols.py pins) and the default model, method, budget and task (issue #38: the hash went stale)."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import plan_job
    from kvbench.store import config_hash

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        job = plan_job(compose(config_name="config"))
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    sample = text.split("## Run", 1)[1].split("\n\n    python -m kvbench.run\n", 1)[1].split("\n\n", 2)[1]
    model, task, method, budget = job.parts
    assert f"results: results/runs/{model}/{task}/{method}/{budget}/{config_hash(job.key)[:12]}" in sample, sample
    assert sample.splitlines()[0].startswith(f"    {model}: ")
    row = [cell.strip() for cell in sample.splitlines()[3].split("|")]
    assert row[:3] == [method, budget, task], row
