"""Golden fixtures from the official DynamicKV code (DreamMr/DynamicKV 8ab3c08), for tests/test_parity_dynamickv.py.

Runs in a side environment (torch 2.1.2, transformers 4.44.2, jsonlines), never in kvbench's: see
scripts/parity/README.md. The official attention forward ``llama_flash_attn2_forward_DynamicKV_V11``
(``kv_compression/token_drop/llama_model_impl/dynamickv_v11.py``, with ``methods/dynamic_v11.py``) is imported from a
checkout given on the command line and called unchanged, layer after layer, with its module-level buffers, its
``layer_idx % 4 == 3`` schedule and its write of every layer into a ``DynamicCache`` at the last layer:

* random cases: each layer's ``self`` is a stand-in whose q/k/v projections return the seeded post-RoPE tensors of
  ``tests/parity_inputs.py`` and whose ``position_embeddings`` are cos 1 / sin 0 (RoPE is the identity), so the code
  sees exactly those tensors; ``_flash_attention_forward`` (the FlashAttention-2 kernel, CUDA only) returns zeros: its
  output never reaches the cache;
* a SmolLM2-135M-Instruct prompt (``--smollm2 DIR``): the real model in transformers 4.44.2 (float32, CPU), every
  attention's forward replaced by the official one, FlashAttention-2 replaced by PyTorch's causal
  ``scaled_dot_product_attention`` (the layer output the next layers see; the cache decisions are the code's).

Recorded per layer: the cached positions per query head (each cached key row matched to the prompt's keys; the
code's window duplicates show as repeated positions) and the budgets of every re-allocation
(``update_and_reset_budget``'s returned lengths minus the window).

    python scripts/parity/dynamickv/generate.py --official /path/to/DynamicKV \\
        --smollm2 ~/.cache/kvbench/models/smollm2-135m-instruct --ids ids.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from parity_inputs import digest, layer_scale, stream, to_mask  # noqa: E402

# name, seed, layers, prompt n, Hq, Hkv, D, budget (max_capacity_prompt), pooling, radio_max, dtype
CASES = [
    ("l8_gqa_avg", 1, 8, 96, 4, 2, 16, 16, "avgpool", 10, "float32"),
    ("l8_mha_max", 2, 8, 120, 4, 4, 16, 24, "maxpool", 10, "float32"),
    ("l6_gqa_avg", 3, 6, 96, 4, 2, 16, 16, "avgpool", 10, "float32"),  # 6 layers: the last two never re-budgeted
    ("l10_gqa4_avg", 4, 10, 140, 8, 2, 16, 20, "avgpool", 10, "float32"),
    ("l12_gqa_max_r5", 5, 12, 160, 4, 2, 32, 24, "maxpool", 5, "float32"),  # the Qwen2 script's radio_max
    ("l8_gqa_r1.5", 6, 8, 96, 4, 2, 16, 16, "avgpool", 1.5, "float32"),  # bs < intermediate budgets: duplicates
    ("l7_mha_avg_r2", 7, 7, 110, 4, 4, 16, 20, "avgpool", 2, "float32"),
    ("l30_gqa_avg", 8, 30, 200, 9, 3, 16, 24, "avgpool", 10, "float32"),  # SmolLM2's layer and head counts
    ("l16_gqa_avg", 9, 16, 180, 8, 2, 16, 32, "avgpool", 10, "float32"),
    ("l9_gqa_max", 10, 9, 130, 6, 2, 16, 18, "maxpool", 10, "float32"),
    ("l8_gqa_avg_bf16", 11, 8, 96, 4, 2, 16, 16, "avgpool", 10, "bfloat16"),
    ("l6_gqa_max_bf16", 12, 6, 120, 4, 2, 32, 24, "maxpool", 10, "bfloat16"),
]
WINDOW, KERNEL = 8, 7


class Proj:
    """A projection returning the injected tensor; ``weight`` only tells the forward the model dtype."""

    def __init__(self, layer, which, dtype):
        self.layer, self.which, self.weight = layer, which, torch.empty(0, dtype=dtype)

    def __call__(self, hidden):
        return self.layer.out[self.which]


class Layer:
    """Stand-in for ``LlamaFlashAttention2``'s ``self``: what the official forward reads."""

    def __init__(self, idx, num_layers, hq, hkv, d, budget, pooling, radio_max, dtype):
        self.layer_idx, self.num_heads, self.num_key_value_heads, self.head_dim = idx, hq, hkv, d
        self.num_key_value_groups, self.hidden_size = hq // hkv, hq * d
        self.attention_dropout, self.training, self.kv_seq_len = 0.0, False, 0
        self.config = types.SimpleNamespace(window_size=WINDOW, max_capacity_prompt=budget, kernel_size=KERNEL,
                                            pooling=pooling, radio_max=radio_max, num_hidden_layers=num_layers)
        self.out = None
        self.dtype = dtype
        self.q_proj, self.k_proj, self.v_proj = (Proj(self, i, dtype) for i in range(3))
        self.o_proj = lambda h: h

    def _flash_attention_forward(self, q, k, v, mask, q_len, dropout=0.0):
        return torch.zeros_like(q)  # (B, q, H, D): never reaches the cache


