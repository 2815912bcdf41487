"""Check kvbench's CUDA path: every method on the GPU against the same method on the CPU, then bf16 and flash SDPA.

    python scripts/gpu_check.py [--model smollm2-135m-random] [--length 1024] [--budget 128] [--out FILE]
    python scripts/gpu_check.py --device cpu --model tiny-random --length 256     # a dry run on the CPU (tests)

1. float32, same weights on both devices (built on the CPU, copied to the GPU): per method, the prefill's last
   logits (max abs difference), the token positions each layer and head keeps after the prefill (overlap of the
   GPU's kept set with the CPU's) and 8 greedy tokens (agreement). Scores computed in a different order on the two
   devices can swap near-ties, so the bounds are an overlap of at least 0.98 and a logit difference below 1e-3.
   On CUDA the session takes the constant-kernel prefill forms (``few_kernels``: fused column sums, CaM's blocked
   Λ attention, KVMerger's device sets) and the CPU its chunked ones, so this also checks those forms on the GPU.
2. bfloat16 on the GPU, a left-padded batch of two prompts: every method generates 16 tokens with torch's SDPA
   restricted to its FlashAttention-2 kernel (``sdpa_kernel(FLASH_ATTENTION)``); a method whose attention calls
   cannot use that kernel (an explicit mask, float32 scores) is run again with every SDPA kernel and marked so.
   Each row's tokens are then fed to the method on that row alone (``kvbench.bench.measure.forced_gaps``): every
   token must be that path's choice within ``MAX_BF16_GAP`` logits (``gap_vs_alone``; the tokens themselves are not
   compared: a random model's bf16 logits tie often, and a padded row's kernels round otherwise).
   Batch-1-only methods are refused with their own error, which is recorded, not counted as a failure.

Every registered method runs (``kvbench.methods`` catalog), with the model's tokenizer in the session (KVzip feeds the
model a repeat prompt); CLA runs its untrained proxy (``allow_untrained``: its kernels, not its quality); methods that
cannot run here refuse with their own error (recorded, not counted). Kept entries are read through each layer's
``position_view()``, so ragged layers (AdaKV's and KVzip's default layout: entries flat per head) count what they
hold; a compressing method that keeps no entry fails. Methods whose prefill is sequential (``SEQUENTIAL_PREFILL``:
RoCo's EasyKV encoding loop attends one token per step) run on the first ``--sequential-length`` tokens of the prompt
(default 192: 64 eviction steps past budget 128), stated per method in the report (``length``).

Budget: 3 minutes on one H100 (not yet timed on one since these changes; the 2026-11-27 H200 run did not finish in
100 s, RoCo taking 54 s of it). ``--deadline`` seconds for the methods (150 on CUDA by default) enforce it: a method
not started before the deadline is recorded as ``skipped (deadline)`` and fails the check, never passes silently. The
report is rewritten after every method (a run killed by an outer ``timeout`` still leaves what it measured), with
each method's seconds per phase. Writes a JSON report (default ``results/bench/gpu_check/<model>.json``) and exits 1
if any check fails. ``--device cuda`` (default) refuses to run without a CUDA device.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvbench.bench.measure import essay_tokens, forced_gaps  # noqa: E402
from kvbench.bench.run import method_config  # noqa: E402
from kvbench.budget import Budget, parse_budget  # noqa: E402
from kvbench.engine import CompressionSession, KVCache, cache_kwargs, greedy_generate  # noqa: E402
from kvbench.errors import KVBenchError  # noqa: E402
from kvbench.methods import METHODS, build_method  # noqa: E402
from kvbench.models import load_model, spec_from_config  # noqa: E402

MIN_OVERLAP, MAX_LOGIT_DIFF = 0.98, 1e-3
# bf16, a padded batch's tokens fed to each row alone (``forced_gaps``): the most a token may be below the row-alone
# path's choice, in logits. Calibrated on a CPU (2026-11-29, smollm2-135m-random in bf16, 1,024 and 512 tokens): the
# padded batch's tokens are the row-alone argmax exactly (gap 0.0: FullKV, SnapKV, H2O, AdaKV, D2O); a wrong cache
# (the rows' tokens swapped, another method's cache, FullKV's) puts them 0.04-0.58 below on this random model, whose
# greedy output repeats a token or two, so this bound catches gross faults only here (on llama3-8b-random's shapes a
# wrong cache is 6-7 logits below: scripts/bf16_ties.py). A GPU's kernels round otherwise: a few bf16 steps (0.03 each
# near these logits) stay far inside it
MAX_BF16_GAP = 0.5
# Methods that draw random numbers from the device's own generator: the same seed would give different draws on a CPU
# and a GPU, so their logits would be reported, not judged, across devices. None: CaM draws its prefill merges from a
# CPU generator and its decode merges from a hash of the token's position, the same on every device.
DEVICE_RNG: set[str] = set()
# Methods whose prefill attends the prompt sequentially (one token or a few per step, per layer): checked on a shorter
# prompt, so that the check fits its budget (RoCo's 1,024-token prefill took 54 s on an H200).
SEQUENTIAL_PREFILL = {"roco": "EasyKV's encoding loop, stride 1: one token per step after the budget"}
# Hyperparameters the check sets (the method's defaults otherwise): CLA's untrained proxy exercises its attention
# path; it has no released checkpoints, and its outputs are not judged for quality here.
OVERRIDES = {"cla": {"allow_untrained": True}}


def kept_positions(cache: KVCache) -> set[tuple[int, int, int, int]]:
    """(layer, row, head, position) of every valid cached entry. ``position_view()`` lays a ragged layer's flat entries
    out per head (AdaKV, KVzip); ``positions``/``valid`` alone hold only its appended tail (empty after a prefill)."""
    kept = set()
    for index, layer in enumerate(cache.layers):
        if hasattr(layer, "position_view"):
            pos, valid = layer.position_view()
        else:
            pos, valid = layer.positions, layer.valid
        pos = pos.cpu()
        valid = torch.ones_like(pos, dtype=torch.bool) if valid is None else valid.cpu()
        for b, h, n in valid.nonzero().tolist():
            kept.add((index, b, h, int(pos[b, h, n])))
    return kept


@torch.inference_mode()
def prefill(model, method, budget, ids, tokenizer):
    cache = KVCache()
    with CompressionSession(model, method, budget, tokenizer=tokenizer):
        out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
    return logits.cpu(), kept_positions(cache)


def generate(model, method, budget, prompts, new_tokens, pad_id, tokenizer):
    with CompressionSession(model, method, budget, tokenizer=tokenizer) as session:
        out = greedy_generate(model, prompts, new_tokens, [], pad_id)
    return out.tokens, session.stats.resident_kv_bytes_after_prefill


def build(name: str, budget: Budget):
    return build_method(method_config(name, OVERRIDES.get(name)), budget)


def compare_devices(name, cpu_model, gpu_model, budget, prompt, pad_id, tokenizer) -> dict:
    """float32: the same method on CPU and GPU (offload, GPU-only, against FullKV on the CPU)."""
    reference = "fullkv" if getattr(METHODS.get_class(name), "requires_cuda", False) else name
    ref_budget = Budget.full() if reference == "fullkv" else budget
    ids = torch.tensor([prompt])
    cpu_logits, cpu_kept = prefill(cpu_model, build(reference, ref_budget), ref_budget, ids, tokenizer)
    gpu_logits, gpu_kept = prefill(gpu_model, build(name, budget), budget, ids.to(gpu_model.device), tokenizer)
    cpu_tokens, _ = generate(cpu_model, build(reference, ref_budget), ref_budget, [prompt], 8, pad_id, tokenizer)
    gpu_tokens, _ = generate(gpu_model, build(name, budget), budget, [prompt], 8, pad_id, tokenizer)
    overlap = len(cpu_kept & gpu_kept) / max(len(cpu_kept), 1)
    diff = float((cpu_logits - gpu_logits).abs().max())
    agree = sum(a == b for a, b in zip(cpu_tokens[0], gpu_tokens[0])) / max(len(cpu_tokens[0]), 1)
    row = {"reference": reference, "length": len(prompt), "kept_overlap": round(overlap, 4),
           "kept_entries": len(gpu_kept), "cpu_kept_entries": len(cpu_kept), "logit_max_abs_diff": diff,
           "token_agreement": agree}
    if reference != name:  # offload keeps only part of the KV on the device by design: outputs must equal FullKV's
        row["ok"] = diff < MAX_LOGIT_DIFF and agree == 1.0
    else:  # an empty cache is a misreading (or a method that kept nothing): never a pass
        row["ok"] = len(gpu_kept) > 0 and overlap >= MIN_OVERLAP and len(cpu_kept) == len(gpu_kept) and (
            name in DEVICE_RNG or diff < MAX_LOGIT_DIFF)
    return row


def bf16_flash(name, model, budget, prompts, pad_id, tokenizer) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            tokens, resident = generate(model, build(name, budget), budget, prompts, 16, pad_id, tokenizer)
        kernel = "flash"
    except KVBenchError as exc:
        return {"ok": True, "refused": str(exc).splitlines()[0]}
    except RuntimeError as exc:  # "No available kernel": a call with a mask (left padding) or float32 inputs
        try:
            tokens, resident = generate(model, build(name, budget), budget, prompts, 16, pad_id, tokenizer)
        except KVBenchError as refusal:  # batch-1-only methods refuse the padded batch
            return {"ok": True, "refused": str(refusal).splitlines()[0]}
        kernel = f"any (flash refused: {str(exc).splitlines()[0][:80]})"
    # each row's tokens fed to the same method on that row alone (no padding, any SDPA kernel): the most any token is
    # below that path's choice, in logits; a random model's bf16 logits tie often, so a token that differs within
    # the rounding is no fault, where a row that attends padding or keeps another row's entries is logits below
    gaps = [float(forced_gaps(model, build(name, budget), budget, [p], [t], tokenizer).max())
            for p, t in zip(prompts, tokens)]
    return {"ok": all(len(t) == 16 for t in tokens) and max(gaps) <= MAX_BF16_GAP, "lengths": [len(p) for p in prompts],
            "sdpa_kernel": kernel, "resident_kv_bytes": resident, "gap_vs_alone": round(max(gaps), 4)}


def run_phase(label, name, report, fn, deadline) -> dict:
    """One method's phase: its row (refusal, crash and deadline recorded as rows) with its wall seconds."""
    if deadline is not None and time.monotonic() > deadline:
        row = {"ok": False, "skipped": "deadline: not started within --deadline seconds"}
    else:
        start = time.monotonic()
        try:
            row = fn()
        except KVBenchError as exc:
            row = {"ok": True, "refused": str(exc).splitlines()[0]}
        except Exception as exc:  # noqa: BLE001 - a crash on one method is a finding, the others still run
            row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        row["seconds"] = round(time.monotonic() - start, 2)
    report["methods"].setdefault(name, {})[label] = row
    print(f"{label.split('_')[0]} {name:14s} {json.dumps(row)}", flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-random")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--methods", nargs="*", default=None, help=f"default: all ({', '.join(METHODS.names())})")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="the device checked against the CPU (cpu: a dry run)")
    parser.add_argument("--sequential-length", type=int, default=192,
                        help=f"prompt tokens for methods with a sequential prefill ({', '.join(SEQUENTIAL_PREFILL)})")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for all methods, from the start; a method not started by then fails as skipped "
                             "(default: 150 on CUDA, none on the CPU)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline_s = args.deadline if args.deadline is not None else (150.0 if args.device.startswith("cuda") else None)
    deadline = None if not deadline_s else started + deadline_s
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: scripts/gpu_check.py needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    unknown = sorted(set(args.methods or []) - set(METHODS.names()))
    if unknown:
        print(f"error: unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS.names())}", file=sys.stderr)
        return 2
    raw = OmegaConf.load(REPO / "conf" / "model" / f"{args.model}.yaml")
    spec = spec_from_config({**OmegaConf.to_container(raw), "dtype": "float32", "device": "cpu"})
    loaded = load_model(spec)
    cpu_model, tokenizer = loaded.model, loaded.tokenizer
    gpu_model = copy.deepcopy(cpu_model).to(args.device)
    pad_id = tokenizer.pad_token_id
    prompt = essay_tokens(tokenizer, args.length)
    budget = parse_budget(args.budget)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    names = args.methods or METHODS.names()
    short = min(args.sequential_length, args.length)
    report = {"model": args.model, "device": device_name, "torch": torch.__version__,
              "length": args.length, "budget": args.budget, "deadline_seconds": deadline_s,
              "sequential_prefill": {name: {"length": short, "why": why} for name, why in SEQUENTIAL_PREFILL.items()
                                     if name in names},
              "overrides": {name: o for name, o in OVERRIDES.items() if name in names}, "methods": {}}
    out = args.out or REPO / "results" / "bench" / "gpu_check" / f"{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        report["seconds"] = round(time.monotonic() - started, 1)
        out.write_text(json.dumps(report, indent=1) + "\n")

    def prompt_of(name):
        return prompt[:short] if name in SEQUENTIAL_PREFILL else prompt

    for name in names:  # float32, CPU vs GPU
        run_phase("fp32_cpu_vs_cuda", name, report, lambda name=name: compare_devices(
            name, cpu_model, gpu_model, budget, prompt_of(name), pad_id, tokenizer), deadline)
        save()
    gpu_model.to(torch.bfloat16)
    cpu_model = None  # the CPU copy is not needed any more (frees its memory)
    for name in names:  # bf16, left-padded batch of two, flash SDPA where the calls allow it
        first = prompt_of(name)
        prompts = [first, first[: len(first) - max(len(first) // 10, 1)]]
        run_phase("bf16_batch2", name, report, lambda name=name, prompts=prompts: bf16_flash(
            name, gpu_model, budget, prompts, pad_id, tokenizer), deadline)
        save()
    failed = [name for name, rows in report["methods"].items() if not all(r["ok"] for r in rows.values())]
    report["failed"] = failed
    save()
    print(f"\n{len(names) - len(failed)}/{len(names)} methods pass in {report['seconds']} s; "
          f"failed: {', '.join(failed) or 'none'}; {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
