"""Golden fixture from the official ThinK code (SalesforceAIResearch/ThinK d200577, ``ThinK_eager``), for
tests/test_parity_think_official.py.

Runs in a side environment with the code's pinned transformers (4.40.0, its requirements.txt; plus ``pygini``, which
its ``src/llama_model.py`` imports), never in kvbench's: see scripts/parity/README.md. The official code is imported
from a checkout given on the command line (``ThinK_eager/src``) and run unchanged, as ``run_longbench.py`` runs it:
``replace_llama("snapkv")`` patches ``LlamaModel.forward`` and ``LlamaAttention.forward`` (eager attention), the model
config carries the LongBench script's settings (``window_size`` 32, ``kernel_size`` 7, ``pooling`` maxpool,
``recent_size`` 32, ``ratio`` = the pruning ratio, ``max_capacity_prompt`` = the budget C), and the code's own
``DynamicCache`` (``src/cache_utils.py``) holds the result. The prompt's forward runs SnapKV's selection and
``key_pruner_query_driven`` (``SnapKVCluster.update_thinkv``) on K/V already repeated to the query heads
(``repeat_kv`` before ``update_thinkv``: one kept token set and one kept channel set per query head); then two decode
forwards append whole-width keys.

Only the projections are replaced: each layer's q/k/v projection returns the seeded post-RoPE queries/keys/values of
``tests/parity_inputs.py`` for the tokens of the forward, and the layer's ``rotary_emb`` returns cos 1 / sin 0. o_proj,
the MLP and the LM head output zeros.

Recorded per case and layer, after the prompt's forward: the kept positions per query head (the cached value rows
matched to the seeded values; the cached pruned key rows are checked to be those positions' keys at the kept
channels), the kept channels per query head (the code's ``mask``), the code's channel scores (the tensor its
``key_pruner_query_driven`` hands to ``torch.topk``, read through a wrapper around the module's ``torch``), and the
numbers of entries held pruned and with every channel at the end (``key_cache``: the last ``recent_size`` kept
entries and every generated one). The code cannot run in float64 (its window mask is a float32 ``torch.full`` of
float64's minimum), so there is no float64 screen; a case is kept only when the channel scores have a margin (the
lowest kept channel's score exceeds the highest pruned one's by more than ``MARGIN``, relative); otherwise the next
seed is used and the skipped seed listed.

    python scripts/parity/think/generate.py --official /path/to/ThinK --out tests/fixtures/parity/think_official.json
"""

from __future__ import annotations

import os
import sys
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

COMMIT = "d200577a7e52adf130772ca682ea958c2b442601"
LAYERS, STEPS, WINDOW, KERNEL, RECENT = 2, 2, 32, 7, 32
MARGIN = 1e-5
CASES = [  # name, seed, query heads, kv heads, head dim, prompt n, budget C, pruning ratio
    ("mha_n100_c64", 1, 4, 4, 32, 100, 64, 0.4),
    ("mha_n257_c128", 2, 4, 4, 32, 257, 128, 0.4),
    ("mha_n200_c48_d64", 3, 4, 4, 64, 200, 48, 0.5),
    ("gqa_n100_c64", 4, 8, 2, 32, 100, 64, 0.4),
    ("gqa_n257_c96", 5, 8, 2, 32, 257, 96, 0.4),
    ("gqa_n150_c64_d64", 6, 8, 4, 64, 150, 64, 0.3),
    ("mqa_n120_c40", 7, 4, 1, 16, 120, 40, 0.4),
    ("mha_n60_fits", 8, 4, 4, 32, 60, 128, 0.4),  # the prompt fits: channels pruned, no token evicted
    ("gqa_n80_fits", 9, 8, 2, 16, 80, 80, 0.5),  # n == C: the code's SnapKV branch keeps every token
]


class Recorder:
    """``torch`` for ``kv_pruning_utils``: records the inputs of its ``torch.topk`` calls (only
    ``key_pruner_query_driven`` calls ``torch.topk``; SnapKV's selection calls the tensor method)."""

    def __init__(self, real):
        self._real, self.topk_inputs = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def topk(self, x, *args, **kwargs):
        self.topk_inputs.append(x.detach().clone())
        return self._real.topk(x, *args, **kwargs)


def load_official(path: Path):
    eager = path / "ThinK_eager"
    sys.path.insert(0, str(eager))
    cwd = os.getcwd()
    os.chdir(eager)
    try:
        from src import cache_utils, kv_pruning_utils
        from src.monkeypatch import replace_llama
    finally:
        os.chdir(cwd)
    replace_llama("snapkv")
    return cache_utils, kv_pruning_utils


