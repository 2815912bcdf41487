"""POD Stage 1: offline grouping of consecutive layers with similar attention (paper 004 §2.1, Algorithm 1).

    python -m kvbench.analysis.pod_grouping --model smollm2-135m --delta 0.5 --out results/pod/smollm2-135m.json

For every layer and KV head: the attention distributions of the last ``q`` query tokens of ``N`` sample texts (Paul
Graham essays), per query head. Similarity (methods.md A5.6 item 1): ``sim = 1 - JS`` (Jensen-Shannon divergence,
base 2, so in [0, 1]), averaged over samples, the ``q`` rows and, per KV head, the ``g`` query heads of its group
(A5.5). Greedy grouping: a layer joins the current block when it is similar (``sim >= delta``) to *every* layer of
it, otherwise it opens a new block.

The JSON: ``{"model", "delta", "granularity", "num_layers", "num_kv_heads", "blocks", ...}``. With ``granularity:
kv_head`` (default) ``blocks[h]`` is the list of blocks of KV head h; with ``granularity: layer`` (similarity also
averaged over KV heads) ``blocks`` is one list of blocks for all heads. A block is a list of layer indices.
``saving_asymptotic`` is the paper's ½ Σ_h Σ_B (|B| - 1) / (L H) (all K/V, distant fraction → 1);
``saving_realised_asymptotic`` counts only layers that are non-lowest for every KV head, the keys kvbench's
``(B, H, T, D)`` cache can really drop.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvbench.analysis.capture import capture_attention, capture_qk, sample_texts

LN2 = math.log(2.0)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """JS divergence in bits along the last dim (0 · log 0 = 0)."""
    m = 0.5 * (p + q)
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1)
    kl_qm = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(-1)
    return (0.5 * (kl_pm + kl_qm) / LN2).clamp(0.0, 1.0)


def js_matrix(attn: torch.Tensor) -> torch.Tensor:
    """Mean JS divergence between every pair of layers: attn ``(L, H, R, n)`` rows -> ``(H, L, L)``."""
    num_layers = attn.shape[0]
    out = torch.zeros(attn.shape[1], num_layers, num_layers, dtype=torch.float64)
    for a in range(num_layers):
        out[:, a] = js_divergence(attn[a : a + 1], attn).mean(-1).T.double()  # (L, H) -> (H, L)
    return out


def similarity(samples: list[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """``sim[h, a, b]`` per KV head from per-sample attention ``(L, Hq, q, n_i)``: 1 - mean JS over samples, rows and
    the query heads of each group."""
    js = torch.stack([js_matrix(s) for s in samples]).mean(0)  # (Hq, L, L)
    hq = js.shape[0]
    return 1.0 - js.view(num_kv_heads, hq // num_kv_heads, *js.shape[1:]).mean(1)


def greedy_blocks(sim: torch.Tensor, delta: float) -> list[list[int]]:
    """Algorithm 1 for one head: ``sim`` ``(L, L)`` -> consecutive blocks."""
    blocks = [[0]]
    for layer in range(1, sim.shape[0]):
        if all(float(sim[layer, other]) >= delta for other in blocks[-1]):
            blocks[-1].append(layer)
        else:
            blocks.append([layer])
    return blocks


def group(sim: torch.Tensor, delta: float, granularity: str = "kv_head"):
    """Blocks per KV head (``kv_head``) or one list for all heads (``layer``, sim averaged over heads)."""
    if granularity == "layer":
        return greedy_blocks(sim.mean(0), delta)
    return [greedy_blocks(sim[h], delta) for h in range(sim.shape[0])]


def savings(blocks, granularity: str, num_layers: int, num_kv_heads: int) -> tuple[float, float]:
    per_head = [blocks] * num_kv_heads if granularity == "layer" else blocks
    shared = sum(len(b) - 1 for head in per_head for b in head)
    lowest = [{min(b) for b in head} for head in per_head]
    trimmed = sum(all(layer not in low for low in lowest) for layer in range(num_layers))
    return 0.5 * shared / (num_layers * num_kv_heads), 0.5 * trimmed / num_layers


def gate_offsets(captures: list[dict[int, tuple[torch.Tensor, torch.Tensor]]], lowest: list[list[int]], n_s: int,
                 n_r: int, scaling: float) -> list[list[float]]:
    """Calibrated-gate offsets (methods.md A5.7 (b)): ``b[l][h] = E[lse_l(a^D_true) - lse_src(a^D)]`` over the
    distant sets D_i of the captured query rows, the ``g`` query heads of KV head h and the samples; 0 where layer l
    is the lowest of head h's block. Raises ValueError when no captured row has a distant token."""
    num_layers, num_kv_heads = len(lowest), len(lowest[0])
    offsets = [[0.0] * num_kv_heads for _ in range(num_layers)]
    for layer in range(num_layers):
        for h in range(num_kv_heads):
            src = lowest[layer][h]
            if src == layer:
                continue
            diffs = []
            for cap in captures:
                q_own, k_own = cap[layer]
                q_src, k_src = cap[src]
                hq, rows, _ = q_own.shape
                g = hq // k_own.shape[0]
                n = k_own.shape[1]
                pos = torch.arange(n - rows, n).view(-1, 1)
                j = torch.arange(n).view(1, -1)
                distant = (j >= n_s) & (j <= pos - n_r)
                has = distant.any(-1)
                if not bool(has.any()):
                    continue
                heads = slice(h * g, (h + 1) * g)
                own = (q_own[heads] @ k_own[h].T * scaling).masked_fill(~distant, float("-inf"))
                shared = (q_src[heads] @ k_src[h].T * scaling).masked_fill(~distant, float("-inf"))
                diff = torch.logsumexp(own, -1) - torch.logsumexp(shared, -1)  # (g, rows)
                diffs.append(diff[:, has].flatten())
            if not diffs:
                raise ValueError(f"no distant tokens: the calibration texts must be longer than n_s + n_r = "
                                 f"{n_s + n_r} tokens")
            offsets[layer][h] = round(float(torch.cat(diffs).double().mean()), 6)
    return offsets


