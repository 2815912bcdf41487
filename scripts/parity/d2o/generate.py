"""Golden fixtures from the official D2O code (AIoT-MLSys-Lab/D2O 12c99d8), for tests/test_parity_d2o.py.

Runs in a side environment with the code's pinned versions (torch 2.1.2, transformers 4.37.2, accelerate), never in
kvbench's: see scripts/parity/README.md. The official code is imported from a checkout given on the command line and
run unchanged: its patched model ``Llama3ForCausalLM_D2O`` (``LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py``
on ``modeling_llama3_new.py``) computes the layer allocation in its model forward and compresses in its attention
forward (``LlamaAttention3_D2O`` + ``D2O_LayerKVCache``), exactly as in its LongBench runs. Only the projections are
replaced: each layer's q/k/v projection returns the seeded post-RoPE queries/keys/values of ``tests/parity_inputs.py``
for the tokens of that forward, and every position id is 0, so the code's RoPE is the identity (cos 1, sin 0) and
its attention sees exactly those tensors. o_proj and the MLP output zeros (the residual stream is irrelevant: every
layer's q/k/v are injected). The code hard-codes 32 query heads of dimension 128 (``torch.full((32, 4), inf)``,
``.repeat(1, 1, 1, 128)``), so every case has Hq = 32, D = 128; GQA cases have 8 or 4 KV heads (``repeat_kv``).

What is recorded, per case, sample, decode step and layer: the kept original positions per query head (the code's
``keep_idx`` of every ``D2O_LayerKVCache`` call, read through a wrapper around ``torch.cat`` in the code's module
while the call runs; positions are tracked here), the threshold ``tau`` after the step, and checksums of the cached
keys/values (sum over the layer; per head at the last step). The second sample's kept sets are stored in full at
its first and last steps and as a sha256 prefix of the joined masks in between (a smaller file). Per sample: each
layer's density (``multimodal_entropy``)
and the ratios and (heavy, recent) sizes the model forward set. Two samples run through the same model, reset between
them as ``run_pred_long_bench_sample.py`` does (``_clean_cache`` and the layer ratios), so the second sample's taus
start from the first's (the code never resets ``threshold``).

    python scripts/parity/d2o/generate.py --official /path/to/D2O --out tests/fixtures/parity/d2o.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from parity_inputs import digest, layer_scale, stream, to_mask  # noqa: E402

HQ, D = 32, 128  # hard-coded in the official cache
CASES = [  # name, seed, kv heads, prompt length, layers, decode steps, hh_ratio, recent_ratio
    ("mha_n120", 1, 32, 120, 5, 8, 0.1, 0.1),
    ("mha_n200_r30", 2, 32, 200, 5, 6, 0.15, 0.15),
    ("mha_n90_6layers", 3, 32, 90, 6, 6, 0.1, 0.1),
    ("gqa8_n120", 4, 8, 120, 5, 8, 0.1, 0.1),
    ("gqa8_n160", 5, 8, 160, 5, 6, 0.1, 0.1),
    ("gqa4_n120", 6, 4, 120, 5, 8, 0.1, 0.1),
    ("gqa4_n150_hh3", 7, 4, 150, 5, 6, 0.15, 0.05),
    ("mha_n100_sink", 8, 32, 100, 5, 8, 0.1, 0.1),
    ("gqa8_n240_sink", 9, 8, 240, 5, 5, 0.1, 0.1),
    ("mha_n60_r40", 10, 32, 60, 5, 8, 0.2, 0.2),
    ("gqa8_n120_7layers", 11, 8, 120, 7, 5, 0.1, 0.1),
    ("gqa4_n80", 12, 4, 80, 5, 8, 0.1, 0.1),
]
SINK = {"mha_n100_sink": 3.0, "gqa8_n240_sink": 3.0}  # 6.0 saturates layer 0: F_0 = 0, see README


class Inject(nn.Module):
    """A projection that returns the tensor set for the current forward, ``(1, q, heads * D)``."""

    def __init__(self):
        super().__init__()
        self.out = None

    def forward(self, hidden):
        return self.out


class Zero(nn.Module):
    def forward(self, hidden, *args, **kwargs):
        return torch.zeros_like(hidden)


class Recorder:
    """``torch`` for the official module: ``cat`` results are recorded while a ``D2O_LayerKVCache`` call runs (its
    only ``torch.cat`` is ``keep_idx``); everything else is the real torch."""

    def __init__(self, real):
        self._real, self.active, self.cats, self.calls = real, False, [], {}

    def wrap(self, cache_cls):
        """Record each call's ``keep_idx`` (None: the cache fit, nothing evicted) by cache object."""
        orig = cache_cls.__call__

        def wrapped(cache, *args):
            self.active, self.cats = True, []
            try:
                result = orig(cache, *args)
            finally:
                self.active = False
            self.calls[id(cache)] = self.cats[0] if self.cats else None
            return result

        cache_cls.__call__ = wrapped

    def __getattr__(self, name):
        return getattr(self._real, name)

    def cat(self, *args, **kwargs):
        out = self._real.cat(*args, **kwargs)
        if self.active:
            self.cats.append(out.clone())
        return out


