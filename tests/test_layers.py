"""Data flows one way: the import graph of kvbench/ (read with ast, nothing executed) has no cycle and no arrow that
runs against the layer order of ``kvbench/layers.py`` (every top-level module placed, top to bottom: command lines,
drivers, one job, methods, engine, tasks, report, store, models and scorers, services, foundations, base), except the
ones its ``EXCEPTIONS`` list with their reasons; a few finer rules inside the layers follow (``FORBIDDEN``).

Every import counts, also those inside functions and under ``TYPE_CHECKING``: a type the method contract names from
the engine's session is still a dependency of the contract on the session. ``from package import module`` is an edge
to the module (how Python resolves it), not to the package's ``__init__``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from kvbench.layers import EXCEPTIONS, LAYERS, layer_of

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "kvbench"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvbench modules ``path`` imports (resolving relative imports and ``from pkg import submodule``)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.split(".")[0] == "kvbench"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "kvbench":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != me}


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    assert _cycles(_graph()) == []


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _top(module: str) -> str:
    """The top-level module or package of kvbench that ``module`` belongs to (``kvbench`` for the package itself)."""
    return ".".join(module.split(".")[:2])


def _against_the_order(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows from one top-level module to another of a higher layer or of its own layer (a sibling)."""
    layer = layer_of()
    return sorted((src, dst) for src, dsts in graph.items() for dst in dsts
                  if _top(src) != _top(dst) and layer[_top(dst)] <= layer[_top(src)])


def _excepted(src: str, dst: str) -> bool:
    return any(_under(src, importer) and _under(dst, imported) for importer, imported, _ in EXCEPTIONS)


def test_every_top_level_module_has_a_layer():
    """A new module or package directly under kvbench/ fails here until kvbench/layers.py places it (and a placed
    name that no longer exists fails too)."""
    placed = [name for _, names, _ in LAYERS for name in names]
    assert len(placed) == len(set(placed)), "a module is placed twice"
    assert {_top(m) for m in _modules()} == set(layer_of())


def test_no_arrow_runs_against_the_layer_order():
    bad = [f"{src} -> {dst}" for src, dst in _against_the_order(_graph()) if not _excepted(src, dst)]
    assert not bad, f"imports against kvbench/layers.py's order (move the code or list the arrow, with why): {bad}"


def test_every_exception_is_an_arrow_the_order_forbids_and_is_still_used():
    against = _against_the_order(_graph())
    for importer, imported, why in EXCEPTIONS:
        assert why.strip(), (importer, imported)
        assert any(_under(src, importer) and _under(dst, imported) for src, dst in against), (
            f"{importer} -> {imported} is not an import against the order any more: remove the exception")


def test_the_order_forbids_what_it_must():
    """The derived rule on made-up graphs: a task importing the engine or a method, the store building a task, a
    sibling importing a sibling, a lower layer importing the command line fail; downward arrows pass."""
    cases = {
        ("kvbench.tasks.pg19.task", "kvbench.engine.teacher_forcing"): True,
        ("kvbench.tasks.lmeval.lm", "kvbench.engine"): True,
        ("kvbench.tasks.longbench_v2.task", "kvbench.methods"): True,
        ("kvbench.tasks.base", "kvbench.jobs.answer"): True,
        ("kvbench.store.scores", "kvbench.tasks"): True,
        ("kvbench.jobs.plan", "kvbench.overrides"): True,  # siblings
        ("kvbench.methods.snapkv", "kvbench.run"): True,
        ("kvbench.jobs.answer", "kvbench.engine"): False,
        ("kvbench.methods.snapkv", "kvbench.engine.cache"): False,
        ("kvbench.tasks.encoding", "kvbench.models.spec"): False,
    }
    for (src, dst), forbidden in cases.items():
        flagged = [a for a in _against_the_order({src: {dst}}) if not _excepted(*a)]
        assert bool(flagged) is forbidden, (src, dst)


