"""``python -m kvbench.report readme``: the generated blocks of README.md, docs/*.md and the results READMEs.

They are written from the registries and the committed results.

A generated block sits between ``<!-- kvbench:NAME -->`` and ``<!-- /kvbench:NAME -->``; the command rewrites what
is between the markers and leaves every other line (the hand-written prose) alone. ``--check`` writes nothing and
exits 1 naming each file whose blocks differ from what the command would write (``tests/test_readme.py`` runs it).
The files are ``files(root)``: README.md, every Markdown page under ``docs/`` (a page moved there, or a new one, is
regenerated and checked without being listed anywhere) and the results READMEs in ``FILES``. Any block may sit in
any of them; the methods table is in ``docs/methods.md``, the task table in ``docs/benchmarks.md`` and the
miniature's claims in ``docs/reports.md``.

Blocks:

* ``methods``: one row per registered method (``kvbench.methods.METHODS``): its paper (the module docstring's
  reference), its idea (the docstring's first paragraph), where it acts (the ``Method`` hooks its class overrides),
  its defaults (``conf/method/<name>.yaml`` resolved by the class: what ``method=<name>`` runs) and the other
  readings it offers (hand-written in ``readme.yaml``, every ``field=value`` checked by the tests);
* ``captured-decode``: one row per registered method: whether its default configuration decodes as one captured
  step (``engine.decode=graph``) or host-driven with its ``static_refusal``, and the readings that decode otherwise;
* ``tasks``: one row per group of task configs (``conf/task/``) with the registered task each names and its folder,
  in the order of the task packages' declarations (``kvbench/tasks/<task>/task_spec.py``, which also hold the rows'
  hand-written protocol and metric);
* ``miniature-summary``, ``miniature-verdicts``, ``miniature-claims``: the CPU miniature's % of FullKV per method and
  budget, its verdict table and a one-line-per-claim summary, evaluated from ``results/cpu_miniature`` (its
  ``claims.yaml`` and committed runs) exactly as ``report/claims.md`` is;
* ``question-miniature``: the miniature's budget-128 needle_chat and passkey runs with ``question=with_context``
  (``results/cpu_miniature``) beside the same jobs with ``question=after_compression``
  (``results/cpu_miniature_query_agnostic``), by ``kvbench.report.question``;
* ``question-new-methods``: the same two columns for ``results/cpu_new_methods`` (both modes in one directory);
* ``miniature-provenance``, ``query-agnostic-provenance``: what the miniature's (and its query-agnostic column's)
  committed runs ran on (versions, commit, threads, from every run's meta) and the model's time they took
  (``kvbench.report.provenance``);
* ``window-kernel-verdicts``, ``window-kernel-provenance``: the SnapKV window / kernel ablation beside PyramidKV
  (``results/cpu_miniature_snapkv_window_kernel``): its claims' verdict table, evaluated from its ``claims.yaml`` and
  committed runs, and what its runs ran on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

#: the files holding generated blocks besides the docs pages, relative to the repository root
FILES = ("README.md", "results/cpu_miniature/README.md", "results/cpu_miniature_query_agnostic/README.md",
         "results/cpu_new_methods/README.md", "results/cpu_miniature_snapkv_window_kernel/README.md")
#: the folder whose every ``*.md`` page is rendered and checked too
DOCS = "docs"
MINIATURE = "results/cpu_miniature"
WINDOW_KERNEL = "results/cpu_miniature_snapkv_window_kernel"
QUERY_AGNOSTIC = "results/cpu_miniature_query_agnostic"
NEW_METHODS = "results/cpu_new_methods"
#: the miniature's query-agnostic column: its methods (OmniKV and POD refuse after_compression: their with_context
#: rows stand alone), tasks and budget (POD's window 16 + 112 is the miniature's budget-128 POD)
QA_METHODS = ["fullkv", "snapkv", "h2o", "streamingllm", "d2o", "dynamickv", "kvmerger", "omnikv", "pod"]
QA_TASKS = ["needle_chat", "passkey"]
DATA = Path(__file__).with_name("readme.yaml")
MARKER = re.compile(r"<!-- kvbench:([a-z0-9-]+) -->\n(.*?)<!-- /kvbench:\1 -->", re.S)

#: the method-contract hooks and what overriding each means for where a method acts
HOOKS = {
    "prefill_attend": "computes the prompt attention itself",
    "prefill": "end of each layer's prefill",
    "finish_prefill": "once after prefill, over all layers",
    "finish_reconstruction": "after prefill: extra forwards of the model score the entries, then it evicts",
    "select": "every decode step: selects what is attended",
    "attend": "every decode step: computes the attention itself",
    "decode": "after every decode step",
    "observe_logits": "after every forward, from the logits",
    "after_decode_forward": "after every decode forward, over all layers",
}


def data() -> dict[str, Any]:
    return yaml.safe_load(DATA.read_text(encoding="utf-8"))


def _cell(text: str) -> str:
    return " ".join(str(text).replace("``", "`").replace("|", "\\|").split())


def _docstring_parts(cls: type) -> tuple[str, str]:
    """(idea, paper) from the method module's docstring: first paragraph without its ``Name:``, and the second
    paragraph's ``Authors, "Title" (venue...)`` as ``Authors (venue)``."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    idea = paragraphs[0] if paragraphs else ""
    head, sep, rest = idea.partition(": ")
    if sep and len(head) <= 30:
        idea = rest[:1].upper() + rest[1:]
    paper = ""
    match = re.match(r'(.+?), "(.+?)" \((.+?)\)', paragraphs[1]) if len(paragraphs) > 1 else None
    if match:
        paper = f"{match[1]} ({match[3].split(';')[0].strip()})"
    return idea, paper