def build(d2o_mod, llama_cfg_cls, layers, hkv, hh, recent, alpha, belta):
    cfg = llama_cfg_cls(vocab_size=16, hidden_size=HQ * D, intermediate_size=8, num_hidden_layers=layers,
                        num_attention_heads=HQ, num_key_value_heads=hkv, max_position_embeddings=4096)
    cfg.hh_size, cfg.recent_size, cfg.hh_ratio, cfg.recent_ratio = 200, 200, hh, recent
    cfg.alpha, cfg.belta = alpha, belta
    reset = nn.Linear.reset_parameters
    nn.Linear.reset_parameters = lambda self: None  # 4096 x 4096 projections replaced below: no need to fill them
    try:
        model = d2o_mod.Llama3ForCausalLM_D2O(cfg).eval()
    finally:
        nn.Linear.reset_parameters = reset
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj = Inject(), Inject(), Inject(), Zero()
        layer.mlp = Zero()
    model.lm_head = Zero()
    return model


def run_case(d2o_mod, llama_cfg_cls, rec, case):
    name, seed, hkv, n, num_layers, steps, hh, recent = case
    alpha = belta = 0.5
    model = build(d2o_mod, llama_cfg_cls, num_layers, hkv, hh, recent, alpha, belta)
    attns = [layer.self_attn for layer in model.model.layers]
    out = {"name": name, "seed": seed, "hq": HQ, "hkv": hkv, "d": D, "n": n, "layers": num_layers, "steps": steps,
           "hh_ratio": hh, "recent_ratio": recent, "alpha": alpha, "belta": belta, "sink": SINK.get(name, 0.0),
           "samples": []}
    for sample in range(2):
        sample_seed = seed * 10 + sample
        streams = [stream(sample_seed, li, n, steps, HQ, hkv, D, layer_scale(li, num_layers), out["sink"])
                   for li in range(num_layers)]
        rec_sample = {"seed": sample_seed, "input_sha": digest(*[a for s in streams for a in s]), "steps": []}
        positions = [[list(range(n)) for _ in range(HQ)] for _ in range(num_layers)]
        calls = rec.calls
        pkv = None
        for step in range(steps + 1):  # step 0: the prompt; then one token per step
            lo, hi = (0, n) if step == 0 else (n + step - 1, n + step)
            for attn, (q, k, v) in zip(attns, streams):
                attn.q_proj.out = torch.from_numpy(q[lo:hi].reshape(1, hi - lo, HQ * D)).contiguous()
                attn.k_proj.out = torch.from_numpy(k[lo:hi].reshape(1, hi - lo, hkv * D)).contiguous()
                attn.v_proj.out = torch.from_numpy(v[lo:hi].reshape(1, hi - lo, hkv * D)).contiguous()
            calls.clear()
            with torch.no_grad():
                res = model(input_ids=torch.zeros(1, hi - lo, dtype=torch.long),
                            position_ids=torch.zeros(1, hi - lo, dtype=torch.long), past_key_values=pkv,
                            use_cache=True)
            pkv = res.past_key_values
            if step == 0:
                rec_sample["density"] = [float(a.multimodal_entropy) for a in attns]
                continue
            if step == 1:  # the model forward allocated at this step, from the prompt's densities
                rec_sample["ratios"] = [[float(a.layer_hh_ratio), float(a.layer_recent_ratio)] for a in attns]
            layers_rec = {}
            for li, attn in enumerate(attns):
                for h in range(HQ):
                    positions[li][h].append(n + step - 1)
                keep = calls.get(id(attn.kv_cache))
                if keep is not None:
                    for h in range(HQ):
                        idx = sorted(int(i) for i in keep[h])
                        positions[li][h] = [positions[li][h][i] for i in idx]
                kc, vc = pkv[li]
                assert kc.shape[2] == len(positions[li][0])
                entry = {"len": int(kc.shape[2]), "k_sum": float(kc.double().sum()), "v_sum": float(vc.double().sum())}
                if li not in (0, 1, num_layers - 1):
                    masks = [to_mask(p, n + steps) for p in positions[li]]
                    if sample == 0 or step in (1, steps):
                        entry["kept"] = masks
                    else:  # the second sample's middle steps as a digest (keeps the file small)
                        entry["kept_sha"] = hashlib.sha256(" ".join(masks).encode()).hexdigest()[:16]
                    entry["tau"] = None if attn.kv_cache.threshold is None else float(attn.kv_cache.threshold)
                    entry["sizes"] = [attn.kv_cache.hh_size, attn.kv_cache.recent_size]
                if step == steps:
                    entry["k_head_sums"] = kc.double().sum((0, 2, 3)).tolist()
                    entry["v_head_sums"] = vc.double().sum((0, 2, 3)).tolist()
                layers_rec[str(li)] = entry
            rec_sample["steps"].append(layers_rec)
        out["samples"].append(rec_sample)
        # between samples, as run_pred_long_bench_sample.py: the scores and ratios go, the threshold stays
        for attn in attns:
            attn._clean_cache()
            attn.layer_hh_ratio = attn.layer_recent_ratio = attn.multimodal_entropy = attn.prfill_size = 0
            attn.prfill_score = None
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", required=True, help="checkout of AIoT-MLSys-Lab/D2O at 12c99d8")
    parser.add_argument("--out", default=str(ROOT / "tests/fixtures/parity/d2o.json"))
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.official) / "LLM_merge_new"))
    import transformers
    from LMEval_kv_token_merge import modeling_llama3_7b_13b_d2o as d2o_mod

    torch.manual_seed(0)
    rec = Recorder(torch)
    d2o_mod.torch = rec  # the module's global name: only D2O_LayerKVCache's torch.cat calls are recorded
    rec.wrap(d2o_mod.D2O_LayerKVCache)
    cases = [c for c in CASES if not args.only or c[0] in args.only]
    fixture = {
        "what": "golden fixtures from the official D2O code; see scripts/parity/README.md",
        "official": {"repo": "AIoT-MLSys-Lab/D2O", "commit": "12c99d8",
                     "files": ["LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_7b_13b_d2o.py",
                               "LLM_merge_new/LMEval_kv_token_merge/modeling_llama3_new.py"]},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "numpy": np.__version__},
        "tolerance": {"density": 1e-5, "ratio": 1e-5, "tau": 1e-5, "checksum_rel": 1e-4},
        "cases": [run_case(d2o_mod, transformers.LlamaConfig, rec, c) for c in cases],
    }
    Path(args.out).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {len(fixture['cases'])} cases, {Path(args.out).stat().st_size} bytes")


if __name__ == "__main__":
    main()
