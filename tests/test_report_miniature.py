"""The committed CPU miniature report (results/cpu_miniature/report) is exactly what
`python -m kvbench.report all --results results/cpu_miniature --out <anywhere>` writes from the committed runs: every
file, byte for byte. A change to the report code that changes the report fails here until the report is regenerated
and committed (`python -m kvbench.report all --results results/cpu_miniature --out results/cpu_miniature/report`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.report.cli import main as report_main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "cpu_miniature"
REPORT = RESULTS / "report"
#: the matplotlib that drew the committed figures: PNG and PDF bytes depend on its version (text files do not)
MATPLOTLIB = "3.11.2"


def _files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_committed_miniature_report_is_reproduced_byte_for_byte(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    monkeypatch.chdir(tmp_path)  # the working directory does not matter
    out = tmp_path / "report"
    assert report_main(["all", "--results", str(RESULTS), "--out", str(out)]) == 0
    committed, fresh = _files(REPORT), _files(out)
    assert sorted(fresh) == sorted(committed), {"not committed": sorted(set(fresh) - set(committed)),
                                               "no longer written": sorted(set(committed) - set(fresh))}
    figures = {".png", ".pdf"}
    texts = [rel for rel in committed if rel.suffix not in figures and committed[rel] != fresh[rel]]
    assert not texts, f"stale committed report files: {texts}"
    drawn = [rel for rel in committed if rel.suffix in figures and committed[rel] != fresh[rel]]
    if drawn and matplotlib.__version__ != MATPLOTLIB:
        pytest.skip(f"{len(drawn)} figures differ, drawn by matplotlib {matplotlib.__version__} (committed: "
                    f"{MATPLOTLIB})")
    assert not drawn, f"stale committed figures: {drawn}"
