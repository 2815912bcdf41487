"""Golden fixture from the official TOVA code (schwartz-lab-NLP/TOVA 9c7d09b), for tests/test_parity_tova_official.py.

Runs in a side environment with the code's pinned transformers (4.36.2, its README's pin), never in kvbench's: see
scripts/parity/README.md. The official package (``TOVACache``, ``enable_tova_caching``) is imported from a checkout
given on the command line, as its README uses it, and run unchanged: a tiny ``LlamaForCausalLM`` (eager attention)
is converted by ``enable_tova_caching`` (the official attention forward ``tova_llama_attention_forward``, which calls
``TOVACache.reduce`` after every attention, and the official ``prepare_inputs_for_generation``, which crops the
attention mask to the cache) and generated from with ``model.generate(input_ids, past_key_values=TOVACache(C))``.

Only the projections are replaced: each layer's q/k/v projection returns, for the tokens of the forward it is called
in, the seeded post-RoPE queries/keys/values of ``tests/parity_inputs.py`` (``stream``), and the layer's
``rotary_emb`` returns cos 1 / sin 0, so the official attention sees exactly those tensors. o_proj, the MLP and the
LM head output zeros (every layer's q/k/v are injected, so the residual stream does not matter; greedy decoding then
picks token 0 each step, which does not matter either).

What is recorded, per case and layer: the positions the cache holds after the prompt's forward and after each decode
forward (read back by matching the cached key rows to the seeded keys; the code gathers every KV head with one index,
the generator checks that), and the code's own scores (``attn_weights[:, :, -1, :]`` averaged over the query heads,
as passed to ``reduce``) of the prompt's reduction and of the last step's. A case is kept only when every reduction
has a margin: the lowest kept score exceeds the highest evicted one by more than ``MARGIN`` (relative), so float32
rounding in a different order cannot flip a decision; otherwise the next seed is used and the skipped seed listed.

    python scripts/parity/tova/generate.py --official /path/to/TOVA --out tests/fixtures/parity/tova_official.json
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "parity"))
from parity_inputs import digest, layer_scale, stream, to_mask  # noqa: E402
from stubs import (  # noqa: E402
    Inject,
    Zero,
    ZeroHead,
    generator_args,
    golden_fixture,
    run_with_margin,
    tiny_llama,
    tiny_llama_config,
    write_fixture,
)

COMMIT = "9c7d09bfff64cfc92cfb5f9d7e138cb04866e5a7"
LAYERS = 2
MARGIN = 1e-5
CASES = [  # name, seed, query heads, kv heads, head dim, prompt n, cache size C, decode steps, sink
    ("mha_n40_c10", 1, 4, 4, 16, 40, 10, 8, 0.0),
    ("mha_n100_c50", 2, 4, 4, 16, 100, 50, 8, 0.0),
    ("mha_n257_c64", 3, 4, 4, 16, 257, 64, 10, 0.0),
    ("gqa_n40_c20", 4, 8, 2, 32, 40, 20, 8, 0.0),
    ("gqa_n100_c25", 5, 8, 2, 32, 100, 25, 10, 0.0),
    ("gqa_n257_c128", 6, 8, 2, 32, 257, 128, 6, 0.0),
    ("mqa_n64_c16", 7, 4, 1, 16, 64, 16, 8, 0.0),
    ("gqa_n80_c20_sink", 8, 8, 2, 32, 80, 20, 8, 3.0),
    ("mha_n30_c33", 9, 4, 4, 16, 30, 33, 8, 0.0),  # the prompt fits: eviction starts at the 4th step
    ("gqa_n50_c4", 10, 8, 4, 16, 50, 4, 8, 0.0),
]


class IdentityRope(nn.Module):
    """``rotary_emb(x, seq_len)`` of transformers 4.36: cos 1 and sin 0 for every position."""

    def __init__(self, d):
        super().__init__()
        self.d = d

    def forward(self, x, seq_len=None):
        return torch.ones(seq_len, self.d, dtype=x.dtype), torch.zeros(seq_len, self.d, dtype=x.dtype)


def load_official(path: Path):
    """The checkout as the package ``TOVA`` (its README: ``from TOVA import TOVACache, enable_tova_caching``)."""
    spec = importlib.util.spec_from_file_location("TOVA", path / "__init__.py", submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["TOVA"] = module
    spec.loader.exec_module(module)
    return module


def positions_of(cache_keys: torch.Tensor, key_rows: dict) -> list[int]:
    """Original positions of the cached key rows ``(1, Hkv, m, D)``; every KV head must hold the same positions."""
    per_head = [[key_rows[h][row.numpy().tobytes()] for row in cache_keys[0, h]] for h in range(cache_keys.shape[1])]
    assert all(p == per_head[0] for p in per_head), "the code gathers every KV head with one index"
    return per_head[0]


def run_case(tova, case) -> dict | None:
    name, seed, hq, hkv, d, n, cap, steps, sink = case

    cfg = tiny_llama_config(hq, hkv, d, LAYERS)
    model = tiny_llama(cfg)
    streams = [stream(seed, li, n, steps, hq, hkv, d, layer_scale(li, LAYERS), sink) for li in range(LAYERS)]
    total = n + steps
    key_rows = []
    for li, layer in enumerate(model.model.layers):
        q, k, v = (torch.from_numpy(a) for a in streams[li])
        attn = layer.self_attn
        attn.q_proj, attn.k_proj, attn.v_proj = (Inject(t.reshape(total, -1)) for t in (q, k, v))
        attn.o_proj, attn.rotary_emb = Zero(), IdentityRope(d)
        layer.mlp = Zero()
        key_rows.append({h: {k[t, h].numpy().tobytes(): t for t in range(total)} for h in range(hkv)})
    model.lm_head = ZeroHead(cfg.vocab_size)
    tova.enable_tova_caching(model)

    cache = tova.TOVACache(cap)
    record = {li: {"kept": [], "scores": []} for li in range(LAYERS)}
    margins = []
    orig_reduce = type(cache).reduce

    def reduce(self, layer_idx, attn_weights, cache_kwargs=None):
        num_keys = attn_weights.shape[-1]
        before = positions_of(self.key_cache[layer_idx], key_rows[layer_idx])
        out = orig_reduce(self, layer_idx, attn_weights, cache_kwargs)
        after = positions_of(self.key_cache[layer_idx], key_rows[layer_idx])
        rec = record[layer_idx]
        rec["kept"].append(to_mask(after, total))
        scores = torch.mean(attn_weights[:, :, -1, :], dim=1)[0]  # the code's own mean_attn_weights
        rec["scores"].append([before, scores.tolist()])
        if num_keys > self.cache_size:
            kept = [before.index(p) for p in after]
            evicted = [i for i in range(num_keys) if i not in kept]
            low, high = float(scores[kept].min()), float(scores[evicted].max())
            margins.append((low - high) / max(abs(low), 1e-30))
        return out

    cache.reduce = reduce.__get__(cache)
    with torch.no_grad():
        model.generate(torch.zeros(1, n, dtype=torch.long), attention_mask=torch.ones(1, n, dtype=torch.long),
                       past_key_values=cache, max_new_tokens=steps + 1, do_sample=False,
                       pad_token_id=cfg.vocab_size - 1, eos_token_id=None)
    if min(margins) <= MARGIN:
        return None
    layers = []
    for li in range(LAYERS):
        rec = record[li]
        assert len(rec["kept"]) == steps + 1, len(rec["kept"])
        (p0, s0), (pl, sl) = rec["scores"][0], rec["scores"][-1]
        assert p0 == list(range(n))
        layers.append({"kept": rec["kept"], "prefill_scores": [float(f"{x:.9g}") for x in s0],
                       "last_scores": [float(f"{x:.9g}") for x in sl], "last_positions": pl})
    return {"name": name, "seed": seed, "hq": hq, "hkv": hkv, "d": d, "n": n, "cache_size": cap, "steps": steps,
            "layers": LAYERS, "sink": sink, "input_sha": digest(*[a for s in streams for a in s]),
            "min_margin": float(f"{min(margins):.3g}"), "per_layer": layers}


def main():
    args = generator_args(__doc__, f"schwartz-lab-NLP/TOVA at {COMMIT[:7]}",
                          ROOT / "tests/fixtures/parity/tova_official.json")
    import transformers

    assert transformers.__version__ == "4.36.2", transformers.__version__
    tova = load_official(Path(args.official))
    cases, skipped = run_with_margin(lambda case: run_case(tova, case), CASES, lambda out: out is not None)
    for out in cases:
        print(out["name"], "margin", out["min_margin"])
    write_fixture(args.out, golden_fixture(
        "golden fixture from the official TOVA code; see scripts/parity/README.md",
        {"repo": "schwartz-lab-NLP/TOVA", "commit": COMMIT, "date": "2024-10-13",
         "files": ["src/tova_cache.py", "src/convert_models/convert.py", "src/convert_models/llama_custom.py"]},
        {"scores_atol": 1e-6, "scores_rtol": 1e-5, "margin": MARGIN}, skipped, cases))


if __name__ == "__main__":
    main()
