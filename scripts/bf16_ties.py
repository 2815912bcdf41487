"""How often a random-weight model's greedy choices tie in bf16, and whether the captured decode's tokens are the
host-driven path's choices (``kvbench.bench.measure.forced_gaps``): the calibration behind gpu_targets' two token
targets (conf/bench/gpu_targets.yaml).

    python scripts/bf16_ties.py --layers 32 --prompt 256      # llama3-8b-random's shapes, ~16 GB, ~6 min on 2 cores
    python scripts/bf16_ties.py --layers 4 --prompt 512 --wrong snapkv streamingllm h2o

Prints the host-driven path's top-2 logit margin per step, where the captured path (dynamo's graph of the whole step,
run eagerly: ``compile="eager"``; on a GPU, inductor's kernels) parts from it, each captured token's gap below the
host-driven choice when fed to it, and, with ``--wrong``, the gaps of FullKV's tokens under other methods' caches (what
a wrong cache looks like). Measured 2026-11-29 on this project's CPU (torch 2.13, bf16): 32 layers, 256 tokens: margins
of exactly 0 at 3 of 32 steps, parted at step 20, gaps at most 0.062; 4 layers, 512 tokens: parted at step 18, gaps
at most 0.031, wrong caches (SnapKV, StreamingLLM, H2O at 128) 2-7 logits; 4 layers, 512 essay tokens (``--essay``,
the bench's prompts): exact ties at steps 20 and 27, the captured tokens the host-driven argmax at every step, wrong
caches 6.4-7.4 logits.
"""

from __future__ import annotations

import argparse

import torch

from kvbench.bench.measure import forced_gaps
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.methods import build_method
from kvbench.models.tiny import build_tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--method", default="fullkv")
    parser.add_argument("--budget", default="128")
    parser.add_argument("--wrong", nargs="*", default=[], help="methods whose cache FullKV's tokens are fed through")
    parser.add_argument("--essay", action="store_true", help="an essay's tokens (the bench's prompts), not random ids")
    args = parser.parse_args()

    arch = dict(layers=args.layers, heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, seed=0,
                vocab=128256, tie_embeddings=0)
    model = build_tiny_llama(arch, vocab_size=49152, context_length=8192, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0, attn_implementation="sdpa", device="cpu",
                             dtype=torch.bfloat16).eval().requires_grad_(False)
    if args.essay:
        from kvbench.bench.measure import essay_tokens
        from kvbench.models.loading import (
            DEFAULT_EMBEDDED,
            EMBEDDED_MODELS,
            converted_tokenizer,
            embedded_tokenizer_dir,
        )

        tokenizer = converted_tokenizer(embedded_tokenizer_dir(), EMBEDDED_MODELS[DEFAULT_EMBEDDED])
        prompt = essay_tokens(tokenizer, args.prompt)
    else:
        prompt = torch.randint(3, 49000, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    budget = Budget.parse(None if args.method == "fullkv" else args.budget)
    method = build_method({"name": args.method}, budget)
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o[0, -1].float().clone()))
    tokens = {}
    for compile in (False, "eager"):
        logits.clear()
        with torch.inference_mode(), CompressionSession(model, method, budget, compile=compile):
            tokens[compile] = greedy_generate(model, [prompt], args.new, [], 0).tokens[0]
        if compile is False:
            margins = [float(top[0] - top[1]) for top in (x.topk(2).values for x in logits)]
    hook.remove()
    host, captured = tokens[False], tokens["eager"]
    parted = next((i for i, (a, b) in enumerate(zip(host, captured)) if a != b), None)
    print("host-driven top-2 margins:", [round(m, 3) for m in margins])
    print("exact ties at steps:", [i for i, m in enumerate(margins) if m == 0])
    print("captured path parts from the host-driven one at step:", parted)
    gaps = forced_gaps(model, method, budget, [prompt], [captured])[0]
    print("captured tokens' gaps below the host-driven choice:", [round(float(g), 3) for g in gaps],
          "max", round(float(gaps.max()), 3))
    for name in args.wrong:
        other_budget = Budget.parse(args.budget)
        other = forced_gaps(model, build_method({"name": name}, other_budget), other_budget, [prompt], [host])[0]
        print(f"{args.method}'s tokens under {name}@{args.budget}'s cache: max gap {float(other.max()):.3f}")


if __name__ == "__main__":
    main()
