"""KVzip's scoring and selection against kvpress: on seeded inputs, kvbench's reconstruction scores equal kvpress 0.5.5
``KVzipPress.score_kvzip``'s within 1e-6 (absolute; attention probabilities in float32) and the entries kept per layer
and KV head equal ``KVzipPress.compress_post``'s exactly (global and layerwise allocation, sinks, a chat prefix).

The fixture ``tests/fixtures/parity/kvpress_kvzip.json`` was written by ``scripts/parity/kvpress/generate_kvzip.py``
in the kvpress side environment; this test needs neither. The repeat forwards themselves are not compared: kvbench
has no engine hook for them yet and ``method=kvzip`` is refused at plan time (test below).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvbench.methods.kvzip_ops import kvzip_keep, reconstruction_scores

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "parity" / "kvpress_kvzip.json").read_text())
TOLERANCE = 1e-6


def _cases_module():
    spec = importlib.util.spec_from_file_location("kvpress_parity_cases", ROOT / "scripts/parity/kvpress/cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _cases_module()


def _scores(case) -> torch.Tensor:
    """kvbench's scores ``(L, 1, H, n)``, chunk by chunk as the repeat forwards would produce them."""
    arrays = CASES.kvzip_inputs(case)
    assert CASES.kvzip_digest(arrays) == case["inputs_sha256"], "the seeded inputs changed"
    n = case["prefix"] + case["context"]
    out = torch.zeros(case["layers"], 1, case["kv_heads"], n)
    for layer in range(case["layers"]):
        keys = torch.from_numpy(arrays["keys"][layer])
        for (start, end), q, rk in zip(CASES.kvzip_chunks(case), arrays["queries"][layer],
                                       arrays["repeat_keys"][layer]):
            cached = torch.cat([keys, torch.from_numpy(rk)], dim=2)
            out[layer, :, :, start:end] = reconstruction_scores(torch.from_numpy(q), cached, start, end,
                                                                case["n_sink"], case["head_dim"] ** -0.5)
    return out


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"case{c['index']}")
def test_kvpress_kvzip_scores(case):
    ours = _scores(case)[:, 0]
    assert torch.allclose(ours, torch.tensor(case["scores"]), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"case{c['index']}")
def test_kvpress_kvzip_kept_entries(case):
    scores = _scores(case)
    n_layers, _, h, n = scores.shape
    per = h * n if case["layerwise"] else n_layers * h * n
    keep = kvzip_keep(scores, int(per * case["ratio"]), case["layerwise"], case["n_sink"])
    kept = [[torch.nonzero(keep[layer, 0, head]).flatten().tolist() for head in range(h)] for layer in range(n_layers)]
    assert kept == case["kept"]


def test_kvpress_kvzip_is_refused_at_plan_time_with_one_line():
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.errors import NotAvailableError
    from kvbench.jobs.plan import plan_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["method=kvzip", "budget=128"])
    with pytest.raises(NotAvailableError) as info:
        plan_job(cfg)
    assert "\n" not in str(info.value) and "method 'kvzip' is configured but not implemented yet" in str(info.value)