def test_the_readme_layout_names_every_layer():
    """The README's layout (``one layer per line``, in README.md or the docs page it moved to) names every module
    kvbench/layers.py places, as ``name.py`` or ``name/``, top layer first."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = []
    for path in texts:
        text = path.read_text(encoding="utf-8")
        at = text.find("one layer per line")
        if at >= 0:
            start = text.find("\n\n", at) + 2  # the indented list after the paragraph
            blocks.append(text[start : text.find("\n\n", start)])
    assert blocks, "no layout ('one layer per line') in README.md or docs/*.md"
    block = "\n".join(blocks)
    first = {}
    for index, (_, names, _) in enumerate(LAYERS):
        for name in names:
            match = re.search(rf"(?<![\w.]){re.escape(name)}(\.py|/)", block)
            first[name] = (match.start() if match else None, index)
    missing = [name for name, (at, _) in first.items() if at is None]
    assert not missing, f"the README's layout does not name: {missing}"
    order = [name for name, _ in sorted(first.items(), key=lambda item: item[1][0])]
    layers = [first[name][1] for name in order]
    assert layers == sorted(layers), f"the README's layout names them out of kvbench/layers.py's order: {order}"


FORBIDDEN = [
    # (importer package, imported package, why)
    ("kvbench.sweep", "kvbench.run", "the sweep runs jobs through kvbench.jobs, never the command line"),
    ("kvbench.bench", "kvbench.run", "the bench is its own command line"),
    ("kvbench.jobs", "kvbench.run", "the job runner sits below the command line"),
    ("kvbench.methods", "kvbench.models", "a method never loads a model"),
    ("kvbench.methods", "kvbench.engine.session", "the method contract owns its types (no session)"),
    ("kvbench.methods", "kvbench.analysis", "methods read measurements as data (a block map path), never run them"),
    ("kvbench.report", "kvbench.models", "a table never runs a model"),
    ("kvbench.report", "kvbench.engine", "a table never runs a model"),
    ("kvbench.report", "kvbench.analysis", "the report reads what analysis wrote"),
    ("kvbench.engine.attention", "kvbench.engine.session", "the session uses the attention function, not back"),
    ("kvbench.tasks.base", "kvbench.tasks.encoding", "the task contract sits below prompt encoding"),
    ("kvbench.store", "kvbench.jobs", "the store is below the job runner"),
]


@pytest.mark.parametrize(("importer", "imported", "why"), FORBIDDEN)
def test_no_arrow_runs_against_the_layers(importer, imported, why):
    graph = _graph()
    bad = sorted(f"{src} -> {dst}" for src, dsts in graph.items() if _under(src, importer)
                 for dst in dsts if _under(dst, imported))
    assert not bad, f"{why}: {bad}"


def test_scripts_never_import_the_command_line():
    modules = _modules()
    bad = [p.name for p in (ROOT / "scripts").rglob("*.py") if "kvbench.run" in _imports(p, modules)]
    assert not bad


def test_the_checks_see_real_arrows():
    """The walker finds what it must: a function-level import, a TYPE_CHECKING import, ``from pkg import module``."""
    graph = _graph()
    assert "kvbench.engine.session" in graph["kvbench.jobs.runner"] or "kvbench.engine" in graph["kvbench.jobs.runner"]
    assert "kvbench.engine.cache" in graph["kvbench.methods.base"]  # under TYPE_CHECKING
    assert "kvbench.tasks.pg19.data" in graph["kvbench.tasks.pg19.task"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


#: what the engine may import of kvbench.methods: the method contract and its shared helpers, never a method
METHOD_CONTRACT = {"kvbench.methods.base", "kvbench.methods.contexts", "kvbench.methods.cache_ops"}


def test_the_engine_imports_no_concrete_method():
    """The engine calls the method contract and never names a method: a method's decode step reaches the engine as
    data of its ``static_policy`` (its own step functions included), not as an import of its module (the per-layer
    static step imported D2O's merge and OmniKV's selection)."""
    graph = _graph()
    bad = sorted(f"{src} -> {dst}" for src, dsts in graph.items() if _under(src, "kvbench.engine")
                 for dst in dsts if _under(dst, "kvbench.methods") and dst not in METHOD_CONTRACT)
    assert not bad, bad
