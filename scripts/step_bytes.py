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

(the first column: this script in a worktree of ea90ed1, ``PYTHONPATH=<worktree>``). FullKV's 283 MB are 4.1 times
its cache: the copies of its keys and values (out and back) in every layer. The bench's
peer on the same shapes (``--methods fullkv,transformers_static_compiled``: transformers 5.24's decode forward over
its 8,200-slot static cache, one graph): 3,646.7 MB, 33 + 19 kernels, 425 MB more than kvbench's FullKV step with
the same kernel count, its token choice outside the graph (transformers' SDPA path repeats each KV head's keys and
values for its query heads where a mask is given; kvbench's step passes the GQA group as the query axis).

``--methods`` takes kvbench's methods and ``transformers_static_compiled``, the bench's peer: transformers' ``generate``
with its static cache, which compiles its decode forward itself. Options: ``--layers`` / ``--prompt`` / ``--new`` /
``--budget``; ``--tiny`` for tiny-random's shapes (64 hidden, seconds) instead of llama3-8b-random's.
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
    from omegaconf import OmegaConf
    from torch._inductor import scheduler as sched

    from kvbench.budget import Budget
    from kvbench.config import CONF_DIR
    from kvbench.engine import CompressionSession, greedy_generate
    from kvbench.methods import build_method
    from kvbench.models.tiny import build_tiny_llama

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

    # the shapes of conf/model/llama3-8b-random.yaml (or tiny-random.yaml), built as the model loader builds them
    name = "tiny-random" if args.tiny else "llama3-8b-random"
    arch = {"vocab": 256, "tie_embeddings": 0, **OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml").tiny,
            "layers": args.layers}
    model = build_tiny_llama(arch, vocab_size=arch["vocab"], context_length=args.prompt + args.new, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
                             dtype=torch.bfloat16).eval().requires_grad_(False)
    prompt = torch.randint(3, arch["vocab"], (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"{args.layers} layers of {name}'s shapes, bf16, a {args.prompt}-token prompt, "
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