def acts(cls: type) -> str:
    """Where a method acts: the hooks its class overrides, plus what it requires."""
    from kvbench.methods.base import Method

    if getattr(cls, "acts_as", None):  # a composition (ThinK) acts where its inner method acts, then on its own
        return cls.acts_as
    parts = [text for hook, text in HOOKS.items() if getattr(cls, hook) is not getattr(Method, hook)]
    if getattr(cls, "requires_training", False):
        parts.append("needs trained weights")
    if getattr(cls, "requires_cuda", False):
        parts.append("CUDA only")
    return "; ".join(parts) or "nothing (keeps everything)"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a composed method's inner method (ThinK's ``inner``)
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def method_conf(name: str, root: Path) -> dict[str, Any]:
    """The fields ``conf/method/<name>.yaml`` sets (its ``name`` left out): what ``method=<name>`` passes the class."""
    conf = yaml.safe_load((root / "conf" / "method" / f"{name}.yaml").read_text(encoding="utf-8")) or {}
    return {k: v for k, v in conf.items() if k != "name"}


def defaults(name: str, root: Path) -> str:
    """``conf/method/<name>.yaml`` as the class resolves it (what ``method=<name>`` runs), ``field=value`` each."""
    from kvbench.methods import METHODS

    instance = METHODS.build(name, method_conf(name, root))
    fields = [f.name for f in dataclasses.fields(instance) if f.init and not f.name.startswith("_")]
    if "decode_compression" in fields and instance.decode_compression_spec() is None:
        fields.remove("decode_compression")  # off: prefill-only (docs/methods.md, "Compression during decode")
    return ", ".join(f"`{f}={_value(getattr(instance, f))}`" for f in fields) or "—"


def methods_block(root: Path) -> str:
    from kvbench.methods import METHODS

    entries = data()["methods"]
    lines = ["| method | paper | idea | acts | defaults | other readings |", "|---|---|---|---|---|---|"]
    for name in METHODS.entries:  # the registry's order: FullKV, the seed methods, then the baselines
        cls = METHODS.get_class(name)
        idea, paper = _docstring_parts(cls)
        entry = entries.get(name) or {}
        paper = entry.get("paper") or paper or "—"
        lines.append(f"| `{name}` | {_cell(paper)} | {_cell(idea)} | {_cell(acts(cls))} | {defaults(name, root)} | "
                     f"{_cell(entry.get('readings', '—'))} |")
    return "\n".join(lines) + "\n"


