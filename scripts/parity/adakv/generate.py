"""Golden fixture from the official AdaKV code (FFY0/AdaKV efe4e2e), for tests/test_parity_adakv_official.py.

Runs in a side environment with the code's pinned transformers (4.44.2, its pyproject and freeze_requirements), never
in kvbench's: see scripts/parity/README.md. The official package ``adaptive_snapkv`` is imported from a checkout given
on the command line and run unchanged as ``experiments/LongBench/pred.py`` runs it: ``replace_llama_adaptive()``
patches ``LlamaModel.forward`` (``adaptive_LlamaModel_forward``: the flattened head-wise cache
``DynamicCacheSplitHeadFlatten``) and ``LlamaFlashAttention2.forward`` (``adaptive_llama_flash_attn2_forward``:
``AdaptiveSnapKVCluster.update_kv`` at prefill), and ``config_compress`` sets pred.py's settings (window 32, kernel 7,
max-pool, ``floor_alpha`` as given, 0.2 in pred.py; ``gqa_support`` with ``gqa_func="mean"`` for the GQA cases run the
way GQA_eval_longbench.sh runs them, without it K/V repeated to the query heads as its other runs).

What is stubbed, and only that: the code needs FlashAttention (CUDA). ``flash_attn`` is a stand-in module whose
functions raise (``snapkv_utils`` imports ``flash_attn_func`` and never calls it at prefill); the prompt's attention
kernel ``_flash_attention_forward`` (its output never reaches the cache) is PyTorch's causal SDPA; the layers are
``LlamaFlashAttention2`` by class assignment (transformers refuses to build them without flash_attn installed).
Decoding needs the code's CUDA kernel (``tiny_api_cuda.update_flatten_view``) and FlashAttention's varlen kernel, so
only the prompt's forward runs: AdaKV compresses at prefill only.

Only the projections are replaced: each layer's q/k/v projection returns the seeded post-RoPE queries/keys/values of
``tests/parity_inputs.py`` and the model's ``rotary_emb`` returns cos 1 / sin 0. o_proj, the MLP and the LM head
output zeros.

Recorded per case and layer: the kept positions of every head of the flattened cache (its rows matched to the seeded
keys; the segments are the code's ``head_lens``/``cu_klen``), the per-head budgets (``head_lens``), and, for the first
layer, the code's scores (``calcul_attn_sore``'s pooled window means, read by wrapping the method). A case is kept
only when its decisions have a margin: at the global top-k that counts each head's share and at each head's own cut,
the two scores either side are equal (an exact tie, which max-pooling makes by copying one value) or differ by more
than ``MARGIN`` (relative); otherwise the next seed is used and the skipped seed listed. The code cannot run in
float64 (its window mask is a float32 ``torch.full`` of float64's minimum).

    python scripts/parity/adakv/generate.py --official /path/to/AdaKV --out tests/fixtures/parity/adakv_official.json
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "parity"))
from parity_inputs import digest, layer_scale, stream, to_mask  # noqa: E402
from stubs import (  # noqa: E402
    IdentityRope,
    Inject,
    Zero,
    generator_args,
    golden_fixture,
    run_with_margin,
    tiny_llama,
    tiny_llama_config,
    write_fixture,
)

COMMIT = "efe4e2eea0099bf497f0c175ac5440a915d89f83"
LAYERS, WINDOW, KERNEL = 2, 32, 7
MARGIN = 1e-5
CASES = [  # name, seed, query heads, kv heads, head dim, prompt n, budget C (base_capacity), floor_alpha, gqa_support
    ("mha_n100_c48", 1, 4, 4, 16, 100, 48, 0.2, False),
    ("mha_n257_c64", 2, 4, 4, 16, 257, 64, 0.2, False),
    ("mha_n200_c96_a05", 3, 8, 8, 16, 200, 96, 0.5, False),
    ("mha_n300_c128", 4, 4, 4, 32, 300, 128, 0.2, False),
    ("gqa_rep_n150_c64", 5, 8, 2, 16, 150, 64, 0.2, False),  # K/V repeated to the query heads (no gqa_support)
    ("gqa_n150_c64", 6, 8, 2, 16, 150, 64, 0.2, True),  # gqa_support, gqa_func mean: one set per KV head
    ("gqa_n257_c80", 7, 8, 2, 32, 257, 80, 0.2, True),
    ("gqa_n200_c48_a05", 8, 8, 4, 16, 200, 48, 0.5, True),
    ("mqa_n120_c40", 9, 4, 1, 16, 120, 40, 0.2, True),
    ("mha_n60_fits", 10, 4, 4, 16, 60, 64, 0.2, False),  # the prompt fits: nothing evicted
    ("mha_n64_equal", 11, 4, 4, 16, 64, 64, 0.5, False),  # n == C: the code still allocates
]


def stub_flash_attn():
    """``flash_attn`` as a module whose kernels raise: imported by the code, never called at prefill."""
    def unavailable(*args, **kwargs):
        raise RuntimeError("FlashAttention is stubbed (CPU): only the prompt's forward runs")

    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # found, but no installed version
    module.flash_attn_func = module.flash_attn_varlen_func = unavailable
    sys.modules["flash_attn"] = module


def sdpa_attention(query_states, key_states, value_states, attention_mask, query_length, **kwargs):
    """``_flash_attention_forward``'s stand-in: causal SDPA over ``(B, q, H, D)`` tensors (the prompt's attention
    output, which never reaches the cache)."""
    out = torch.nn.functional.scaled_dot_product_attention(query_states.transpose(1, 2), key_states.transpose(1, 2),
                                                           value_states.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def load_official(path: Path):
    import transformers.models.llama.modeling_llama  # noqa: F401  (before the stub: transformers probes flash_attn)

    stub_flash_attn()
    sys.path.insert(0, str(path))
    from adaptive_snapkv.monkeypatch import adaptive_llama_hijack, monkeypatch, snapkv_utils

    adaptive_llama_hijack._flash_attention_forward = sdpa_attention
    monkeypatch.replace_llama_adaptive()
    return monkeypatch, snapkv_utils


def _margin(a: float, b: float) -> float:
    """Relative gap between two scores either side of a cut; an exact tie counts as no risk."""
    return float("inf") if a == b else abs(a - b) / max(abs(a), abs(b))


def run_case(official, case):
    monkeypatch, snapkv_utils = official
    name, seed, hq, hkv, d, n, cap, alpha, gqa = case
    from transformers.models.llama.modeling_llama import LlamaFlashAttention2

    cfg = tiny_llama_config(hq, hkv, d, LAYERS)
    model = tiny_llama(cfg)
    streams = [stream(seed, li, n, 0, hq, hkv, d, layer_scale(li, LAYERS), 0.0) for li in range(LAYERS)]
    key_rows = []
    for li, layer in enumerate(model.model.layers):
        q, k, v = (torch.from_numpy(a) for a in streams[li])
        attn = layer.self_attn
        attn.__class__ = LlamaFlashAttention2  # what attn_implementation="flash_attention_2" would have built
        attn._flash_attn_uses_top_left_mask = False
        attn.q_proj, attn.k_proj, attn.v_proj = (Inject(t.reshape(n, -1)) for t in (q, k, v))
        attn.o_proj = Zero()
        layer.mlp = Zero()
        key_rows.append({h: {k[t, h].numpy().tobytes(): t for t in range(n)} for h in range(hkv)})
    model.model.rotary_emb = IdentityRope(d)
    model.lm_head = Zero()
    monkeypatch.config_compress(model, window_size=WINDOW, base_capacity=cap, kernel_size=KERNEL, pooling="maxpool",
                                floor_alpha=alpha, gqa_support=gqa, gqa_func="mean")
    scores = {}
    cluster = snapkv_utils.AdaptiveSnapKVCluster
    real = cluster.calcul_attn_sore

    def recording(self, key_states, query_states):
        out = real(self, key_states, query_states)
        scores[self.layer_idx] = out[0].clone()
        return out

    cluster.calcul_attn_sore = recording
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros(1, n, dtype=torch.long), use_cache=True)
    finally:
        cluster.calcul_attn_sore = real
    heads = hkv if gqa else hq
    group = hq // hkv
    layers, margins = [], []
    for li, layer in enumerate(model.model.layers):
        kc = out.past_key_values[li][0]  # (sum of head lengths, D): the flattened cache
        lens = layer.self_attn.kv_cluster.head_lens.tolist()
        assert len(lens) == heads and sum(lens) == kc.shape[0]
        kept, start = [], 0
        for h, length in enumerate(lens):
            kv = h if gqa else h // group
            kept.append([key_rows[li][kv][row.numpy().tobytes()] for row in kc[start : start + length]])
            start += length
        s = scores[li]  # (heads, n - window)
        entry = {"budgets": lens, "kept": [to_mask(p, n) for p in kept]}
        if li == 0:  # the code's scores of the first layer (the second's only through its decisions: a smaller file)
            entry["scores"] = [[float(f"{x:.9g}") for x in row] for row in s.tolist()]
        base = cap - WINDOW
        if base <= s.shape[-1]:  # the code allocated: margins at the global count and at each head's cut
            flat = s.sort(dim=-1, descending=True).values.reshape(-1).sort(descending=True).values
            if heads * base < flat.shape[0]:
                margins.append(_margin(float(flat[heads * base - 1]), float(flat[heads * base])))
            for h in range(heads):
                row = s[h].sort(descending=True).values
                c = lens[h] - WINDOW
                if 0 < c < row.shape[0]:
                    margins.append(_margin(float(row[c - 1]), float(row[c])))
        layers.append(entry)
    return {"name": name, "seed": seed, "hq": hq, "hkv": hkv, "d": d, "n": n, "budget": cap, "floor_alpha": alpha,
            "gqa_support": gqa, "layers": LAYERS, "input_sha": digest(*[a for s in streams for a in s]),
            "min_margin": min(margins, default=float("inf")), "per_layer": layers}


def main():
    args = generator_args(__doc__, f"FFY0/AdaKV at {COMMIT[:7]}",
                          ROOT / "tests/fixtures/parity/adakv_official.json")
    import transformers

    assert transformers.__version__ == "4.44.2", transformers.__version__
    official = load_official(Path(args.official).resolve())
    cases, skipped = run_with_margin(lambda case: run_case(official, case), CASES,
                                     lambda out: out["min_margin"] > MARGIN)
    for out in cases:
        out["min_margin"] = None if out["min_margin"] == float("inf") else float(f"{out['min_margin']:.3g}")
        print(out["name"], "margin", out["min_margin"], "budgets", out["per_layer"][0]["budgets"])
    write_fixture(args.out, golden_fixture(
        "golden fixture from the official AdaKV code; see scripts/parity/README.md",
        {"repo": "FFY0/AdaKV", "commit": COMMIT, "date": "2025-09-25",
         "files": [f"adaptive_snapkv/monkeypatch/{name}.py"
                   for name in ("snapkv_utils", "adaptive_llama_hijack", "monkeypatch")]},
        {"scores_rtol": 1e-5, "scores_atol": 1e-7, "margin": MARGIN}, skipped, cases,
        settings={"window_size": WINDOW, "kernel_size": KERNEL, "pooling": "maxpool", "gqa_func": "mean"},
        stubbed="flash_attn (a module whose kernels raise; never called at prefill); _flash_attention_forward "
                "(the prompt's attention output) by causal SDPA"))


if __name__ == "__main__":
    main()
