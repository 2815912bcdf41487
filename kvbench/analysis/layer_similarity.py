"""OmniKV's inter-layer attention similarity ("filter" ability of a layer), measured on any kvbench model.

    python -m kvbench.analysis.layer_similarity --model smollm2-135m --top-k 128 \
        --out results/analysis/omnikv_similarity_smollm2-135m.json

Hao et al., OmniKV (ICLR 2025), Sec. 3 and App. D.7: "a fixed subset of tokens that receive significant attention in
a specific layer maintains their prominence throughout successive layers. The value of similarity of a layer ... is
calculated as the mean of the summation of fixed tokens subset's attention scores in subsequent layers"; Figure 8
shows it for every pair of layers with the top-2048 set. Here, for each of the last ``q`` query positions of each
sample text (each plays a decode step):

* ``T_i`` = the ``top_k`` keys with the highest attention probability in layer ``i``, maximum over query heads (the
  paper's selection on softmax scores; the official code's ``last`` selector ranks raw logits, which gives the same
  order per head);
* ``sim[i][j]`` = attention mass that layer ``j`` puts on ``T_i``, mean over query heads, then over query positions
  and samples. ``sim[i][i]`` is the mass ``T_i`` captures in its own layer.

``filter_ability(sim, n)`` is the mean of ``sim[i][i+1 .. i+n]`` (Figure 1a / 6a's curves). Attention rows come from
``kvbench.analysis.capture.capture_attention`` (SDPA-exact probabilities of the last ``q`` queries); texts are the
Paul Graham essays of the needle task. The JSON is what ``python -m kvbench.report figures`` draws from
``<results>/analysis/*similarity*.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvbench.analysis.capture import capture_attention, sample_texts


def filter_similarity(attn: torch.Tensor, top_k: int) -> torch.Tensor:
    """``attn`` ``(L, Hq, q, n)`` attention probabilities of ``q`` query rows -> ``sim`` ``(L, L)`` (see module)."""
    num_layers, _, rows, n = attn.shape
    k = min(top_k, n)
    chosen = torch.topk(attn.amax(dim=1), k, dim=-1).indices  # (L, q, k): T_i per layer i and query row
    sim = torch.zeros(num_layers, num_layers, dtype=torch.float64)
    for i in range(num_layers):
        index = chosen[i].view(1, 1, rows, k).expand(num_layers, attn.shape[1], rows, k)
        mass = torch.gather(attn, -1, index).sum(-1)  # (L, Hq, q): layer j's mass on T_i
        sim[i] = mass.double().mean(dim=(1, 2))
    return sim


def measure(model, tokenizer, model_name: str, top_k: int = 128, samples: int = 4, tokens: int = 1024,
            q: int = 16) -> dict:
    total = None
    texts = sample_texts(tokenizer, samples, tokens)
    for ids in texts:
        attn = capture_attention(model, torch.tensor([ids]), q)
        sim = filter_similarity(attn, top_k)
        total = sim if total is None else total + sim
    sim = total / len(texts)
    return {
        "model": model_name, "top_k": top_k, "samples": samples, "tokens": tokens, "q": q,
        "texts": "PaulGrahamEssays",
        "selection": "top-k keys by attention probability, max over query heads, per query row",
        "similarity": [[round(float(x), 6) for x in row] for row in sim],
    }


def main(argv: list[str] | None = None) -> None:
    import argparse

    from omegaconf import OmegaConf

    from kvbench.config import CONF_DIR
    from kvbench.models import load_model, spec_from_config

    parser = argparse.ArgumentParser(prog="python -m kvbench.analysis.layer_similarity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a conf/model/<name>.yaml")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--top-k", type=int, default=128, help="size of a layer's selected set T_i")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--q", type=int, default=16, help="last q query positions per text")
    args = parser.parse_args(argv)
    for name in ("top_k", "samples", "tokens", "q"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.q > args.tokens:
        parser.error(f"--q {args.q} must not exceed --tokens {args.tokens}")
    spec = spec_from_config(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml")))
    loaded = load_model(spec)
    data = measure(loaded.model, loaded.tokenizer, args.model, args.top_k, args.samples, args.tokens, args.q)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    from kvbench.report.similarity import filter_ability

    best = filter_ability(data["similarity"], 4)
    ranked = sorted((v, i) for i, v in enumerate(best) if v is not None)[::-1][:3]
    print(f"{args.out}: {len(best)} layers; strongest filters (mean similarity to the next 4 layers): "
          + ", ".join(f"layer {i} {v:.3f}" for v, i in ranked))


if __name__ == "__main__":
    main()
