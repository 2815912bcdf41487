"""Greedy generation with separately timed prefill and decode, equal to ``model.generate(do_sample=False)``.

The loop is the one ``generate`` runs (prefill with ``logits_to_keep=1``, then one token per step with
``position_ids`` continuing from the attention-mask cumsum), written out so that prefill and decode can be timed
apart and rows can stop at task stop strings. Left padding for batch > 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvbench import faults
from kvbench.engine.attention import ACTIVE_SESSION
from kvbench.engine.cache import KVCache
from kvbench.engine.compat import cache_kwargs


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # generated ids per row (eos excluded, stop at the first eos)
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    resident_kv_bytes_final: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def greedy_generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    should_stop: Callable[[int, list[int]], bool] | None = None,
) -> GenerationOutput:
    """Generate greedily for each prompt (left-padded batch). ``should_stop(row, tokens)`` ends a row early."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = bool((mask == 0).any())
    cache = KVCache()
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    tokens: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)

    session = ACTIVE_SESSION.get()
    if session is not None and hasattr(session, "reserve"):  # engine.compile: slots for the tokens to come
        session.reserve(max_new_tokens)
    _sync(device)
    t0 = time.perf_counter()
    out = model(
        input_ids=ids, attention_mask=mask if padded else None, position_ids=position_ids,
        **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1,
    )
    next_token = out.logits[:, -1, :].argmax(-1)
    _sync(device)
    prefill_seconds = time.perf_counter() - t0
    faults.reach("mid_sample")
    if faults.armed("oom"):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by KVBENCH_FAULT=oom)")

    t1 = time.perf_counter()
    steps = 0
    last_pos = position_ids[:, -1:]
    for step in range(max_new_tokens):
        # one device read per step for all rows (per-row reads each wait for the GPU)
        ids_now, eos_now = next_token.tolist(), torch.isin(next_token, eos).tolist()
        for row in range(len(prompts)):
            if done[row]:
                continue
            if eos_now[row]:
                done[row] = True
                continue
            tokens[row].append(int(ids_now[row]))
            if should_stop is not None and should_stop(row, tokens[row]):
                done[row] = True
        if all(done) or step == max_new_tokens - 1:
            break
        last_pos = last_pos + 1
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=-1)
        out = model(
            input_ids=next_token.view(-1, 1), attention_mask=mask if padded else None, position_ids=last_pos,
            **cache_kwargs(model, cache), use_cache=True,
        )
        next_token = out.logits[:, -1, :].argmax(-1)
        steps += 1
    _sync(device)
    decode_seconds = time.perf_counter() - t1
    return GenerationOutput(tokens, prefill_seconds, decode_seconds, steps, cache.resident_bytes())