def run_case(official, case, dtype=torch.float32):
    cache_utils, kvp = official
    name, seed, hq, hkv, d, n, cap, ratio = case

    cfg = tiny_llama_config(hq, hkv, d, LAYERS)
    cfg.window_size, cfg.max_capacity_prompt, cfg.kernel_size, cfg.pooling = WINDOW, cap, KERNEL, "maxpool"
    cfg.ratio, cfg.recent_size = ratio, RECENT
    model = tiny_llama(cfg).to(dtype)
    streams = [stream(seed, li, n, STEPS, hq, hkv, d, layer_scale(li, LAYERS), 0.0) for li in range(LAYERS)]
    total, group = n + STEPS, hq // hkv
    value_rows = []
    for li, layer in enumerate(model.model.layers):
        q, k, v = (torch.from_numpy(a).to(dtype) for a in streams[li])
        attn = layer.self_attn
        attn.q_proj, attn.k_proj, attn.v_proj = (Inject(t.reshape(total, -1)) for t in (q, k, v))
        attn.o_proj, attn.rotary_emb = Zero(), IdentityRope(d)
        layer.mlp = Zero()
        value_rows.append({h: {v[t, h].numpy().tobytes(): t for t in range(total)} for h in range(hkv)})
    model.lm_head = Zero()
    rec = Recorder(torch)
    kvp.torch = rec
    layers = []
    with torch.no_grad():  # as run_longbench.py: generate with the prompt's attention mask
        out = model.generate(torch.zeros(1, n, dtype=torch.long), attention_mask=torch.ones(1, n, dtype=torch.long),
                             max_new_tokens=STEPS + 1, do_sample=False, pad_token_id=cfg.vocab_size - 1,
                             eos_token_id=None, return_dict_in_generate=True)
    cache = cache_utils.DynamicCache.from_legacy_cache(out.past_key_values)
    assert len(rec.topk_inputs) == LAYERS  # the prompt's forward pruned once per layer, the decode steps never
    for li in range(LAYERS):
        keys = torch.from_numpy(streams[li][1]).to(dtype)
        pruned, whole, mask, values = (cache.key_cache_pruned[li], cache.key_cache[li], cache.mask[li],
                                       cache.value_cache[li])
        held = [[value_rows[li][h // group][row.numpy().tobytes()] for row in values[0, h]] for h in range(hq)]
        assert all(p[-STEPS:] == list(range(n, total)) for p in held)  # the generated tokens, appended
        kept_pos = [p[:-STEPS] for p in held]
        channels = [torch.nonzero(mask[0, h]).flatten().tolist() for h in range(hq)]
        for h in range(hq):  # the cache holds those positions' keys: pruned ones first, the recent ones whole
            full = keys[held[h], h // group]
            m = pruned.shape[2]
            assert torch.equal(pruned[0, h], full[:m][:, channels[h]]) and torch.equal(whole[0, h], full[m:])
        scores = rec.topk_inputs[li][0]  # (Hq, D)
        margins = []
        for h in range(hq):
            kept_s, gone = scores[h, channels[h]], scores[h, [c for c in range(d) if c not in channels[h]]]
            margins.append(float((kept_s.min() - gone.max()) / kept_s.min().abs()))
        layers.append({"kept": [to_mask(p, total) for p in kept_pos], "channels": channels,
                       "channel_scores": [[float(f"{x:.9g}") for x in row] for row in scores.tolist()],
                       "pruned_entries": int(pruned.shape[2]), "whole_width_entries": int(whole.shape[2]),
                       "min_margin": min(margins)})
    return {"name": name, "seed": seed, "hq": hq, "hkv": hkv, "d": d, "n": n, "budget": cap, "ratio": ratio,
            "layers": LAYERS, "steps": STEPS, "input_sha": digest(*[a for s in streams for a in s]),
            "per_layer": layers}


def main():
    args = generator_args(__doc__, f"SalesforceAIResearch/ThinK at {COMMIT[:7]}",
                          ROOT / "tests/fixtures/parity/think_official.json")
    import transformers

    assert transformers.__version__ == "4.40.0", transformers.__version__
    official = load_official(Path(args.official).resolve())
    cases, skipped = run_with_margin(lambda case: run_case(official, case), CASES,
                                     lambda out: min(layer["min_margin"] for layer in out["per_layer"]) > MARGIN)
    for out in cases:
        for layer in out["per_layer"]:
            layer["min_margin"] = float(f"{layer['min_margin']:.3g}")
        print(out["name"], "margin", min(layer["min_margin"] for layer in out["per_layer"]))
    write_fixture(args.out, golden_fixture(
        "golden fixture from the official ThinK code (ThinK_eager); see scripts/parity/README.md",
        {"repo": "SalesforceAIResearch/ThinK", "commit": COMMIT, "date": "2025-02-11",
         "files": ["ThinK_eager/src/kv_pruning_utils.py", "ThinK_eager/src/llama_model.py",
                   "ThinK_eager/src/cache_utils.py", "ThinK_eager/src/monkeypatch.py"]},
        {"scores_rtol": 1e-5, "scores_atol": 1e-7, "margin": MARGIN}, skipped, cases,
        settings={"window_size": WINDOW, "kernel_size": KERNEL, "pooling": "maxpool", "recent_size": RECENT}))


if __name__ == "__main__":
    main()
