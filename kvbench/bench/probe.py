"""Peak memory of one prefill or one short generation, taken in a fresh process (``python -m kvbench.bench.probe``).

On a CPU the peak is the process's RSS high-water mark, and a process that already ran other cells keeps their
pages (glibc arenas, the allocator's caches): a later, smaller peak reuses them and reads too low. Measured on
SmolLM2 at 8k tokens, budget 128: SnapKV's prefill peak read 247 MB right after a FullKV cell in the same process and
719 MB in a fresh one (H2O 254 vs 715 MB). So on a CPU the bench takes every memory number (the ``memory`` metric and
each ``max_batch`` probe) in a child process that loads the model, runs the one measurement and prints JSON; on CUDA
``max_memory_allocated`` is exact in-process and no child is needed.

The request (stdin, JSON): ``model`` (a ``ModelSpec`` as a dict), ``method`` (a method config dict), ``budget``
(label), ``context_length``, ``batch_size``, ``what`` (``prefill`` or ``generate``), ``new_tokens``, ``seed``.
The answer (the last stdout line, JSON): ``peak_bytes``, ``resident_kv_bytes``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from kvbench.errors import KVBenchError


def request(spec, method_cfg: dict[str, Any], budget_label: str, context_length: int, batch_size: int,
            what: str = "prefill", new_tokens: int = 0, seed: int = 0) -> dict[str, Any]:
    return {"model": dataclasses.asdict(spec), "method": method_cfg, "budget": budget_label,
            "context_length": context_length, "batch_size": batch_size, "what": what, "new_tokens": new_tokens,
            "seed": seed}


def probe_in_subprocess(req: dict[str, Any]) -> dict[str, Any]:
    """Run ``req`` in a fresh interpreter; its stderr is passed through. Raises KVBenchError if the child fails."""
    env = {**os.environ, "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore")}
    out = subprocess.run([sys.executable, "-m", "kvbench.bench.probe"], input=json.dumps(req), capture_output=True,
                         text=True, env=env)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise KVBenchError(f"bench: the memory probe for {req['method'].get('name')}@{req['budget']}, "
                           f"{req['context_length']} tokens x {req['batch_size']} failed (exit {out.returncode}):\n"
                           f"{tail}")
    return json.loads(lines[-1])


def measure(req: dict[str, Any]) -> dict[str, Any]:
    """The measurement itself (in this process): what ``probe_in_subprocess`` runs in the child."""
    import torch

    from kvbench.bench.measure import PeakMemory, measure_cell, prompts_for
    from kvbench.budget import parse_budget
    from kvbench.engine import CompressionSession, greedy_generate
    from kvbench.methods import build_method
    from kvbench.models import load_model

    torch.manual_seed(req.get("seed", 0))
    budget = parse_budget(req["budget"], req["method"].get("name"))  # the label the parent parsed
    method = build_method(dict(req["method"]), budget)
    loaded = load_model(req["model"])
    if req["what"] == "prefill":
        r = measure_cell(loaded, method, budget, req["context_length"], req["batch_size"], ["memory"])
        return {"peak_bytes": r.prefill_peak_bytes, "resident_kv_bytes": r.resident_kv_bytes}
    if req["what"] != "generate":
        raise KVBenchError(f"bench probe: what={req['what']!r}; valid: prefill, generate")
    prompts = prompts_for(loaded.tokenizer, req["context_length"], req["batch_size"])
    with PeakMemory(loaded.model.device) as peak, \
            CompressionSession(loaded.model, method, budget, tokenizer=loaded.tokenizer) as session:
        greedy_generate(loaded.model, prompts, req["new_tokens"], [], loaded.tokenizer.pad_token_id)
    return {"peak_bytes": peak.bytes, "resident_kv_bytes": session.stats.resident_kv_bytes_after_prefill}


def main() -> None:
    from kvbench.config import register_resolvers

    register_resolvers()
    try:
        result = measure(json.loads(sys.stdin.read()))
    except KVBenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