def reading_options(text: str) -> list[tuple[str, str]]:
    """The ``field=value`` pairs written in backticks in a hand-written readings text (``readme.yaml``), in order."""
    out = []
    for token in re.findall(r"`([^`]*)`", text):
        for part in re.split(r",\s*|\s+", token):
            match = re.match(r"^([a-z_]+)=(\S+)$", part)
            if match:
                out.append((match[1], match[2]))
    return out


def parse_value(raw: str) -> Any:
    """A reading's value as the config would give it (YAML), a word YAML reads as a boolean kept as written
    (``offload=on``)."""
    value = yaml.safe_load(raw)
    return raw if isinstance(value, bool) and raw.lower() not in ("true", "false") else value


def config_keys(root: Path) -> set[str]:
    """The top-level options of ``conf/config.yaml`` (``position_mode``, ...): named in readings, not method fields."""
    return set(yaml.safe_load((root / "conf" / "config.yaml").read_text(encoding="utf-8")) or {})


def captured_status(method: Any) -> str:
    """How ``method`` decodes under ``engine.decode=graph``: "captured" where it has a static step
    (``Method.has_static_step``), else "host-driven: <its static_refusal>" (what the refusal says)."""
    if method.has_static_step():
        return "captured"
    return f"host-driven: {method.static_refusal()}"


def captured_decode_block(root: Path) -> str:
    """One row per registered method: how its default configuration decodes under ``engine.decode=graph`` (the
    default on CUDA where the job can take it), and each hand-written reading (``readme.yaml``, the clause's options
    together) that decodes otherwise."""
    from kvbench.methods import METHODS

    entries, keys = data()["methods"], config_keys(root)
    lines = ["| method | default configuration | readings that decode otherwise |", "|---|---|---|"]
    for name in METHODS.entries:
        base = method_conf(name, root)
        default = captured_status(METHODS.build(name, base))
        others = []
        for clause in str((entries.get(name) or {}).get("readings", "")).split(";"):
            options = [(f, v) for f, v in reading_options(clause) if f not in keys]
            if not options:
                continue
            try:
                status = captured_status(METHODS.build(name, {**base, **{f: parse_value(v) for f, v in options}}))
            except Exception:  # noqa: BLE001 - a reading that needs an input it names (a calibrated map)
                continue
            if status != default:
                others.append(f"{', '.join(f'`{f}={v}`' for f, v in options)}: {status}")
        lines.append(f"| `{name}` | {_cell(default)} | {_cell('; '.join(others) or '—')} |")
    return "\n".join(lines) + "\n"


def task_configs(root: Path) -> dict[str, str]:
    """``{config name under conf/task: the registered task it names}`` (through the config's defaults list, as
    ``needle_chat`` extends ``needle``): ``root``'s ``conf/task/`` and, for a task package found through
    ``KVBENCH_TASK_PATH``, the package's own ``conf/task/``."""
    from kvbench.tasks import spec

    folders = [root / "conf" / "task"] + [conf / "task" for conf in spec.external_config_dirs()]

    def name_of(folder: Path, stem: str, seen: tuple[str, ...] = ()) -> str:
        conf = yaml.safe_load((folder / f"{stem}.yaml").read_text(encoding="utf-8")) or {}
        if "name" in conf:
            return str(conf["name"])
        for parent in conf.get("defaults") or []:
            if isinstance(parent, str) and parent != "_self_" and parent not in seen:
                return name_of(folder, parent, (*seen, stem))
        return stem

    return {path.stem: name_of(folder, path.stem) for folder in folders for path in sorted(folder.glob("*.yaml"))}


def task_folder(task: str) -> str:
    """The package folder of a registered task, from its declaration: ``kvbench/tasks/needle/`` in this repository,
    the absolute path of one found through ``KVBENCH_TASK_PATH``."""
    from kvbench.tasks import spec

    folder = spec.declaring(task).folder
    repository = spec.TASKS_DIR.parents[1]
    return (folder.relative_to(repository).as_posix() if folder.is_relative_to(repository) else folder.as_posix()) + "/"


def task_rows() -> list[dict[str, Any]]:
    """The task table's rows (``configs``, ``protocol``, ``metric``), from the task packages' declarations in their
    order (``kvbench/tasks/<task>/task_spec.py``)."""
    from kvbench.tasks import spec

    return [{"configs": list(row.configs), "protocol": row.protocol, "metric": row.metric}
            for _, row in spec.readme_rows()]