def build_map(model, tokenizer, model_name: str, delta: float, samples: int = 4, tokens: int = 1024, q: int = 16,
              granularity: str = "kv_head") -> dict:
    cfg = model.config
    num_layers = cfg.num_hidden_layers
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    attn = [capture_attention(model, torch.tensor([ids]), q) for ids in sample_texts(tokenizer, samples, tokens)]
    sim = similarity(attn, num_kv_heads)
    blocks = group(sim, delta, granularity)
    saving, realised = savings(blocks, granularity, num_layers, num_kv_heads)
    return {
        "model": model_name, "delta": delta, "granularity": granularity, "num_layers": num_layers,
        "num_kv_heads": num_kv_heads, "blocks": blocks,
        "calibration": {"texts": "PaulGrahamEssays", "samples": samples, "tokens": tokens, "q": q},
        "saving_asymptotic": round(saving, 4), "saving_realised_asymptotic": round(realised, 4),
        "sim_adjacent": [[round(float(sim[h, i, i + 1]), 4) for i in range(num_layers - 1)]
                         for h in range(num_kv_heads)],
    }


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from kvbench.config import CONF_DIR
    from kvbench.models import load_model, spec_from_config

    parser = argparse.ArgumentParser(prog="python -m kvbench.analysis.pod_grouping", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a conf/model/<name>.yaml")
    parser.add_argument("--delta", type=float, default=0.5)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=4, help="N sample texts")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sample text")
    parser.add_argument("--q", type=int, default=16, help="last q query tokens per text (paper Fig 1(d): 16)")
    parser.add_argument("--granularity", choices=("kv_head", "layer"), default="kv_head")
    parser.add_argument("--calibrate", action="store_true",
                        help="also estimate the calibrated-gate offsets (method.gate=calibrated) for --n-s/--n-r")
    parser.add_argument("--n-s", type=int, default=16, help="sinks the gate offsets are calibrated for")
    parser.add_argument("--n-r", type=int, default=4080, help="recent window the gate offsets are calibrated for")
    args = parser.parse_args(argv)
    if not 0 <= args.delta <= 1:
        parser.error(f"--delta {args.delta} must be in [0, 1]")
    if args.calibrate and args.n_s + args.n_r >= args.tokens:
        parser.error(f"--calibrate: --n-s {args.n_s} + --n-r {args.n_r} must be below --tokens {args.tokens}, or no "
                     "calibration token is distant")
    spec = spec_from_config(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml")))
    loaded = load_model(spec)
    data = build_map(loaded.model, loaded.tokenizer, args.model, args.delta, args.samples, args.tokens, args.q,
                     args.granularity)
    if args.calibrate:
        from kvbench.methods.pod_map import lowest_layers

        per_head = [data["blocks"]] * data["num_kv_heads"] if args.granularity == "layer" else data["blocks"]
        by_head = [lowest_layers(b, data["num_layers"]) for b in per_head]
        lowest = [[by_head[h][layer] for h in range(data["num_kv_heads"])] for layer in range(data["num_layers"])]
        captures = [capture_qk(loaded.model, torch.tensor([ids]), args.q)
                    for ids in sample_texts(loaded.tokenizer, args.samples, args.tokens)]
        scaling = loaded.model.model.layers[0].self_attn.scaling
        data["gate_offsets"] = {"n_s": args.n_s, "n_r": args.n_r,
                                "offsets": gate_offsets(captures, lowest, args.n_s, args.n_r, scaling)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    if args.calibrate:
        from kvbench.methods.pod import POD

        POD(n_s=args.n_s, n_r=args.n_r, block_map=str(args.out), gate="calibrated")
    print(f"{args.out}: {args.granularity} blocks, saving (asymptotic) {data['saving_asymptotic']:.1%}, "
          f"realised by kvbench's cache {data['saving_realised_asymptotic']:.1%}")


if __name__ == "__main__":
    main()
