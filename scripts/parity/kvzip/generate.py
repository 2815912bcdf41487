"""Golden fixture from the official KVzip code (snu-mllab/KVzip 5d84729), for tests/test_parity_kvzip_official.py.

Runs in a side environment with the code's pinned transformers (4.51.3, its requirements.txt; torch 2.13.0 CPU),
never in kvbench's: see scripts/parity/README.md. The official code is imported from a checkout given on the command
line and run unchanged through its own pipeline: ``ModelKVzip.prefill`` (the system prompt of ``model/template.py``
followed by the context, one forward into the code's ``EvictCache``), ``ModelKVzip.scoring`` (``self_task``'s repeat
inputs, chunk by chunk, each through the model with ``update_cache=False``: ``KVScore._get_score`` scores the chunk,
then ``EvictCache.slice`` drops the repeat tokens) and ``EvictCache.prune(ratio)`` (``KVScore._threshold`` over all
layers and heads, then ``prepare_init`` flattens the kept entries per head), on a tiny ``LlamaForCausalLM`` whose
attention forward is the code's ``llama_qwen_attn_forward`` (``model.monkeypatch.replace_attn``).

What is stubbed, and only that: the code needs CUDA. ``flash_attn`` and ``tiny_api_cuda`` are stand-in modules whose
functions raise (imported by the code; neither runs before decoding); the prompt's attention kernel
``_flash_attention_forward`` returns zeros (its output never reaches the cache: every layer's q/k/v are injected);
``ModelKVzip`` is built without the hub (``__init__`` replaced: the tiny model, ``kv_type="evict"``, the official
``set_chat_template`` with the llama3.1 template) and its ``encode`` is the code's minus ``.cuda()``, over a byte-level
tokenizer (every byte one id). Decoding (FlashAttention's varlen kernel) is not run: KVzip compresses before it.

Only the projections are replaced: each layer's q/k/v projection returns, for the tokens of the forward it is called
in, the next rows of the seeded post-RoPE queries/keys/values of ``tests/parity_inputs.py`` (the prompt's rows, then
each repeat forward's), and the model's ``rotary_emb`` returns cos 1 / sin 0. o_proj, the MLP and the LM head output
zeros.

Recorded per case: the system prompt's length S, the chunks ``(start, end, repeat length)`` the code scored, the
repeat inputs' token ids outside the chunk (prompt and postfix) of the first two chunks, the code's scores per layer
and KV head (in full for the small cases; per-head sums for the long one), the kept context positions per layer and
KV head (``kv.valid``; the flattened cache is checked to hold the system prompt and exactly those keys). The ratio is
chosen so that the code keeps ``L*H*(C - S)`` context entries for a budget of C tokens per layer and head: its
``_threshold`` keeps the scores strictly above the ``int(N*ratio)``-th highest, ``int(N*ratio) - 1`` of them. A case
is kept only when the scores either side of the threshold differ by more than ``MARGIN`` (relative); otherwise the
next seed is used and the skipped seed listed. The code cannot run in float64 (its causal mask is a float32
``torch.full`` of the dtype's minimum).

    python scripts/parity/kvzip/generate.py --official /path/to/KVzip --out tests/fixtures/parity/kvzip_official.json
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "parity"))
from parity_inputs import digest, layer_scale, stream, to_mask  # noqa: E402
from stubs import (  # noqa: E402
    IdentityRope,
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

COMMIT = "5d8472975d286e3da6b52178af39d18904330c0d"
LAYERS, D = 2, 16
MARGIN = 1e-5
FULL_SCORES_UP_TO = 400  # contexts up to this many tokens store every score, longer ones per-head sums
CASES = [  # name, seed, query heads, kv heads, context m, budget C per layer and head (system prompt included)
    ("mha_m60_c240", 1, 2, 2, 60, 240),
    ("gqa_m150_c260", 2, 4, 2, 150, 260),
    ("gqa4_m120_c250", 3, 8, 2, 120, 250),  # no MQA: prepare_init squeezes a single KV head away
    ("gqa_m300_c300", 4, 8, 2, 300, 300),
    ("gqa_m2100_c900_two_chunks", 5, 4, 2, 2100, 900),  # self_task's chunk_size 2000: two chunks
]


def stub_modules():
    def unavailable(*args, **kwargs):
        raise RuntimeError("CUDA kernel stubbed (CPU): not called before decoding")

    for name in ("flash_attn", "tiny_api_cuda"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.flash_attn_func = module.flash_attn_varlen_func = module.update_flatten_view = unavailable
        sys.modules[name] = module


def zero_attention(query_states, key_states, value_states, *args, **kwargs):
    """``_flash_attention_forward``'s stand-in: the attention output, ``(B, q, Hq, D)``, never reaches the cache."""
    return torch.zeros_like(query_states)


def load_official(path: Path):
    import transformers.models.llama.modeling_llama  # noqa: F401  (before the stubs: transformers probes flash_attn)

    stub_modules()
    sys.path.insert(0, str(path))
    cwd = os.getcwd()
    os.chdir(path)
    try:
        from attention import attn
        from model import monkeypatch, wrapper
    finally:
        os.chdir(cwd)
    attn._flash_attention_forward = zero_attention
    monkeypatch.replace_attn("meta-llama/Llama-3.1-8B-Instruct")

    class OfficialKVzip(wrapper.ModelKVzip):
        """``ModelKVzip`` without the hub: the tiny model, the official template and methods."""

        def __init__(self, model):
            self.model, self.name = model, "llama3.1-8b"
            self.dtype, self.device, self.config = model.dtype, torch.device("cpu"), model.config
            self.kv_type = "evict"
            self.set_chat_template()

        def encode(self, text: str) -> torch.Tensor:  # the code's, over bytes and without .cuda()
            return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)

    return OfficialKVzip