def tasks_block(root: Path) -> str:
    configs = task_configs(root)
    lines = ["| task | protocol | metric | code and README |", "|---|---|---|---|"]
    for row in task_rows():
        names = []
        for config in row["configs"]:
            task = configs[config]
            names.append(f"`{config}`" + (f" (task `{task}`)" if task != config else ""))
        folders = sorted({task_folder(configs[c]) for c in row["configs"]})
        lines.append(f"| {', '.join(names)} | {_cell(row['protocol'])} | {_cell(row['metric'])} | "
                     f"{', '.join(f'`{f}`' for f in folders)} |")
    return "\n".join(lines) + "\n"


def _claims(root: Path, folder: str = MINIATURE) -> tuple[Any, Any, list]:
    """A results folder's claims, evaluated on its committed runs (the miniature's unless ``folder`` says); once per
    ``(root, folder)``, however the folder is named (``_claims(root)`` and ``_claims(root, MINIATURE)`` are one)."""
    return _evaluated_claims(root, folder)


@functools.lru_cache(maxsize=8)
def _evaluated_claims(root: Path, folder: str) -> tuple[Any, Any, list]:
    from kvbench.report.claims import Evidence, evaluate_all, load_claims
    from kvbench.report.store import load_runs

    results = root / folder
    spec = load_claims(results / "claims.yaml")
    evidence = Evidence(load_runs(results), spec["model"], results)
    return spec, evidence, evaluate_all(spec, evidence)


def miniature_summary(root: Path) -> str:
    from kvbench.report.claims import configured_refs, summary_markdown

    spec, evidence, _ = _claims(root)
    return "\n".join(summary_markdown(evidence, list(spec.get("tasks") or []), configured_refs(spec)))


def miniature_verdicts(root: Path, folder: str = MINIATURE) -> str:
    from kvbench.report.claims import verdicts_markdown

    return "\n".join(verdicts_markdown(_claims(root, folder)[2])) + "\n"


def miniature_claims(root: Path) -> str:
    """One line per claim: its verdict per budget (``monotone``: how many methods got each verdict)."""
    lines = []
    for claim, verdicts in _claims(root)[2]:
        if claim["kind"] == "monotone":
            by: dict[str, list[str]] = {}
            for v in verdicts:
                by.setdefault(v.verdict, []).append(v.budget.split()[0])
            said = "; ".join(f"{k} for {len(m)} of {len(verdicts)}" + (f" ({', '.join(m)})" if len(m) <= 3 else "")
                             for k, m in sorted(by.items(), key=lambda kv: -len(kv[1])))
        else:
            said = ", ".join(f"{v.budget}: {v.verdict}" for v in verdicts)
        ran_as = sorted({v.ran_as for v in verdicts if v.ran_as})
        if ran_as:  # stored before the method's default changed: say which configuration the verdicts are about
            said += " (" + "; ".join(f"{x.partition('[')[0]}'s stored runs are {x}, not its current default"
                                     for x in ran_as) + ")"
        lines.append(f"* **{claim['paper']}**, {claim['claim']}: {said}.")
    return "\n".join(lines) + "\n"


def _question_block(runs: Any, **only: Any) -> str:
    from kvbench.report.question import markdown, question_summary, question_table

    return ("Mean % of FullKV over the tasks (each mode against its own FullKV run):\n\n"
            + markdown(question_summary(runs, **only)) + "\nPer task (score, % of the same mode's FullKV, resident KV "
            "after compression in MiB, samples with ctx / after compr.):\n\n" + markdown(question_table(runs, **only)))


def question_miniature(root: Path) -> str:
    import pandas as pd

    from kvbench.report.store import load_runs

    own = load_runs(root / QUERY_AGNOSTIC)
    mini = load_runs(root / MINIATURE)
    if not own.empty:  # a method rerun with_context here (D2O, under today's default) is read from here only
        rerun = set(own.loc[own["question"] == "with_context", "method"])
        mini = mini[~mini["method"].isin(rerun)]
    runs = pd.concat([own, mini], ignore_index=True)
    return _question_block(runs, tasks=QA_TASKS, budgets=["128", "window16+112"], methods=QA_METHODS)


