"""The provenance block (kvbench/report/provenance.py): what a results directory's finished runs ran on (versions,
commit, threads from each meta.json) and the model's time (prefill + decode summed over each job's records), on
synthetic job directories whose answer is known."""

from __future__ import annotations

import json
from pathlib import Path

from kvbench.report.provenance import provenance, provenance_markdown


def _job(root: Path, task: str, method: str, *, seconds: list[tuple[float, float]], transformers: str = "5.24.0",
         sha: str = "a" * 40, threads: int = 1, finished: bool = True) -> None:
    path = root / "runs" / "m" / task / method / "128" / f"{abs(hash((task, method))) % 10**12:012d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({
        "git_sha": sha, "hardware": {"torch_threads": threads},
        "versions": {"transformers": transformers, "torch": "2.13.0+cpu", "python": "3.11.7"}}))
    lines = [json.dumps({"id": str(i), "prefill_seconds": p, "decode_seconds": d}) for i, (p, d) in enumerate(seconds)]
    (path / "samples.jsonl").write_text("".join(line + "\n" for line in lines))
    if finished:
        (path / "scores.json").write_text(json.dumps({"task": task}))


def test_counts_versions_commits_and_the_models_time(tmp_path):
    _job(tmp_path, "needle", "h2o", seconds=[(1000.0, 800.0), (900.0, 900.0)])  # 3600 s
    _job(tmp_path, "needle", "snapkv", seconds=[(3600.0, 0.0)], sha="b" * 40 + "-dirty")
    _job(tmp_path, "passkey", "h2o", seconds=[(1800.0, 1800.0)], transformers="5.23.0", threads=2)
    _job(tmp_path, "passkey", "snapkv", seconds=[(99999.0, 0.0)], finished=False)  # unfinished: not counted
    p = provenance(tmp_path)
    assert (p.jobs, p.samples, p.seconds) == (3, 4, 3 * 3600.0)
    assert p.tasks == {"needle": [2, 3, 7200.0], "passkey": [1, 1, 3600.0]}
    assert p.commits == {"aaaaaaaaaaaa": 2, "bbbbbbbbbbbb-dirty": 1}
    assert p.threads == {"1": 2, "2": 1}
    text = provenance_markdown(tmp_path)
    assert text.startswith("3 finished jobs, 4 samples. ")
    assert ("transformers 5.24.0, torch 2.13.0+cpu, python 3.11.7 (2); "
            "transformers 5.23.0, torch 2.13.0+cpu, python 3.11.7 (1)") in text
    assert "kvbench commit aaaaaaaaaaaa (2); bbbbbbbbbbbb-dirty (1)" in text
    assert "(prefill + decode, summed over samples): 3.0 h (needle 2 jobs / 3 samples / 2.0 h, " \
           "passkey 1 job / 1 sample / 1.0 h)" in text


def test_one_value_is_said_once_for_all_runs(tmp_path):
    _job(tmp_path, "needle", "h2o", seconds=[(1.0, 2.0)])
    _job(tmp_path, "needle", "snapkv", seconds=[(1.0, 2.0)])
    text = provenance_markdown(tmp_path)
    assert "python 3.11.7 (all 2); kvbench commit aaaaaaaaaaaa (all 2); torch threads per job 1 (all 2)" in text
    assert provenance_markdown(tmp_path / "nothing") == "No finished runs.\n"
