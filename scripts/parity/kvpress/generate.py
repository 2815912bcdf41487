"""Write tests/fixtures/parity/kvpress_<press>.json: kvpress 0.5.5's scores and kept sets on seeded inputs.

Run in the side environment that has kvpress (scripts/parity/README.md, section kvpress):

    /work/venv-kvpress/bin/python scripts/parity/kvpress/generate.py

Each press's own ``score`` and ``compress`` run unchanged on a tiny random Llama attention module whose ``q_proj`` is
the identity (the hidden states are the case's pre-RoPE queries), with the model's default rotary embedding attached
as the kvpress pipeline attaches it. Kept sets are read back from what ``compress`` returns (key rows matched to the
input rows) or, for AdaKVPress, from the indices it masks. A case is kept only when the press run in float64 keeps
what it keeps in float32 (no near-tie at the selection boundary); otherwise the next seed is used and the skipped
seed recorded. kvpress code is imported, never copied.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("kvpress_cases", Path(__file__).with_name("cases.py"))
CASES = importlib.util.module_from_spec(spec)
spec.loader.exec_module(CASES)


def module_for(case: dict, dtype: torch.dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    hq, hkv, d = case["hq"], case["hkv"], case["d"]
    config = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                         rope_parameters={"rope_type": "default", "rope_theta": CASES.ROPE_THETA})
    config._attn_implementation = "sdpa"  # AdaKVPress refuses eager
    module = LlamaAttention(config, layer_idx=0).to(dtype)
    with torch.no_grad():
        module.q_proj.weight.copy_(torch.eye(hq * d, dtype=dtype))
    module.rotary_emb = LlamaRotaryEmbedding(config)
    return module


def build_press(name: str, ratio: float):
    from kvpress import (
        AdaKVPress,
        BlockPress,
        ChunkKVPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        TOVAPress,
    )

    simple = {"knorm": KnormPress, "keydiff": KeyDiffPress, "tova": TOVAPress,
              "expected_attention": ExpectedAttentionPress}
    if name in simple:
        return simple[name](compression_ratio=ratio)
    if name.startswith("keydiff_block"):
        block = int(name.removeprefix("keydiff_block"))
        return BlockPress(press=KeyDiffPress(compression_ratio=ratio), block_size=block)
    wrapper, _, inner = name.partition("_")
    if wrapper == "adakv":
        return AdaKVPress(press=simple[inner](compression_ratio=ratio))
    return ChunkKVPress(press=simple[inner](compression_ratio=ratio), chunk_length=20)


def run(name: str, case: dict, dtype: torch.dtype) -> tuple[list[list[float]] | None, list[list[int]]]:
    """(scores per KV head or None, kept positions per KV head) of one press on one case (batch 1)."""
    arrays = CASES.inputs(case)
    n = case["n"]
    module = module_for(case, dtype)
    hidden = torch.from_numpy(arrays["queries"]).to(dtype).reshape(1, n, -1)
    keys = torch.from_numpy(arrays["keys"]).to(dtype).transpose(0, 1)[None]  # (1, Hkv, n, D)
    values = torch.from_numpy(arrays["values"]).to(dtype).transpose(0, 1)[None]
    cos, sin = module.rotary_emb(hidden, torch.arange(n)[None])
    kwargs = {"position_embeddings": (cos.to(dtype), sin.to(dtype))}
    press = build_press(name, case["ratio"])
    scores = None
    scorer = getattr(press, "press", press)
    if not name.startswith("keydiff_block"):
        raw = scorer.score(module, hidden, keys, values, None, kwargs)[0].double().tolist()
        scores = [[float(f"{x:.9g}") for x in row] for row in raw]  # 9 digits: a float32 round-trips
    with torch.no_grad():
        out_keys, _ = press.compress(module, hidden, keys, values, None, kwargs)
    if name.startswith("adakv"):
        _, heads, seq = module.masked_key_indices
        kept = [sorted(set(range(n)) - {int(s) for h2, s in zip(heads, seq) if int(h2) == h}) for h in
                range(case["hkv"])]
        return scores, kept
    kept = []
    for h in range(case["hkv"]):  # match each returned key row to its input row
        dist = torch.cdist(out_keys[0, h].double(), keys[0, h].double(), compute_mode="donot_use_mm_for_euclid_dist")
        rows = dist.argmin(-1)
        assert bool((dist.min(-1).values == 0).all()), "a returned key row is not an input row"
        kept.append(sorted(int(r) for r in rows))
    return scores, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "parity")
    args = parser.parse_args(argv)
    import kvpress
    import transformers

    version = getattr(kvpress, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("kvpress")
    if version != "0.5.5":
        sys.exit(f"kvpress {version}: the fixtures pin kvpress 0.5.5")
    for name in CASES.PRESSES:
        entries, skipped = [], []
        for case in CASES.cases():
            case = dict(case)
            while True:
                scores, kept = run(name, case, torch.float32)
                _, kept64 = run(name, case, torch.float64)
                if kept == kept64:
                    break
                skipped.append(case["seed"])
                case["seed"] += 1000
            entries.append({**case, "n_kept": CASES.n_kept(case["n"], case["ratio"]),
                            "inputs_sha256": CASES.digest(CASES.inputs(case)), "scores": scores, "kept": kept})
        fixture = {"kvpress": version, "transformers": transformers.__version__, "torch": torch.__version__,
                   "press": name, "skipped_seeds": skipped, "cases": entries}
        path = args.out / f"kvpress_{name}.json"
        path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
        print(f"{path.relative_to(ROOT)}: {len(entries)} cases, skipped seeds {skipped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
