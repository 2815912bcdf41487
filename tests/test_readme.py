"""The README and the docs pages cannot go stale: their generated blocks are what `python -m kvbench.report readme`
writes (from the registries, the configs and the committed CPU miniature), in README.md, every docs/*.md page and the
results READMEs; every registered method and task has exactly one row, every `field=value` the hand-written readings
name is a value the method accepts, and no sentence says that a registered method or task is missing. The README is
under 200 lines, its first screen holds the install, run and test commands (the ones CI runs), its sample output is
the default job's, and every relative link of README.md and docs/*.md resolves (file and #anchor)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvbench.methods import METHODS
from kvbench.report import readme
from kvbench.report.cli import main as report_main
from kvbench.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
CONFIG_KEYS = readme.config_keys(ROOT)


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
    _block("methods", "docs/methods.md")
    _block("tasks", "docs/benchmarks.md")
    _block("miniature-claims", "docs/reports.md")
    for name in ("miniature-summary", "miniature-verdicts", "miniature-provenance"):
        _block(name, "results/cpu_miniature/README.md")
    _block("query-agnostic-provenance", "results/cpu_miniature_query_agnostic/README.md")


def test_every_registered_method_has_exactly_one_row():
    rows = [line for line in _block("methods", "docs/methods.md").splitlines() if line.startswith("| `")]
    names = [re.match(r"\| `([^`]+)` \|", line)[1] for line in rows]
    assert sorted(names) == sorted(METHODS.entries) and len(names) == len(set(names))
    entries = readme.data()["methods"]
    assert set(entries) == set(METHODS.entries), "readme.yaml: an entry per registered method, none other"


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
        together = {f: readme.parse_value(v) for f, v in readme.reading_options(clause) if f not in CONFIG_KEYS}
        for field, value in readme.reading_options(clause):
            if field in CONFIG_KEYS:
                continue
            assert field in fields, f"{name}: `{field}` is not a field (fields: {sorted(fields)})"
            error = _accepts(name, {field: readme.parse_value(value)})
            if error is not None and _accepts(name, together) is not None:
                assert f"{field}={value} needs" in error, f"{name}: `{field}={value}`: {error}"
    for token in re.findall(r"`([a-z_]+)`", text):  # a bare field name: still a field (or another method's name)
        assert token in fields or token in CONFIG_KEYS or token in METHODS.entries, f"{name}: `{token}`"


def test_the_reading_check_sees_a_bad_value():
    assert "is not valid" in _accepts("h2o", {"variant": "prefill_onyl"})
    assert "gate=calibrated needs" in _accepts("pod", {"gate": "calibrated"})  # valid, needs a calibrated map
    assert readme.parse_value("on") == "on" and readme.parse_value("true") is True and readme.parse_value("0") == 0
    assert readme.reading_options("`variant=kvfactory` (x); `a=1`, `b=2`") == [
        ("variant", "kvfactory"), ("a", "1"), ("b", "2")]


def test_every_task_config_and_registered_task_has_exactly_one_row():
    configs = readme.task_configs(ROOT)
    listed = [c for row in readme.task_rows() for c in row["configs"]]
    assert sorted(listed) == sorted(configs) and len(listed) == len(set(listed)), "one row per config under conf/task"
    assert set(TASKS.entries) <= set(configs.values()), "every registered task has a config"
    assert set(configs.values()) <= set(TASKS.entries), "every config names a registered task"
    rows = [line for line in _block("tasks", "docs/benchmarks.md").splitlines() if line.startswith("| `")]
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


#: pages whose wording the check below would misread: method_ambiguities.md's legend uses "not implemented" for a
#: paper's feature kvbench lacks (H2O+'s chunked prefill) in the row of the method it belongs to; its own test
#: (tests/test_docs_ambiguities.py) checks every option it names
NOT_SENTENCES = {"docs/method_ambiguities.md"}


@pytest.mark.parametrize("file", [f for f in readme.files(ROOT) if f not in NOT_SENTENCES])
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


def _section(title: str, text: str | None = None) -> str:
    """The README's ``## title`` section, up to the next ``## `` heading."""
    text = text if text is not None else (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no section '## {title}'"
    return match[1]


def _commands(section: str) -> list[str]:
    """The indented code lines of a README section, stripped."""
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_the_run_sections_sample_output_is_the_main_commands_job():
    """The README's sample output is what its main command (the first command under ``## Run``) prints: the job's
    directory (its config hash, which tests/test_protocols.py pins) and its model, method, budget and task (issue #38:
    the hash went stale); the prose says the main command's values are the defaults, so the bare command is the same
    job."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import plan_job
    from kvbench.store import config_hash

    run = _section("Run")
    main = _commands(run)[0]
    assert main.startswith("python -m kvbench.run ") and "budget=" in main and "method=" in main, main
    overrides = main.split("#")[0].split()[3:]
    sample = run.split(main, 1)[1].split("\n\n", 3)[2]  # the command, its prose, then the output
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        job = plan_job(compose(config_name="config", overrides=overrides))
        default = plan_job(compose(config_name="config"))
    model, task, method, budget = job.parts
    assert f"results: results/runs/{model}/{task}/{method}/{budget}/{config_hash(job.key)[:12]}" in sample, sample
    assert sample.splitlines()[0].startswith(f"    {model}: ")
    row = [cell.strip() for cell in sample.splitlines()[3].split("|")]
    assert row[:3] == [method, budget, task], row
    assert "python -m kvbench.run` alone runs the same job" in run
    assert config_hash(default.key) == config_hash(job.key), "the README says the main command is the default job"


def test_the_readme_is_short_and_its_first_screen_has_the_commands():
    """Issue #39: under 200 lines; the first 40 say what kvbench is and hold the install, main and test commands and
    the links onward."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200, len(lines)
    first = "\n".join(lines[:40])
    for title in ("Install", "Run", "Test"):
        assert f"\n## {title}\n" in first, title
        command = _commands(_section(title))[0]
        assert f"\n    {command}\n" in first, command
    assert "A reproducible benchmark harness for KV-cache compression" in first
    assert "](docs/contributing.md)" in first and "](docs/methods.md)" in first


def _normalised(command: str) -> str:
    """A shell line as the README would write it: without ``time`` and pip's ``-q``."""
    words = command.split()
    words = words[1:] if words[:1] == ["time"] else words
    return " ".join(w for w in words if not (words[:2] == ["pip", "install"] and w == "-q"))


def test_ci_and_the_fresh_clone_check_run_the_readmes_commands():
    """.ci/run's steps labelled "(README)" and scripts/fresh_clone_check.sh run exactly the README's install and test
    commands (the README is what a new user runs, CI proves it)."""
    install = _commands(_section("Install"))[0]
    test = _commands(_section("Test"))[0]
    assert install == 'pip install -e ".[dev]"' and test == "python -m pytest -q -n 2 --dist worksteal"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = {}
    for i, line in enumerate(ci):
        if line.startswith("echo ") and "(README)" in line:
            steps[line.split(":")[-1].split("(")[0].strip()] = _normalised(ci[i + 1])
    assert steps == {"install": install, "tests": test}, steps
    fresh = [_normalised(line) for line in (ROOT / "scripts" / "fresh_clone_check.sh").read_text().splitlines()]
    assert install in fresh and any(line.startswith(test) for line in fresh), "fresh_clone_check.sh"


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s*(\S+)", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, without punctuation, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "").strip().lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for heading in HEADING.findall(text):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_links(root: Path, names: list[str]) -> list[str]:
    """``file: target (why)`` for every relative link of ``names`` whose file or ``#anchor`` does not exist (links in
    code spans and fenced code are not links; absolute URLs are not checked)."""
    bad = []
    for name in names:
        path = root / name
        text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text(encoding="utf-8")))
        text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
        for match in LINK.finditer(text):
            target = match[1] or match[2]
            if re.match(r"^[a-z][a-z0-9+.-]*:|^//", target, re.I):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path.resolve()
            if not dest.exists():
                bad.append(f"{name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{name}: {target} (no heading #{anchor} in {dest.relative_to(root.resolve())})")
    return bad


