"""scripts/pod_adapt.py (POD post-training) end to end on the tiny random model: it trains with POD's attention,
lowers the held-out loss under that attention, and writes a checkpoint kvbench can load."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pod_adapt.py"


def _script():
    spec = importlib.util.spec_from_file_location("pod_adapt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pod_adapt_trains_and_writes_a_loadable_checkpoint(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(5):  # repetitive text: a 4-layer random model can learn it in a few dozen steps
        (texts / f"{i}.txt").write_text(" ".join(f"alpha beta gamma delta {i}" for _ in range(60)))
    block_map = tmp_path / "map.json"
    block_map.write_text(json.dumps({"model": "tiny-random", "delta": 0.5, "granularity": "layer", "num_layers": 4,
                                     "num_kv_heads": 2, "blocks": [[0, 1], [2, 3]]}))
    out = tmp_path / "out"
    summary = _script().main(["--model", "tiny-random", "--block-map", str(block_map), "--n-s", "2", "--n-r", "8",
                              "--texts", str(texts), "--eval-texts", "1", "--seq-len", "48", "--steps", "30",
                              "--lr", "3e-3", "--warmup", "3", "--eval-every", "10", "--eval-windows", "2",
                              "--out", str(out)])
    assert summary["pod_after"] < summary["pod_before"] - 1.0
    assert [step for step, _ in summary["pod_during"]] == [10, 20]
    with open(out / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 31))
    assert float(rows[-1]["lr"]) < float(rows[5]["lr"])  # cosine decay after warmup
    assert json.loads((out / "eval.json").read_text())["pod_after"] == summary["pod_after"]
    from transformers import AutoModelForCausalLM

    adapted = AutoModelForCausalLM.from_pretrained(out / "model")
    from kvbench.models import load_model, spec_from_config

    base = load_model(spec_from_config({"name": "tiny-random", "source": "tiny-random",
                                        "tiny": {"layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16,
                                                 "hidden": 64, "intermediate": 128, "seed": 0}})).model
    weight = adapted.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(weight, base.model.layers[1].self_attn.q_proj.weight)


def test_pod_adapt_rejects_a_window_without_distant_tokens(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _script().main(["--block-map", "x.json", "--n-s", "16", "--n-r", "240", "--seq-len", "256",
                        "--out", str(tmp_path)])
    assert "must be < --seq-len 256" in capsys.readouterr().err