def run_case(official_cls, case):
    name, seed, hq, hkv, m, cap = case

    model = tiny_llama(tiny_llama_config(hq, hkv, D, LAYERS, vocab=256, max_positions=16384))
    model.config._attn_implementation = "flash_attention_2"  # the code loads the model so; no 4D mask is built
    kvzip = official_cls(model)
    s = kvzip.sys_prompt_ids.shape[1]
    ctx_ids = torch.from_numpy(np.random.RandomState(seed).randint(32, 127, size=(1, m))).long()
    repeats = kvzip.self_task(ctx_ids)  # what scoring() will feed: (chunk ids, repeat ids) per chunk
    total_repeat = sum(r.shape[1] for _, r in repeats)
    n = s + m
    streams = [stream(seed, li, n, total_repeat, hq, hkv, D, layer_scale(li, LAYERS), 0.0) for li in range(LAYERS)]
    t = n + total_repeat
    key_rows = []
    for li, layer in enumerate(model.model.layers):
        q, k, v = (torch.from_numpy(a) for a in streams[li])
        attn = layer.self_attn
        attn.q_proj, attn.k_proj, attn.v_proj = (Inject(x.reshape(t, -1)) for x in (q, k, v))
        attn.o_proj = Zero()
        layer.mlp = Zero()
        key_rows.append({h: {k[i, h].numpy().tobytes(): i for i in range(n)} for h in range(hkv)})
    model.model.rotary_emb = IdentityRope(D)
    model.lm_head = ZeroHead(256)

    base = LAYERS * hkv * m
    keep = LAYERS * hkv * (cap - s)
    ratio = (keep + 1.5) / base  # int(base * ratio) = keep + 1: the code keeps the scores above that one
    assert int(base * ratio) == keep + 1
    with torch.inference_mode():
        kv = kvzip.prefill(ctx_ids)  # prefill and scoring (do_score=True), as the README's quick start
        scores = torch.stack([x.float() for x in kv.score])  # (L, 1, H, m)
        kv.prune(ratio=ratio)
    valid = kv.valid  # (L, 1, H, m)
    assert int(valid.sum()) == keep
    flat = scores.reshape(-1).sort(descending=True).values
    margin = float((flat[keep - 1] - flat[keep]) / flat[keep - 1])
    layers = []
    for li in range(LAYERS):
        lens = kv.info["len_k"][li].tolist()
        cu = kv.info["cu_len_k"][li].tolist()
        kept = []
        for h in range(hkv):
            rows = kv.key_cache[li][cu[h] : cu[h] + lens[h]]
            held = [key_rows[li][h][row.numpy().tobytes()] for row in rows]
            ctx = [s + int(i) for i in torch.nonzero(valid[li, 0, h]).flatten()]
            assert held == list(range(s)) + ctx, (name, li, h)  # the flattened cache: system prompt + kept context
            kept.append(to_mask(ctx, n))
        entry = {"kept": kept}
        if m <= FULL_SCORES_UP_TO:
            entry["scores"] = [[float(f"{x:.9g}") for x in row] for row in scores[li, 0].tolist()]
        else:
            entry["score_sums"] = scores[li, 0].double().sum(-1).tolist()
        layers.append(entry)
    chunks, start = [], s
    for chunk_ids, repeat_ids in repeats:
        end = start + chunk_ids.shape[1]
        chunks.append([start, end, int(repeat_ids.shape[1])])
        start = end
    repeat_prompts = [r[0, : r.shape[1] - c.shape[1]].tolist() for c, r in repeats[:2]]
    return {"name": name, "seed": seed, "hq": hq, "hkv": hkv, "d": D, "layers": LAYERS, "sys_len": s, "context": m,
            "budget": cap, "ratio": ratio, "kept_entries": keep, "chunks": chunks, "repeat_prompts": repeat_prompts,
            "postfix": kvzip.postfix_ids[0].tolist(), "input_sha": digest(*[a for st in streams for a in st]),
            "min_margin": margin, "per_layer": layers}


def main():
    args = generator_args(__doc__, f"snu-mllab/KVzip at {COMMIT[:7]}",
                          ROOT / "tests/fixtures/parity/kvzip_official.json")
    import transformers

    assert transformers.__version__ == "4.51.3", transformers.__version__
    official_cls = load_official(Path(args.official).resolve())
    cases, skipped = run_with_margin(lambda case: run_case(official_cls, case), CASES,
                                     lambda out: out["min_margin"] > MARGIN)
    for out in cases:
        out["min_margin"] = float(f"{out['min_margin']:.3g}")
        print(out["name"], "S", out["sys_len"], "chunks", out["chunks"], "margin", out["min_margin"])
    write_fixture(args.out, golden_fixture(
        "golden fixture from the official KVzip code; see scripts/parity/README.md",
        {"repo": "snu-mllab/KVzip", "commit": COMMIT, "date": "2026-02-11",
         "files": ["model/wrapper.py", "attention/score.py", "attention/kvcache.py", "attention/attn.py",
                   "model/template.py", "model/monkeypatch.py"]},
        {"scores_atol": 1e-6, "score_sums_rtol": 1e-5, "margin": MARGIN}, skipped, cases,
        stubbed="flash_attn and tiny_api_cuda (modules whose kernels raise; not called before decoding); "
                "_flash_attention_forward returns zeros (the output never reaches the cache); ModelKVzip.__init__ "
                "(no hub: the tiny model, kv_type evict, the llama3.1 template) and encode (bytes, no .cuda())"))


if __name__ == "__main__":
    main()
