import json
import os
import subprocess
import sys

import pytest

from kvbench.store import JobDir, JobLockedError, config_hash, ids_digest


def _job(tmp_path, key=None):
    return JobDir(tmp_path, ("m", "t", "meth", "128"), key or {"a": 1})


def test_hash_is_canonical_and_path_layout(tmp_path):
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    job = _job(tmp_path)
    assert job.path.relative_to(tmp_path).parts[:5] == ("runs", "m", "t", "meth", "128")
    assert job.path.name == config_hash({"a": 1})[:12]


def test_torn_last_line_is_dropped_and_repaired(tmp_path):
    job = _job(tmp_path)
    with job:
        job.append_record({"id": "a", "score": 1})
        job.append_record({"id": "b", "score": 0})
        with open(job.samples_path, "ab") as fh:
            fh.write(b'{"id": "c", "sco')  # a kill mid-write
        assert [r["id"] for r in job.read_records()] == ["a", "b"]
        assert [r["id"] for r in job.read_records(repair=True)] == ["a", "b"]
        job.append_record({"id": "c", "score": 1})
    lines = job.samples_path.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "b", "c"]


def test_scores_are_atomic_and_mark_finished(tmp_path):
    job = _job(tmp_path)
    with job:
        assert not job.is_finished(["a"])
        job.write_scores({"score": 1.0, "sample_ids_digest": ids_digest(["a"])})
    assert job.is_finished(["a"]) and not job.is_finished(["a", "b"])
    assert not [p for p in os.listdir(job.path) if p.startswith(".scores")]  # no temp files left behind


def test_second_process_cannot_take_the_lock(tmp_path):
    job = _job(tmp_path)
    code = (
        "import sys; from kvbench.store import JobDir, JobLockedError\n"
        f"j = JobDir({str(tmp_path)!r}, ('m','t','meth','128'), {{'a': 1}})\n"
        "try:\n    j.__enter__()\nexcept JobLockedError as e:\n    print('locked'); sys.exit(3)\n"
    )
    with job:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 3 and "locked" in proc.stdout
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0  # released


def test_lock_in_same_process_is_exclusive(tmp_path):
    with _job(tmp_path), pytest.raises(JobLockedError):
        _job(tmp_path).__enter__()