def record_updates(cluster_cls, log):
    orig = cluster_cls.update_and_reset_budget

    def wrapped(self, k_cache, v_cache, indices, attn_cache):
        out = orig(self, k_cache, v_cache, indices, attn_cache)
        log.append({"after_layer": self.layer_idx, "budgets": [int(k.shape[-2]) - self.window_size for k in out[0]]})
        return out

    cluster_cls.update_and_reset_budget = wrapped


def kept_positions(cache_keys, prompt_keys, group, n):
    """Positions of the cached key rows per query head: ``cache_keys`` ``(Hq, len, D)``, ``prompt_keys``
    ``(Hkv, n, D)``; each row must equal exactly one prompt key of its KV head."""
    out = []
    for h in range(cache_keys.shape[0]):
        table = {prompt_keys[h // group, j].float().numpy().tobytes(): j for j in range(n)}
        assert len(table) == n, "duplicate key rows"
        out.append([table[row.float().numpy().tobytes()] for row in cache_keys[h]])
    return out


def run_random(mod, cluster_cls, case):
    name, seed, num_layers, n, hq, hkv, d, budget, pooling, radio_max, dtype_name = case
    from transformers.cache_utils import DynamicCache

    dtype = getattr(torch, dtype_name)
    streams = [stream(seed, li, n, 0, hq, hkv, d, layer_scale(li, num_layers)) for li in range(num_layers)]
    tensors = [tuple(torch.from_numpy(a).to(dtype).unsqueeze(0) for a in s) for s in streams]  # (1, n, H, D)
    log = []
    record_updates(cluster_cls, log)
    cache = DynamicCache()
    cos = torch.ones(1, n, d, dtype=dtype)
    sin = torch.zeros(1, n, d, dtype=dtype)
    for li, (q, k, v) in enumerate(tensors):
        layer = Layer(li, num_layers, hq, hkv, d, budget, pooling, radio_max, dtype)
        layer.out = (q.reshape(1, n, hq * d), k.reshape(1, n, hkv * d), v.reshape(1, n, hkv * d))
        with torch.no_grad():
            mod.llama_flash_attn2_forward_DynamicKV_V11(
                layer, torch.zeros(1, n, hq * d, dtype=dtype), attention_mask=None, position_ids=None,
                past_key_value=cache, cache_position=torch.arange(n), position_embeddings=(cos, sin))
    layers = []
    for li, (_, k, _) in enumerate(tensors):
        kept = kept_positions(cache.key_cache[li][0], k[0].transpose(0, 1), hq // hkv, n)
        layers.append({"len": len(kept[0]), "kept": [to_mask(p, n) for p in kept]})
    return {"name": name, "seed": seed, "layers": num_layers, "n": n, "hq": hq, "hkv": hkv, "d": d,
            "budget": budget, "pooling": pooling, "radio_max": radio_max, "dtype": dtype_name,
            "input_sha": digest(*[a for s in streams for a in s]), "updates": log, "cache": layers}


def run_smollm2(mod, cluster_cls, model_dir, ids, budget):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import DynamicCache

    config = LlamaConfig.from_pretrained(model_dir)
    # kvbench's copy is written by transformers 5 (rope_parameters); 4.44 reads rope_theta and would default to 1e4
    config.rope_theta = config.rope_parameters["rope_theta"]
    assert config.rope_parameters["rope_type"] == "default"
    model = LlamaForCausalLM.from_pretrained(model_dir, config=config, torch_dtype=torch.float32,
                                             attn_implementation="eager").eval()
    cfg = model.config
    cfg.window_size, cfg.max_capacity_prompt, cfg.kernel_size, cfg.pooling, cfg.radio_max = \
        WINDOW, budget, KERNEL, "avgpool", 10
    prompt_keys = {}

    def flash(self, q, k, v, mask, q_len, dropout=0.0):  # (B, q, H, D) layout in and out
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    orig_compute = cluster_cls.budget_compute_per_layer

    def compute(self, key_states, query_states, value_states, attention_mask):
        prompt_keys[self.layer_idx] = key_states[0].clone()  # post-RoPE, repeated to the query heads
        return orig_compute(self, key_states, query_states, value_states, attention_mask)

    cluster_cls.budget_compute_per_layer = compute
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.forward = types.MethodType(mod.llama_flash_attn2_forward_DynamicKV_V11, attn)
        attn._flash_attention_forward = types.MethodType(flash, attn)
        attn.kv_seq_len = 0
    log = []
    record_updates(cluster_cls, log)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    cluster_cls.budget_compute_per_layer = orig_compute
    layers = []
    n = len(ids)
    for li in range(cfg.num_hidden_layers):
        keys = prompt_keys[li]  # (Hq, n, D)
        kept = kept_positions(cache.key_cache[li][0], keys, 1, n)
        layers.append({"len": len(kept[0]), "kept": [to_mask(p, n) for p in kept]})
    return {"name": "smollm2_essays", "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "ids": ids, "n": n,
            "layers": cfg.num_hidden_layers, "budget": budget, "pooling": "avgpool", "radio_max": 10,
            "dtype": "float32", "updates": log, "cache": layers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", required=True, help="checkout of DreamMr/DynamicKV at 8ab3c08")
    parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct directory (config, safetensors, tokenizer)")
    parser.add_argument("--ids", help="JSON list of the SmolLM2 prompt's token ids (kvbench's tokenizer; the 4.44 "
                        "tokenizers cannot read SmolLM2's tokenizer.json): see scripts/parity/README.md")
    parser.add_argument("--out", default=str(ROOT / "tests/fixtures/parity/dynamickv.json"))
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, args.official)
    import transformers
    from kv_compression.token_drop.llama_model_impl import dynamickv_v11 as mod
    from kv_compression.token_drop.methods import dynamic_v11

    cluster_cls = dynamic_v11.DynamicKVClusterV11
    original_update = cluster_cls.update_and_reset_budget
    cases = []
    for case in CASES:
        if args.only and case[0] not in args.only:
            continue
        cluster_cls.update_and_reset_budget = original_update
        cases.append(run_random(mod, cluster_cls, case))
    smol = None
    if args.smollm2 and (not args.only or "smollm2_essays" in args.only):
        cluster_cls.update_and_reset_budget = original_update
        smol = run_smollm2(mod, cluster_cls, args.smollm2, json.loads(Path(args.ids).read_text()), 128)
    fixture = {
        "what": "golden fixtures from the official DynamicKV code; see scripts/parity/README.md",
        "official": {"repo": "DreamMr/DynamicKV", "commit": "8ab3c08",
                     "files": ["kv_compression/token_drop/llama_model_impl/dynamickv_v11.py",
                               "kv_compression/token_drop/methods/dynamic_v11.py"]},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "numpy": np.__version__},
        "window": WINDOW, "kernel": KERNEL, "cases": cases, "smollm2": smol,
    }
    Path(args.out).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {len(cases)} cases, {Path(args.out).stat().st_size} bytes")


if __name__ == "__main__":
    main()