def miniature_provenance(root: Path) -> str:
    from kvbench.report.provenance import provenance_markdown

    return provenance_markdown(root / MINIATURE)


def query_agnostic_provenance(root: Path) -> str:
    from kvbench.report.provenance import provenance_markdown

    return provenance_markdown(root / QUERY_AGNOSTIC)


def window_kernel_verdicts(root: Path) -> str:
    return miniature_verdicts(root, WINDOW_KERNEL)


def window_kernel_provenance(root: Path) -> str:
    from kvbench.report.provenance import provenance_markdown

    return provenance_markdown(root / WINDOW_KERNEL)


def question_new_methods(root: Path) -> str:
    from kvbench.report.store import load_runs

    return _question_block(load_runs(root / NEW_METHODS))


BLOCKS: dict[str, Callable[[Path], str]] = {
    "methods": methods_block,
    "captured-decode": captured_decode_block,
    "tasks": tasks_block,
    "miniature-summary": miniature_summary,
    "miniature-verdicts": miniature_verdicts,
    "miniature-claims": miniature_claims,
    "question-miniature": question_miniature,
    "question-new-methods": question_new_methods,
    "miniature-provenance": miniature_provenance,
    "query-agnostic-provenance": query_agnostic_provenance,
    "window-kernel-verdicts": window_kernel_verdicts,
    "window-kernel-provenance": window_kernel_provenance,
}


def render(text: str, root: Path) -> str:
    """``text`` with every generated block rewritten (an unknown block name is an error)."""
    def replace(match: re.Match) -> str:
        name = match[1]
        if name not in BLOCKS:
            raise ValueError(f"unknown generated block {name!r}; known: {', '.join(BLOCKS)}")
        body = BLOCKS[name](root)
        return f"<!-- kvbench:{name} -->\n{body.rstrip()}\n<!-- /kvbench:{name} -->"

    opened = re.findall(r"<!-- kvbench:([a-z0-9-]+) -->", text)
    closed = re.findall(r"<!-- /kvbench:([a-z0-9-]+) -->", text)
    if sorted(opened) != sorted(closed) or len(MARKER.findall(text)) != len(opened):
        raise ValueError(f"unbalanced generated-block markers: opened {opened}, closed {closed}")
    return MARKER.sub(replace, text)


def files(root: Path) -> list[str]:
    """Every file ``readme`` renders and ``--check`` guards, relative to ``root``: README.md, each ``docs/*.md`` page
    (sorted), then the results READMEs of ``FILES``."""
    docs = sorted(p.relative_to(root).as_posix() for p in (root / DOCS).glob("*.md"))
    return [FILES[0], *docs, *FILES[1:]]


def stale(root: Path) -> list[str]:
    """The files whose generated blocks differ from what ``render`` writes."""
    return [f for f in files(root)
            if (root / f).read_text(encoding="utf-8") != render((root / f).read_text("utf-8"), root)]


def main(argv: list[str] | None = None) -> int:
    from kvbench.config import project_root

    parser = argparse.ArgumentParser(prog="python -m kvbench.report readme", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a generated block is stale")
    parser.add_argument("--root", type=Path, default=None, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    root = (args.root or Path(project_root())).resolve()
    if args.check:
        bad = stale(root)
        for name in bad:
            print(f"{name}: generated blocks are stale; run `python -m kvbench.report readme`", file=sys.stderr)
        return 1 if bad else 0
    for name in files(root):
        path = root / name
        text = path.read_text(encoding="utf-8")
        new = render(text, root)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {name}")
        else:
            print(f"unchanged {name}")
    return 0


__all__ = ["BLOCKS", "DOCS", "FILES", "acts", "data", "defaults", "files", "main", "methods_block",
           "miniature_claims", "miniature_provenance", "miniature_summary", "miniature_verdicts",
           "query_agnostic_provenance", "question_miniature", "question_new_methods", "render", "stale",
           "task_configs", "task_folder", "task_rows", "tasks_block", "window_kernel_provenance",
           "window_kernel_verdicts"]
