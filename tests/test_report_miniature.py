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
#: the miniature's SnapKV window / kernel ablation (conf/experiment/cpu_miniature_snapkv_window_kernel.yaml): a claims
#: store of its own, held to the same bar
WINDOW_KERNEL = ROOT / "results" / "cpu_miniature_snapkv_window_kernel"
STORES = pytest.mark.parametrize("results", [RESULTS, WINDOW_KERNEL], ids=lambda p: p.name)
#: the matplotlib that drew the committed figures: PNG and PDF bytes depend on its version (text files do not)
MATPLOTLIB = "3.11.2"


def _files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@STORES
def test_the_committed_miniature_report_is_reproduced_byte_for_byte(tmp_path, monkeypatch, results):
    pytest.importorskip("matplotlib")
    import matplotlib

    monkeypatch.chdir(tmp_path)  # the working directory does not matter
    out = tmp_path / "report"
    assert report_main(["all", "--results", str(results), "--out", str(out)]) == 0
    committed, fresh = _files(results / "report"), _files(out)
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


# ---- issue #20: the committed runs can decide the claims ------------------------------------------------------------
#: samples per run (task, method, budget); PG-19 documents: conf/experiment/cpu_miniature.yaml's exception
MIN_SAMPLES = 40
MIN_DOCUMENTS = 8


def _rerun_runs(results=RESULTS):
    """The committed runs, or a skip while they are the first miniature's (10 samples per task), which predates
    issue #20's experiment file: `python -m kvbench.run -m +experiment=cpu_miniature` reruns it."""
    from kvbench.report.store import load_runs

    runs = load_runs(results)
    if (runs["n_samples"] < MIN_SAMPLES).all():
        pytest.skip(f"the committed {results.name} runs predate issue #20's rerun (at most "
                    f"{int(runs['n_samples'].max())} samples per run); run conf/experiment/{results.name}.yaml")
    return runs


@STORES
def test_every_committed_run_has_enough_samples_and_its_layer_entries(results):
    from kvbench.report.store import records

    runs = _rerun_runs(results)
    short, empty = [], []
    for row in runs.to_dict("records"):
        floor = MIN_DOCUMENTS if row["task"] == "pg19" else MIN_SAMPLES
        recs = records(results, row["path"])
        if min(len(recs), row["n_samples"]) < floor:
            short.append(f"{row['path']}: {len(recs)} samples")
        if not recs or not all(rec.get("layer_entries") for rec in recs):
            empty.append(row["path"])
    assert not short, f"runs below {MIN_SAMPLES} samples (PG-19: {MIN_DOCUMENTS}): {short}"
    assert not empty, f"runs with samples without layer_entries: {empty}"


@STORES
def test_every_committed_claim_row_has_an_interval_a_p_value_and_a_verdict(results):
    from kvbench.report.claims import Evidence, evaluate_all, load_claims

    runs = _rerun_runs(results)
    spec = load_claims(results / "claims.yaml")
    bad = []
    for claim, verdicts in evaluate_all(spec, Evidence(runs, spec["model"], results)):
        for verdict in verdicts:
            if claim["kind"] == "fullkv_solves":  # a precondition: FullKV's score, no test
                ok = verdict.verdict in ("held", "not testable here")
            else:
                ok = verdict.verdict in ("held", "did not hold", "inconclusive") and all(
                    row.p and "[" in row.values for row in verdict.rows)
            if not ok:
                bad.append(f"{claim['paper']}: {claim['claim']} @ {verdict.budget}: {verdict.verdict}")
    assert not bad, bad


def test_the_ablation_reruns_the_miniatures_own_jobs_exactly():
    """The ablation's jobs that the miniature also ran (the same hash: SnapKV's default, PyramidKV, FullKV) reproduce
    the miniature's predictions and per-layer sizes on every sample, so its comparisons pair with the miniature's."""
    from kvbench.report.store import load_runs, records

    def recs(results: Path, job: str) -> dict:
        return {r["id"]: (r["prediction"], r["layer_entries"]) for r in records(results, job)}

    jobs = list(load_runs(WINDOW_KERNEL)["path"])
    shared = [job for job in jobs if (RESULTS / job).is_dir()]
    assert sorted(Path(job).parts[-3] for job in shared) == ["fullkv", "pyramidkv", "snapkv"] and len(jobs) == 6
    for job in shared:
        assert recs(WINDOW_KERNEL, job) == recs(RESULTS, job), job
