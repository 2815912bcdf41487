"""``python -m kvbench.report``: the papers' tables (paper / ours / Δ), run tables and figures from a results dir.

    python -m kvbench.report                                   # every paper table (Markdown) with the default store
    python -m kvbench.report tables --tables DynamicKV:1 --results results --out results/report/tables
    python -m kvbench.report tables --ours-model smollm2-135m  # our SmolLM2 runs in the papers' layouts
    python -m kvbench.report figures --results results --out results/report/figures
    python -m kvbench.report all --results results/cpu_miniature --out results/cpu_miniature/report
    python -m kvbench.report check                              # printed averages vs the papers' own rules
    python -m kvbench.report readme [--check]   # generated blocks of README.md, docs/*.md, results READMEs
    python -m kvbench.report similarity ...   # moved to python -m kvbench.analysis.layer_similarity (forwarded)

``--results`` defaults to ``$KVBENCH_RESULTS_DIR`` or ``<repo>/results``. ``all`` writes ``<out>/README.md`` (the run
tables inline, links to every file), ``<out>/tables/`` (``runs_<model>_<task>`` and the paper tables that have at
least one of our numbers, each as ``.md``, ``.tex``, ``.csv``) and ``<out>/figures/`` (PNG + PDF). The same inputs give
byte-identical files wherever they are written (the README's regeneration line names ``<results>/report``, relative
to the repository root), so a report regenerated into a temporary directory equals the committed one. Regenerated in
place, ``all`` removes the tables, figures and ``claims.md`` that the runs no longer produce (a deleted run's figure),
one stderr line each, and leaves every other file alone: the directory then equals a fresh report.

Runs whose records show that their method never compressed (FullKV numbers under the method's name, as every run had
while transformers 5.24's cache keyword rename went unnoticed) are left out of tables and figures, with one warning
line each on stderr; ``--include-uncompressed`` keeps them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvbench.errors import DataError, KVBenchError


def default_results() -> Path:
    from kvbench.config import project_root

    return Path(os.environ.get("KVBENCH_RESULTS_DIR") or Path(project_root()) / "results")


def parse_ours_models(items: list[str] | None) -> dict[str, str]:
    """``["smollm2-135m"]`` -> ``{"*": "smollm2-135m"}``; ``["Llama2-7B-chat=llama2-7b-chat"]`` -> per paper model."""
    out: dict[str, str] = {}
    for item in items or []:
        paper, sep, ours = item.rpartition("=")
        out[paper if sep else "*"] = ours
    return out


def write_paper_tables(specs, runs, out: Path | None, ours_models: dict[str, str], only_with_ours: bool = False,
                       paper_dir: Path | None = None) -> list[tuple[object, list[Path]]]:
    """Build each table; write ``<id>.md/.tex/.csv`` to ``out`` (or print Markdown when ``out`` is None)."""
    from kvbench.report.render import to_csv, to_latex, to_markdown
    from kvbench.report.tables import build_table

    written = []
    for spec in specs:
        table = build_table(spec, runs, paper_dir, ours_models)
        if only_with_ours and not table.has_ours:
            continue
        if out is None:
            sys.stdout.write(to_markdown(table) + "\n")
            written.append((table, []))
            continue
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for ext, text in (("md", to_markdown(table)), ("tex", to_latex(table)), ("csv", to_csv(table))):
            path = out / f"{spec.id}.{ext}"
            path.write_text(text, encoding="utf-8")
            files.append(path)
        written.append((table, files))
    return written


def write_run_tables(runs, out: Path) -> list[tuple[str, Path, str]]:
    """``runs_<model>_<task>.{md,tex,csv}`` per (model, task); returns (name, md path, markdown)."""
    from kvbench.report.render import frame_to_csv, frame_to_latex, frame_to_markdown
    from kvbench.report.runs import group_name, groups, runs_table

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for model, task, protocol in groups(runs):
        frame = runs_table(runs, model, task, protocol)
        name = "runs_" + group_name(model, task, protocol)
        title = f"{task}{f' ({protocol})' if protocol else ''}: {model}"
        markdown = frame_to_markdown(frame)
        (out / f"{name}.md").write_text(f"### {title}\n\n{markdown}", encoding="utf-8")
        (out / f"{name}.csv").write_text(frame_to_csv(frame), encoding="utf-8")
        (out / f"{name}.tex").write_text(frame_to_latex(frame, title, f"tab:{name}"), encoding="utf-8")
        written.append((title, out / f"{name}.md", markdown))
    return written


def run_all(results: Path, out: Path, ours_models: dict[str, str], paper_tables: str = "with_ours",
            include_uncompressed: bool = False, runs=None) -> Path:
    """Tables + figures + an index README for one results directory (experiment-agnostic); ``runs``: its runs
    when the caller has read them already."""
    from kvbench.report.claims import write_claims
    from kvbench.report.figures import make_figures
    from kvbench.report.specs import load_specs
    from kvbench.report.store import load_runs

    if runs is None:
        runs = load_runs(results, include_uncompressed=include_uncompressed)
    tables_dir, figures_dir = out / "tables", out / "figures"
    run_tables = write_run_tables(runs, tables_dir)
    paper = write_paper_tables(load_specs(), runs, tables_dir, ours_models,
                               only_with_ours=paper_tables == "with_ours") if paper_tables != "none" else []
    figures = make_figures(results, figures_dir, runs)
    claims = write_claims(results, runs, out)
    shown = _shown(results)  # the same line wherever this copy is written: a report says how to rebuild itself
    command = f"python -m kvbench.report all --results {shown} --out {shown}/report"
    command += "".join(f" --ours-model {k + '=' if k != '*' else ''}{v}" for k, v in sorted(ours_models.items()))
    if paper_tables != "with_ours":
        command += f" --paper-tables {paper_tables}"
    if include_uncompressed:
        command += " --include-uncompressed"
    lines = [f"# Report: {shown}", "", f"Regenerate: `{command}`", "", f"{len(runs)} finished runs.", ""]
    if claims is not None:  # the results directory's claims.yaml, evaluated (kvbench/report/claims.py)
        lines += ["## Claims", "", claims.read_text(encoding="utf-8").split("\n", 2)[2].strip(), "",
                  f"(`{claims.relative_to(out).as_posix()}`)", ""]
    for title, path, markdown in run_tables:
        lines += [f"## {title}", "", markdown, f"(`{path.relative_to(out).as_posix()}`, also `.csv`, `.tex`)", ""]
    if paper:
        lines += ["## Paper tables with our numbers", ""]
        for table, files in paper:
            lines.append(f"* {table.spec.title}: " + ", ".join(f"`{f.relative_to(out).as_posix()}`" for f in files))
        lines.append("")
    pngs = [f for f in figures if f.suffix == ".png"]
    if pngs:
        lines += ["## Figures", ""]
        for png in pngs:
            rel = png.relative_to(out).as_posix()
            lines += [f"### {png.stem}", "", f"![{png.stem}]({rel})", ""]
    out.mkdir(parents=True, exist_ok=True)
    index = out / "README.md"
    index.write_text("\n".join(lines), encoding="utf-8")
    written = {index, *(f for _, md, _ in run_tables for f in (md, md.with_suffix(".csv"), md.with_suffix(".tex"))),
               *(f for _, files in paper for f in files), *figures, *([claims] if claims is not None else [])}
    _prune(out, written)
    return index


#: what a report owns inside ``out``: files of these kinds that this run did not write are left from older runs
_REPORT_FILES = {".md", ".csv", ".tex", ".png", ".pdf"}


def _prune(out: Path, written: set[Path]) -> None:
    """Remove the report's files that these runs no longer produce (a deleted run's table or figure), one line each.

    Only ``out/claims.md`` and the report kinds of file directly in ``out/tables`` and ``out/figures`` are candidates,
    so that a report regenerated in place equals one written into an empty directory; other files are left alone.
    """
    keep = {p.resolve() for p in written}
    candidates = [out / "claims.md"] + [p for sub in ("tables", "figures") if (out / sub).is_dir()
                                        for p in sorted((out / sub).iterdir())]
    removed = [p for p in candidates if p.is_file() and p.suffix in _REPORT_FILES and p.resolve() not in keep]
    for path in removed:
        path.unlink()
        print(f"removed {path}: the runs no longer produce it", file=sys.stderr)


def _shown(path: Path) -> str:
    """``path`` relative to the repository root when inside it (``results/cpu_miniature``), else as given."""
    from kvbench.config import project_root

    try:
        return path.resolve().relative_to(Path(project_root()).resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def check(paper_dir: Path | None = None) -> int:
    """Re-aggregate every paper table from its own cells; print the printed numbers that do not follow."""
    from kvbench.report.specs import load_specs
    from kvbench.report.tables import build_table

    total = bad = 0
    for spec in load_specs():
        table = build_table(spec, None, paper_dir)
        for c in table.checks:
            total += 1
            if not c.ok:
                bad += 1
                print(f"{spec.title}: {c.row} | {c.column}: printed {c.printed:g}, recomputed {c.exact:.4f}")
    print(f"{total} printed averages/derived cells checked, {total - bad} reproduced, {bad} not (listed above; "
          "results/paper/README.md says which are documented misprints)")
    return 0


def _runs_or_refuse(results: Path, command: str, include_uncompressed: bool):
    """The finished runs under ``results``; none is one line (exit 2), not an empty report or the papers' tables
    passed off as a report of this directory."""
    from kvbench.report.store import load_runs

    if not results.is_dir():
        problem = f"results directory {results} does not exist"
    else:
        runs = load_runs(results, include_uncompressed=include_uncompressed)
        if not runs.empty:
            return runs
        problem = f"no finished runs under {results / 'runs'}"
    hint = ("; `python -m kvbench.report tables --paper-only` prints the papers' tables alone" if command == "tables"
            else "; run jobs first (python -m kvbench.run ...), or pass --results")
    raise DataError(f"{problem}: nothing to report{hint}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("tables", "figures", "all", "check", "similarity", "readme")
    if argv[:1] == ["readme"]:  # its own options (kvbench/report/readme.py)
        from kvbench.report.readme import main as readme_main

        return readme_main(argv[1:])
    if argv[:1] == ["similarity"]:  # moved: the measurement runs a model, the report only reads what it wrote
        import runpy

        sys.argv = ["python -m kvbench.analysis.layer_similarity", *argv[1:]]
        runpy.run_module("kvbench.analysis.layer_similarity", run_name="__main__")  # forwarding alias, one release
        return 0
    if not argv or argv[0] not in commands and argv[0] not in ("-h", "--help"):
        argv = ["tables", *argv]
    parser = argparse.ArgumentParser(prog="python -m kvbench.report", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {"tables": "the papers' tables in their layouts, with our numbers and the difference (the default)",
             "figures": "PNG + PDF figures from a results directory",
             "all": "run tables, paper tables and figures + an index README (one line regenerates a result set)"}
    for name in ("tables", "figures", "all"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--results", type=Path, default=None, help="results directory (holds runs/)")
        p.add_argument("--out", type=Path, default=None, help="output directory (tables: stdout when omitted)")
        p.add_argument("--include-uncompressed", action="store_true",
                       help="keep runs whose records show the method never compressed (FullKV numbers under its "
                            "name); by default they are left out with a warning each")
        if name != "figures":
            p.add_argument("--ours-model", action="append", default=[], metavar="[PAPER_MODEL=]NAME",
                           help="take our numbers from this kvbench model (for every paper model, or one)")
        if name == "tables":
            p.add_argument("--paper-only", action="store_true",
                           help="the papers' tables alone, re-aggregated from their own cells (no runs needed; "
                                "without it a results directory without runs is an error)")
            p.add_argument("--tables", nargs="*", default=None, metavar="PAPER[:N]",
                           help="which tables (default: all), e.g. DynamicKV:1 OmniKV")
            p.add_argument("--paper-dir", type=Path, default=None, help="default: <repo>/results/paper")
        if name == "all":
            p.add_argument("--paper-tables", choices=("with_ours", "all", "none"), default="with_ours",
                           help="paper-layout tables to write (default: those with at least one number of ours)")
    sub.add_parser("check", help="recompute every printed average of the papers from their own cells")
    sub.add_parser("similarity", help="moved to python -m kvbench.analysis.layer_similarity (forwarded)")
    sub.add_parser("readme", help="rewrite the generated blocks of README.md, docs/*.md and the results READMEs "
                                  "from the registries and committed results (--check: exit 1 when stale)")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            return check()
        results = args.results or default_results()
        from kvbench.report.store import RUN_COLUMNS

        if args.command == "tables" and args.paper_only:
            import pandas as pd

            from kvbench.report.specs import select_specs

            written = write_paper_tables(select_specs(args.tables), pd.DataFrame([], columns=RUN_COLUMNS), args.out,
                                         {}, paper_dir=args.paper_dir)
            if args.out is not None:
                print(f"{len(written)} tables -> {args.out}")
            return 0
        if args.command == "tables":
            from kvbench.report.specs import select_specs

            select_specs(args.tables)  # a bad table name is said first
        runs = _runs_or_refuse(results, args.command, args.include_uncompressed)
        if args.command == "figures":
            from kvbench.report.figures import make_figures

            out = args.out or results / "report" / "figures"
            for path in make_figures(results, out, runs):
                print(path)
            return 0
        ours = parse_ours_models(args.ours_model)
        if args.command == "all":
            out = args.out or results / "report"
            print(run_all(results, out, ours, args.paper_tables, include_uncompressed=args.include_uncompressed,
                          runs=runs))
            return 0
        from kvbench.report.specs import select_specs

        written = write_paper_tables(select_specs(args.tables), runs, args.out, ours, paper_dir=args.paper_dir)
        if args.out is not None:
            print(f"{len(written)} tables -> {args.out}")
        return 0
    except KVBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
