"""scripts/gpu_check.py judged on the CPU (``--device cpu``, the tiny random model): ragged caches (AdaKV, KVzip's
default layout) are read as the entries they keep, KVzip gets its tokenizer, and a sequential prefill (RoCo) runs on
the shorter prompt the report states. The CUDA run itself needs a GPU (scripts/gpu_session.sh)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_dry_run_reads_ragged_caches_and_runs_kvzip(gpu_check, tmp_path):
    out = tmp_path / "check.json"
    code = gpu_check.main(["--device", "cpu", "--model", "tiny-random", "--length", "256", "--sequential-length",
                           "160", "--methods", "adakv", "kvzip", "snapkv", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report["failed"]
    fp32 = {name: rows["fp32_cpu_vs_cuda"] for name, rows in report["methods"].items()}
    for name in ("adakv", "kvzip", "snapkv"):
        row = fp32[name]
        assert "refused" not in row and "error" not in row, (name, row)
        # 4 layers x 2 KV heads x budget 128 (AdaKV spreads the same total unevenly over heads, per layer)
        assert 0 < row["kept_entries"] <= 4 * 2 * 128, (name, row)
        assert row["kept_entries"] == row["cpu_kept_entries"] and row["kept_overlap"] == 1.0, (name, row)
        assert row["ok"] and row["length"] == 256
    assert fp32["adakv"]["kept_entries"] > 0.9 * 4 * 2 * 128  # the ragged layers' entries, not an empty tail
    assert report["failed"] == [] and report["deadline_seconds"] is None
    # bf16, the padded batch's tokens fed to each row alone: on one device the same choices (KVzip refuses batches)
    bf16 = {name: rows["bf16_batch2"] for name, rows in report["methods"].items()}
    assert "refused" in bf16["kvzip"]
    assert [bf16[name]["gap_vs_alone"] for name in ("adakv", "snapkv")] == [0.0, 0.0]


def test_a_padded_row_that_parts_from_its_row_alone_fails(gpu_check, tmp_path, monkeypatch):
    """A padded batch whose second row's tokens are not what that row alone chooses (here: ids shifted from the first
    row's, as a row decoding over a wrong cache might produce) fails the bf16 check, and says by how much."""
    real = gpu_check.generate

    def crossed(model, method, budget, prompts, new_tokens, pad_id, tokenizer):
        tokens, resident = real(model, method, budget, prompts, new_tokens, pad_id, tokenizer)
        if len(prompts) == 2:
            tokens = [tokens[0], [(t + 7) % 200 + 3 for t in tokens[0]]]
        return tokens, resident

    monkeypatch.setattr(gpu_check, "generate", crossed)
    monkeypatch.setattr(gpu_check, "compare_devices", lambda *a, **k: {"ok": True})
    out = tmp_path / "check.json"
    code = gpu_check.main(["--device", "cpu", "--model", "tiny-random", "--length", "256", "--methods", "snapkv",
                           "--out", str(out)])
    row = json.loads(out.read_text())["methods"]["snapkv"]["bf16_batch2"]
    assert code == 1 and row["ok"] is False and row["gap_vs_alone"] > gpu_check.MAX_BF16_GAP, row


def test_kept_positions_reads_a_ragged_layer(gpu_check):
    """A ragged layer's entries are flat in ``layer.ragged``; its ``positions``/``valid`` hold only the (empty) tail."""
    import torch

    from kvbench.engine import KVCache

    cache = KVCache()
    keys = torch.randn(1, 2, 6, 4)
    layer_keys, _ = cache.update(keys, keys.clone(), 0)
    layer = cache.layers[0]
    kept = torch.tensor([[[1, 0, 1, 0, 0, 1], [1, 1, 1, 1, 0, 0]]], dtype=torch.bool)
    layer.to_ragged(kept)
    assert layer.positions.shape[-1] == 0  # what the old reading counted
    assert gpu_check.kept_positions(cache) == {(0, 0, 0, 0), (0, 0, 0, 2), (0, 0, 0, 5),
                                               (0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 1, 2), (0, 0, 1, 3)}


def test_sequential_prefill_and_overrides_name_registered_methods(gpu_check):
    from kvbench.methods import METHODS

    assert set(gpu_check.SEQUENTIAL_PREFILL) <= set(METHODS.names())
    assert set(gpu_check.OVERRIDES) <= set(METHODS.names())


def test_a_method_not_started_by_the_deadline_fails_as_skipped(gpu_check, tmp_path):
    out = tmp_path / "check.json"
    code = gpu_check.main(["--device", "cpu", "--model", "tiny-random", "--length", "256", "--methods", "snapkv",
                           "--deadline", "0.001", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 1 and report["failed"] == ["snapkv"]
    for row in report["methods"]["snapkv"].values():
        assert row["ok"] is False and row["skipped"].startswith("deadline")
