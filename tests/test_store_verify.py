"""python -m kvbench.store verify: every kind of damage is found, --clean repairs only what is safe."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from omegaconf import OmegaConf

from kvbench.store import JobDir
from kvbench.store.verify import inspect, job_dirs, main


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
