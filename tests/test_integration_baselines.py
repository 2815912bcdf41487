"""Issue #4 baselines through the runner on the real SmolLM2-135M (needle_chat, one ~1.5k-token sample, budget
128, 8 new tokens; marked slow), and the refusals of the methods that cannot run here (one line, exit code 2, no
model load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from kvbench.config import CONF_DIR, register_resolvers
from kvbench.jobs import run_job

pytestmark = pytest.mark.slow
ENTRY = 30 * 3 * 64 * 2 * 4  # bytes per cached token: layers x KV heads x head_dim x (K, V) x fp32


def _job(tmp_path, method, *overrides):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"method={method}", "budget=128", "task=needle_chat", "task.context_lengths=[1700]", "task.depths=[50]",
            "task.max_new_tokens=8", "limit=1", f"paths.results_dir={tmp_path}", "print_table=false", *overrides,
        ])
    scores = run_job(cfg)
    (job,) = sorted((tmp_path / "runs").glob("*/*/*/*/*"))
    (record,) = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    return scores, record


@pytest.mark.parametrize("method", ["quest", "infllm"])
def test_full_resident_cache_with_sparse_attention(tmp_path, method):
    scores, record = _job(tmp_path, method)
    n = record["prompt_tokens"]
    assert 1400 < n < 1700 and record["new_tokens"] > 0 and scores["n_samples"] == 1
    assert record["resident_kv_bytes"] == n * ENTRY  # nothing evicted
    assert record["layer_entries"] == [n] * 30
    if method == "quest":  # 2 dense layers over n + t + 1, 28 layers over 7 pages + the current page
        steps = record["decode_steps"]
        expected = sum(2 * (n + t + 1) + 28 * (7 * 16 + (n + t) % 16 + 1) for t in range(steps)) / (30 * steps)
        assert record["attended_tokens_mean"] == pytest.approx(expected, abs=0.01)
    else:  # 10 init + 1 block of 32 + 86 local, plus fewer than 32 tokens not yet in a block
        assert 128 <= record["attended_tokens_mean"] < 160


def test_pyramidinfer_layers_average_the_budget(tmp_path):
    _, record = _job(tmp_path, "pyramidinfer")
    entries = record["layer_entries"]
    assert sum(entries) == 30 * 128 and entries[0] > entries[-1]
    assert record["resident_kv_bytes"] == 128 * ENTRY


@pytest.mark.parametrize("method, message", [
    ("offload", "method 'offload' needs the model on a CUDA device"),
    ("lococo", "method 'lococo' (Cai et al. 2024, arXiv:2406.05317) needs its learned 1-D convolution kernels"),
])
def test_refusals_are_one_line_before_loading(tmp_path, method, message):
    if method == "offload" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", f"method={method}", "budget=128", "task=needle_chat"],
                          capture_output=True, text=True, env=env, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert not (tmp_path / "runs").exists()  # refused while planning: no job directory, no model load
