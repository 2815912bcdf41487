"""Seeded inputs of the TriAttention parity cases, shared by the generator (the authors' code, side env) and
tests/test_parity_triattention_official.py (kvbench): torch only, so both environments (torch 2.13.0) draw the same
tensors."""

from __future__ import annotations

import torch

THETA = 10000.0

#: name -> the model's shape, the schedule and the method's fields (the authors' argument names)
CASES = {
    "mha_slack": dict(layers=2, heads=4, kv_heads=4, head_dim=16, prompt=20, steps=80, budget=48, divide_length=16,
                      seed=1),
    "gqa_slack_max": dict(layers=3, heads=8, kv_heads=2, head_dim=32, prompt=30, steps=140, budget=64,
                          divide_length=32, score_aggregation="max", seed=2),
    "gqa_interval": dict(layers=2, heads=6, kv_heads=2, head_dim=16, prompt=25, steps=60, budget=40,
                         divide_length=16, use_slack_trigger=False, pruning_seed=7, seed=3),
    "gqa_decode_only_count": dict(layers=2, heads=4, kv_heads=2, head_dim=16, prompt=30, steps=140, budget=32,
                                  divide_length=16, count_prompt_tokens=False, normalize_scores=False, seed=4),
    "prompt_fills_budget": dict(layers=2, heads=4, kv_heads=2, head_dim=16, prompt=40, steps=40, budget=32,
                                divide_length=16, seed=5),
    # raw keys drawn from 3 vectors and the position-free score alone (disable_trig): scores tie to float error, the
    # tie-break noise decides, so the entries' stored order (which noise value meets which entry) is pinned
    "tied_scores_noise": dict(layers=2, heads=4, kv_heads=2, head_dim=16, prompt=12, steps=100, budget=32,
                              divide_length=16, disable_trig=True, pool=3, seed=7),
    "mqa_default_interval": dict(layers=2, heads=4, kv_heads=1, head_dim=16, prompt=16, steps=310, budget=64,
                                 divide_length=128, seed=6),
}

#: the method's fields a case may set, with the authors' experiment defaults (scripts/cli.py:303-313)
FIELDS = dict(divide_length=128, use_slack_trigger=True, count_prompt_tokens=True, allow_prefill_compression=False,
              normalize_scores=True, score_aggregation="mean", offset_max_length=65536, pruning_seed=0,
              disable_trig=False)


def fields(case: dict) -> dict:
    return {k: case.get(k, v) for k, v in FIELDS.items()}


def inv_freq(head_dim: int) -> torch.Tensor:
    """transformers' default RoPE inverse frequencies (``_compute_default_rope_parameters``)."""
    return 1.0 / (THETA ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rotate(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE of ``keys`` ``(..., n, D)`` at ``positions`` ``(n,)`` (``apply_rotary_pos_emb``)."""
    freqs = positions.float()[:, None] * inv_freq(keys.shape[-1])[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    d = keys.shape[-1] // 2
    rotated = torch.cat((-keys[..., d:], keys[..., :d]), dim=-1)
    return keys * emb.cos() + rotated * emb.sin()


def case_keys(case: dict) -> list[torch.Tensor]:
    """Per layer the post-RoPE keys of every position ``(Hkv, prompt + steps, D)``, float32."""
    g = torch.Generator().manual_seed(case["seed"])
    total = case["prompt"] + case["steps"]
    raw = [torch.randn(case["kv_heads"], total, case["head_dim"], generator=g) for _ in range(case["layers"])]
    if case.get("pool"):  # every key one of ``pool`` vectors per (layer, head)
        pick = [torch.randint(case["pool"], (total,), generator=g) for _ in raw]
        raw = [k[:, : case["pool"]][:, p] for k, p in zip(raw, pick)]
    return [rotate(k, torch.arange(total)) for k in raw]


def case_stats(case: dict) -> dict:
    """The statistics payload in the authors' format (``pruning_utils.save_head_frequency_stats``): every (layer,
    head), layer-major (as ``scripts/calibrate.py`` writes them)."""
    g = torch.Generator().manual_seed(1000 + case["seed"])
    f = case["head_dim"] // 2
    heads = [(layer, head) for layer in range(case["layers"]) for head in range(case["heads"])]
    stats = {}
    for layer, head in heads:
        real, imag = torch.randn(f, generator=g), torch.randn(f, generator=g)
        abs_mean = torch.complex(real, imag).abs() + torch.rand(f, generator=g)
        stats[f"layer{layer:02d}_head{head:02d}"] = {"q_mean_real": real, "q_mean_imag": imag, "q_abs_mean": abs_mean}
    metadata = {"num_traces": 1, "head_dim": case["head_dim"], "dtype": "float32", "rope_style": "half",
                "rope_type": "default", "sampled_heads": [[layer, head] for layer, head in heads]}
    return {"metadata": metadata, "stats": stats}
