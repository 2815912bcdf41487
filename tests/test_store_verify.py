"""python -m kvbench.store verify: every kind of damage is found, --clean repairs only what is safe."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.config import CONF_DIR, register_resolvers
from kvbench.store import JobDir, ids_digest
from kvbench.store.verify import inspect, job_dirs, main, scored_records


def _job(root, name, records=2, scores=True):
    key = {"model": "m", "method": name, "budget": "128", "task": "t", "seed": 1}
    job = JobDir(root, ("m", "t", name, "128"), key)
    job.path.mkdir(parents=True)
    job.write_config(OmegaConf.to_yaml(OmegaConf.create({"key": key, "resolved": {}})))
    for i in range(records):
        job.append_record({"id": f"s{i}", "score": 1.0})
    if scores:
        job.write_scores({"n_samples": records, "score": 1.0})
    return job


def test_verify_classifies_and_cleans(tmp_path, capsys):
    finished = _job(tmp_path, "finished")
    torn = _job(tmp_path, "torn", scores=False)
    with open(torn.samples_path, "ab") as fh:
        fh.write(b'{"id": "s2", "sco')
    duplicate = _job(tmp_path, "dup")
    duplicate.append_record({"id": "s1", "score": 0.0})
    moved = _job(tmp_path, "moved")
    wrong = moved.path.with_name("000000000000")
    shutil.move(moved.path, wrong)
    orphan = tmp_path / "runs" / "m" / "t" / "orphan" / "128" / "abcdefabcdef"
    orphan.mkdir(parents=True)
    temp = _job(tmp_path, "temp")
    (temp.path / ".scores.json.x1y2").write_text("{")
    failed = _job(tmp_path, "failed", records=1, scores=False)
    cause = {"kind": "exception", "error": "OutOfMemoryError: CUDA out of memory"}
    (failed.path / "failed.json").write_text(json.dumps(cause))
    overcount = _job(tmp_path, "overcount", records=1)
    overcount.write_scores({"n_samples": 5})
    running = _job(tmp_path, "running", scores=False)

    with running:  # held by "another process" (flock is per open file description)
        states = {p.parts[-3]: inspect(p) for p in job_dirs(tmp_path)}
        assert {k: v.state for k, v in states.items()} == {
            "finished": "finished", "torn": "incomplete", "dup": "inconsistent", "moved": "inconsistent",
            "orphan": "orphaned", "temp": "finished", "failed": "failed", "overcount": "inconsistent",
            "running": "running"}
        assert states["torn"].torn and states["torn"].records == 2
        assert "duplicate records: s1" in states["dup"].problems[0]
        assert "hashes to" in states["moved"].problems[0]
        assert "OutOfMemoryError" in states["failed"].problems[-1]
        assert "counts 5 samples, records hold 1" in states["overcount"].problems[0]
        assert main(["verify", "--results", str(tmp_path)]) == 1
        out = capsys.readouterr().out
        assert "9 job dirs" in out and "3 inconsistent" in out and "1 orphaned" in out
        assert main(["verify", "--results", str(tmp_path), "--clean"]) == 1  # inconsistent jobs remain
    assert not orphan.exists() and not (temp.path / ".scores.json.x1y2").exists()
    assert torn.samples_path.read_bytes().endswith(b"}\n") and len(torn.read_records()) == 2
    assert len(duplicate.read_records()) == 3 and finished.read_scores() == {"n_samples": 2, "score": 1.0}
    assert inspect(torn.path).problems == []


def test_verify_cli_on_a_clean_and_a_missing_store(tmp_path):
    _job(tmp_path, "ok")
    out = subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--results", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "1 job dirs" in out.stdout and "1 finished" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvbench.store", "verify", "--results", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "does not exist" in out.stderr


# ---- a real job: scores.json recomputed from its records, its compression judged ------------------------------------
@pytest.fixture(scope="module")
def real_store(tmp_path_factory):
    """One job on the tiny random model: SnapKV at budget 64 on two ~250-token passkey prompts (it compresses)."""
    root = tmp_path_factory.mktemp("store")
    from kvbench.jobs import run_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=tiny-random", "method=snapkv", "budget=64", "task=passkey", "task.context_lengths=[256]",
            "task.depths=[10,90]", "print_table=false", f"paths.results_dir={root}"])
    run_job(cfg)
    return root


@pytest.fixture
def real_job(real_store, tmp_path):
    """A copy of the real job for one test to edit."""
    shutil.copytree(real_store, tmp_path / "results")
    (path,) = job_dirs(tmp_path / "results")
    return path


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_a_real_job_is_recomputed_and_clean(real_job, capsys):
    report = inspect(real_job)
    assert (report.state, report.problems, report.notes) == ("finished", [], [])
    assert main(["verify", "--results", str(real_job.parents[5])]) == 0
    assert "1 finished" in capsys.readouterr().out


@pytest.mark.parametrize("key", [("score",), ("grid", "256", "90"), ("n",), ("resident_kv_bytes_mean",),
                                 ("prefill_seconds_mean",)])
def test_a_hand_edited_score_is_inconsistent(real_job, capsys, key):
    scores_path = real_job / "scores.json"
    scores = json.loads(scores_path.read_text())
    *parents, last = key
    holder = scores
    for part in parents:
        holder = holder[part]
    recorded = holder[last]
    holder[last] = recorded * 2 + 1
    scores_path.write_text(json.dumps(scores))
    report = inspect(real_job)
    name = ".".join(key)
    assert report.state == "inconsistent"
    assert f"{name}: scores.json has {recorded * 2 + 1!r}, the records give {recorded!r}" in report.problems[0]
    assert main(["verify", "--results", str(real_job.parents[5])]) == 1
    out = capsys.readouterr().out
    assert "1 inconsistent" in out and f"scores.json disagrees with its records: {name}:" in out


@pytest.mark.parametrize(("factor", "state"), [(1 + 1e-12, "finished"), (1 + 1e-7, "inconsistent")])
def test_numbers_agree_to_a_relative_1e_9(real_job, factor, state):
    _edit_json(real_job / "scores.json",
               lambda s: s.update(resident_kv_bytes_mean=s["resident_kv_bytes_mean"] * factor))
    assert inspect(real_job).state == state


@pytest.mark.parametrize("store", ["results/cpu_miniature", "results/cpu_miniature_snapkv_window_kernel",
                                   "tests/fixtures/results"])
def test_the_committed_stores_compressed_and_their_scores_follow_from_their_records(store):
    """Every committed job is finished, compressed where its method compresses, and its scores.json recomputes
    exactly from its records here (the fixture's data_dir is another machine's: the rebuild ignores it)."""
    root = Path(__file__).resolve().parents[1] / store
    reports = [inspect(path) for path in job_dirs(root)]
    assert reports and all((r.state, r.problems, r.notes) == ("finished", [], []) for r in reports), \
        [(r.path.name, r.state, r.problems, r.notes) for r in reports if r.problems or r.notes]


def test_a_task_that_cannot_be_rebuilt_here_gets_a_note(real_job, capsys):
    config = yaml.safe_load((real_job / "config.yaml").read_text())
    config["resolved"]["task"]["name"] = "not_installed_here"  # the key (and the directory's hash) is unchanged
    (real_job / "config.yaml").write_text(yaml.safe_dump(config))
    _edit_json(real_job / "scores.json", lambda s: s.update(score=99.0))
    report = inspect(real_job)
    assert report.state == "finished" and report.problems == []
    assert "task 'not_installed_here' cannot be rebuilt here" in report.notes[0]
    assert main(["verify", "--results", str(real_job.parents[5])]) == 0
    assert "note: task 'not_installed_here'" in capsys.readouterr().out


def test_a_changed_task_version_gets_a_note(real_job):
    _edit_json(real_job / "scores.json", lambda s: s.update(task_version="0", score=99.0))
    report = inspect(real_job)
    assert report.state == "finished" and "task version '0' was scored" in report.notes[0]


def _rewrite_records(job, edit):
    lines = (job / "samples.jsonl").read_text().splitlines()
    (job / "samples.jsonl").write_text("".join(json.dumps(edit(json.loads(line))) + "\n" for line in lines))


@pytest.mark.parametrize(("edit", "says"), [
    (lambda r: {**r, "layer_entries": [], "resident_kv_bytes": 0}, "have no cache measurements"),
    (lambda r: {**r, "layer_entries": [r["prompt_tokens"]] * len(r["layer_entries"])},
     "kept every prompt token in every layer"),
])
def test_a_job_that_ran_uncompressed_is_flagged(real_job, capsys, edit, says):
    """What the transformers 5.24 rename left behind: snapkv's records show FullKV's cache."""
    _edit_json(real_job / "meta.json", lambda m: m["versions"].update(transformers="5.24.0"))
    _rewrite_records(real_job, edit)
    report = inspect(real_job)
    assert report.state == "uncompressed" and says in report.problems[0]
    assert "snapkv at budget 64" in report.problems[0] and "(transformers 5.24.0)" in report.problems[0]
    assert main(["verify", "--results", str(real_job.parents[5])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("uncompressed ") and "transformers 5.24.0" in out and "1 uncompressed" in out
    assert main(["verify", "--results", str(real_job.parents[5]), "--clean"]) == 1  # nothing --clean can repair
    assert len((real_job / "samples.jsonl").read_text().splitlines()) == 2  # its records stay for a human


def test_scored_records_follow_the_planned_ids():
    """A later run with a smaller limit scores the first records only; its planned ids' digest says which."""
    records = [{"id": i} for i in ("a", "b", "c")]
    assert scored_records(records, {"n_samples": 3}) == records
    assert scored_records(records, {"n_samples": 2, "sample_ids_digest": ids_digest(["a", "b"])}) == records[:2]
    assert scored_records(records, {"n_samples": 2, "sample_ids_digest": ids_digest(["a", "c"])}) is None
