"""What inductor's scheduler says a captured decode step moves, on any device (the CPU included): its estimate of the
bytes each kernel reads and writes (``GraphLowering.count_bytes``, worst-case inputs, best-case fusion), summed, and
its kernels counted (``tests/test_step_traffic.py`` checks that no buffer copies one the step writes).

Decode on a GPU is bound by bytes: the floor is every weight plus the cache read once per step. The estimate counts
an embedding lookup and an indexed write as reading their whole table (their indices are unknown to it), so read the
difference between two commits or two methods on the same shapes, not the total against the floor. Measured with it
(2026-11-29, 2 layers of Llama-3-8B's shapes, bf16, an 8,192-token prompt, 8,448 slots; the cache is 69 MB):

    python scripts/step_bytes.py --layers 2 --prompt 8192 --methods fullkv,snapkv,h2o

    (MB and generated + extern kernels per step)  scatter_ writes       index_put_ writes, reorder off
    FullKV                                       3,504.5 MB, 47 + 19    3,221.7 MB, 33 + 19
    SnapKV at 128                                2,983.7 MB, 47 + 19    2,979.2 MB, 33 + 19
    H2O at 128                                   2,983.5 MB, 57 + 19    2,979.2 MB, 41 + 19

FullKV's 283 MB are 4.1 times its cache: the copies of its keys and values (out and back) in every layer. The bench's
peer on the same shapes (``--methods fullkv,transformers_static_compiled``: transformers 5.24's decode forward over
its 8,200-slot static cache, one graph): 3,646.7 MB, 33 + 19 kernels, 425 MB more than kvbench's FullKV step with
the same kernel count, its token choice outside the graph (transformers' SDPA path repeats each KV head's keys and
values for its query heads where a mask is given; kvbench's step passes the GQA group as the query axis).

``--methods`` takes kvbench's methods and ``transformers_static_compiled``, the bench's peer: transformers' ``generate``
with its static cache, which compiles its decode forward itself. Options: ``--layers`` / ``--prompt`` / ``--new`` /
``--budget``; ``--tiny`` for a toy model (64 hidden, seconds).
Needs about 3 GB of memory for two 8B-shaped layers with Llama-3's 128k vocabulary; takes 30-40 s per method on two
CPU cores (inductor's C++ compile included).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--budget", default="128", help="budget of every method but fullkv (default 128)")
    parser.add_argument("--methods", default="fullkv,snapkv,h2o")
    parser.add_argument("--tiny", action="store_true", help="a toy Llama (hidden 64) instead of Llama-3-8B's shapes")
    args = parser.parse_args(argv)

    import torch._inductor.graph as inductor_graph
    from torch._inductor import scheduler as sched
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.budget import Budget
    from kvbench.engine import CompressionSession, greedy_generate
    from kvbench.methods import build_method

    graphs: list[dict] = []
    original = inductor_graph.GraphLowering.count_bytes

    def count_bytes(self):
        total, counts, runtimes = original(self)
        kinds = {"extern": 0, "generated": 0}
        for node in self.scheduler.nodes:
            if not isinstance(node, sched.NopKernelSchedulerNode):
                kinds["extern" if isinstance(node, sched.ExternKernelSchedulerNode) else "generated"] += 1
        graphs.append({"bytes": total, **kinds})
        return total, counts, runtimes

    inductor_graph.GraphLowering.count_bytes = count_bytes
    torch._logging.set_logs(inductor_metrics=True)  # count_bytes runs where this log is on
    torch._inductor.config.fx_graph_cache = False  # a cached graph is loaded, not lowered: nothing would be counted
    torch._functorch.config.enable_autograd_cache = False
    logging.getLogger("torch._inductor.compile_fx").setLevel(logging.WARNING)

    torch.manual_seed(0)
    if args.tiny:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=65536)
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
                          rope_theta=500000.0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    prompt = torch.randint(3, cfg.vocab_size, (args.prompt,)).tolist()
    print(f"{args.layers} layers, {'toy' if args.tiny else 'Llama-3-8B'} shapes, bf16, a {args.prompt}-token prompt, "
          f"{args.new} new tokens; torch {torch.__version__}")
    for name in args.methods.split(","):
        graphs.clear()
        torch._dynamo.reset()
        start = time.perf_counter()
        with torch.inference_mode():
            if name in PEERS:  # transformers' own compiled decode forward over its static cache, as the bench's peer
                peer_generate(model, prompt, args.new)
            else:
                budget = Budget.parse("full" if name == "fullkv" else args.budget)
                with CompressionSession(model, build_method({"name": name}, budget), budget, compile=True):
                    greedy_generate(model, [prompt], args.new, [], 0)
        seconds = time.perf_counter() - start
        for g in graphs:
            print(f"{name}: {g['bytes'] / 1e6:,.1f} MB, {g['generated']} generated kernels + {g['extern']} extern "
                  f"({seconds:.0f} s)")
    return 0


PEERS = ("transformers_static_compiled",)


def peer_generate(model, prompt: list[int], new: int) -> None:
    """``generate`` with ``cache_implementation="static"``, which compiles the decode forward itself
    (``kvbench.bench.peer``: on a CPU too, with ``CompileConfig._compile_all_devices``)."""
    from kvbench.bench.peer import _compile_config

    ids = torch.tensor([prompt], device=model.device)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   pad_token_id=0, cache_implementation="static", compile_config=_compile_config(model.device, None))
    if getattr(model, "_compiled_call", None) is None:
        raise SystemExit("transformers' generate did not compile its decode forward")


if __name__ == "__main__":
    raise SystemExit(main())
