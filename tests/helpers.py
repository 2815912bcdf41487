"""Small builders shared by the tests (tensor-level method tests need no model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbench.engine.cache import KVLayer
from kvbench.methods.base import DecodeContext, PrefillContext
from kvbench.tasks.base import Sample, Task


def make_layer(keys: torch.Tensor, values: torch.Tensor) -> KVLayer:
    layer = KVLayer()
    layer.update(keys, values)
    return layer


def prefill_ctx(queries, layer, capacity, layer_idx=0, num_layers=1, key_valid=None) -> PrefillContext:
    b, hq, n, d = queries.shape
    prompt_lens = key_valid.sum(-1) if key_valid is not None else torch.full((b,), n)
    return PrefillContext(
        layer_idx=layer_idx, num_layers=num_layers, num_heads=hq, num_kv_heads=layer.keys.shape[1],
        scaling=d**-0.5, queries=queries, key_valid=key_valid, prompt_lens=prompt_lens,
        capacity=torch.full((b,), capacity) if isinstance(capacity, int) else capacity,
    )


def decode_step(method, layer: KVLayer, query, key, value, capacity: int):
    """Append one token and run the method's decode hook with exact attention probabilities, as the engine does."""
    from kvbench.engine.attention import grouped_attention

    layer.update(key, value)
    _, probs = grouped_attention(query, layer.keys, layer.values, None, query.shape[-1] ** -0.5)
    ctx = DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=layer.keys.shape[1], query=query, probs=probs,
                        capacity=torch.full((query.shape[0],), capacity))
    method.decode(layer, ctx)


def kept_positions(layer: KVLayer, row: int = 0) -> list[list[int]]:
    """Sorted kept original positions per head of one row."""
    out = []
    for h in range(layer.positions.shape[1]):
        pos = layer.positions[row, h]
        if layer.valid is not None:
            pos = pos[layer.valid[row, h]]
        out.append(sorted(int(p) for p in pos))
    return out


def softmax_row(q_vec, keys, upto, d):
    logits = torch.tensor([float(q_vec @ keys[j]) / math.sqrt(d) for j in range(upto + 1)], dtype=torch.float64)
    return torch.softmax(logits, 0)


def assert_same_up_to_ties(ours: list[int], ref: list[int], scores: dict[int, float], forced: set[int]):
    """Sets must be equal, except entries whose score ties the selection threshold exactly."""
    ours_s, ref_s = set(ours), set(ref)
    if ours_s == ref_s:
        return
    chosen = [scores[i] for i in ref_s - forced]
    threshold = min(chosen)
    for i in ours_s ^ ref_s:
        assert i not in forced and math.isclose(scores[i], threshold, rel_tol=1e-5, abs_tol=1e-7), (i, scores[i])


def snapkv_reference(q, k, capacity, window, kernel, pooling):
    """SnapKV paper procedure for one row, with Python loops: returns kept positions per KV head and the scores."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    prefix = n - window
    votes = [[0.0] * prefix for _ in range(hq)]
    for h in range(hq):
        for i in range(prefix, n):
            p = softmax_row(q[h, i], k[h // g], i, d)
            for j in range(prefix):
                votes[h][j] += float(p[j])
    r = kernel // 2
    pooled = []
    for h in range(hq):
        row = []
        for j in range(prefix):
            neighbours = votes[h][max(0, j - r) : min(prefix, j + r + 1)]
            row.append(max(neighbours) if pooling == "max" else sum(neighbours) / kernel)
        pooled.append(row)
    kept, all_scores = [], []
    for kv in range(hkv):
        agg = [sum(pooled[kv * g + x][j] for x in range(g)) / g for j in range(prefix)]
        top = sorted(range(prefix), key=lambda j: -agg[j])[: capacity - window]
        kept.append(sorted(top + list(range(prefix, n))))
        all_scores.append({j: agg[j] for j in range(prefix)})
    return kept, all_scores


@dataclass
class PerSampleLimitsTask(Task):
    """A toy task whose samples carry their own max_new_tokens (as LongBench's dataset2maxlen does)."""

    name: ClassVar[str] = "per_sample_limits"
    max_new_tokens: int = 50
    limits: list[int] = field(default_factory=lambda: [3, 9, 5])

    def samples(self, tokenizer: Any) -> list[Sample]:
        text = "The grass is green. The sky is blue. " * 20
        return [Sample(id=f"s{i}", prompt=text[: 300 + 40 * i], answers=["x"], max_new_tokens=limit)
                for i, limit in enumerate(self.limits)]

    def score(self, prediction: str, sample: Sample) -> float:
        return 0.0


@dataclass
class FlakyScorerTask(PerSampleLimitsTask):
    """PerSampleLimitsTask whose scorer raises for the ids in ``bad`` (a scorer bug or a malformed row)."""

    name: ClassVar[str] = "flaky_scorer"
    bad: list[str] = field(default_factory=lambda: ["s1"])

    def score(self, prediction: str, sample: Sample) -> float:
        if sample.id in self.bad:
            raise ValueError(f"cannot score {sample.id}")
        return 1.0


def run_job_in(results_dir, overrides: list[str]) -> tuple[dict, list[dict]]:
    """Compose the real configs with ``overrides``, run the job into ``results_dir``: its scores and records."""
    import json

    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.run import run_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"paths.results_dir={results_dir}",
                                                         "print_table=false"])
    scores = run_job(cfg)
    samples = next(results_dir.rglob("samples.jsonl")).read_text().splitlines()
    return scores, [json.loads(line) for line in samples]