def _doc_pages(root: Path) -> list[str]:
    return ["README.md", *sorted(p.relative_to(root).as_posix() for p in (root / "docs").glob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = _doc_pages(ROOT)
    assert len(pages) > 10 and "docs/contributing.md" in pages
    assert broken_links(ROOT, pages) == []
    linked = {m[1].split("#")[0] for m in LINK.finditer((ROOT / "README.md").read_text()) if m[1]}
    assert {p for p in pages if p.startswith("docs/")} <= linked, "every docs page is linked from the README"


def test_the_link_check_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two `words`: here\n\n## Two words: here\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#a-page) [ok](docs/a.md#two-words-here-1) [ok](#top) <a id=\"top\"></a>\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nope) `[code](docs/c.md)` [web](https://example.org/x)\n"
        "```\n[fenced](docs/d.md)\n```\n[ref]: docs/e.md\n")
    assert broken_links(tmp_path, _doc_pages(tmp_path)) == [
        "README.md: docs/b.md (no such file)", "README.md: docs/a.md#nope (no heading #nope in docs/a.md)",
        "README.md: docs/e.md (no such file)"]


def test_a_stale_block_in_a_docs_page_fails_the_check_and_the_command_rewrites_it(tmp_path, capsys):
    """One command regenerates every page and one check guards them all: a docs page that no list names (any
    docs/*.md) with a stale block fails ``--check``, naming the page; ``readme`` rewrites it and the check passes."""
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    for name in readme.FILES:  # the README and the results READMEs, without blocks: current whatever the runs
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("# no generated block here\n")
    page = tmp_path / "docs" / "new_page.md"
    page.parent.mkdir()
    current = _block("tasks", "docs/benchmarks.md")
    stale = current.replace("| `passkey` |", "| `passkey_old` |")
    assert stale != current
    page.write_text(f"# A new page\n\n<!-- kvbench:tasks -->\n{stale}<!-- /kvbench:tasks -->\n\nprose\n")
    assert "docs/new_page.md" in readme.files(tmp_path)
    assert readme.stale(tmp_path) == ["docs/new_page.md"]
    assert report_main(["readme", "--check", "--root", str(tmp_path)]) == 1
    assert "docs/new_page.md: generated blocks are stale" in capsys.readouterr().err
    assert report_main(["readme", "--root", str(tmp_path)]) == 0
    assert "updated docs/new_page.md" in capsys.readouterr().out
    assert page.read_text() == f"# A new page\n\n<!-- kvbench:tasks -->\n{current}<!-- /kvbench:tasks -->\n\nprose\n"
    assert report_main(["readme", "--check", "--root", str(tmp_path)]) == 0
