"""Greedy (or sampled) generation with separately timed prefill and decode, equal to
``model.generate(do_sample=False)`` when greedy.

The loop is the one ``generate`` runs (prefill with ``logits_to_keep=1``, then one token per step with
``position_ids`` continuing from the attention-mask cumsum), written out so that prefill and decode can be timed
apart and rows can stop at task stop strings. Left padding for batch > 1. With a ``Sampling``
(``kvbench.engine.sampling``) each step's token is drawn instead, from one uniform per row and step of the row's own
seeded CPU generator (the same tokens in any batch, on any device up to logit ties).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvbench import faults
from kvbench.engine.attention import ACTIVE_SESSION
from kvbench.engine.cache import KVCache, KVLayer
from kvbench.engine.compat import cache_kwargs
from kvbench.engine.sampling import RowStreams, Sampling, next_tokens


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


def _by_columns(take: Callable[[list[int]], None], done: list[bool], first: int, max_new_tokens: int):
    """The host-driven loop's per-step handling (``take``) over blocks of steps ``(rows, k)`` from the captured loop,
    step ``first`` first: True once every row ended or the last allowed step was taken (later ids are dropped).
    ``take_columns.ended`` is then that step: the decode forwards the host-driven loop would have run."""
    index = [first]

    def take_columns(columns: list[list[int]]) -> bool:
        for j in range(len(columns[0])):
            take([row[j] for row in columns])
            if all(done) or index[0] == max_new_tokens - 1:
                take_columns.ended = index[0]
                return True
            index[0] += 1
        return False

    take_columns.ended = None
    return take_columns


@torch.inference_mode()
def greedy_generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    should_stop: Callable[[int, list[int]], bool] | None = None,
    sampling: Sampling | None = None,
    seeds: Sequence[int] | None = None,
) -> GenerationOutput:
    """Generate greedily for each prompt (left-padded batch). ``should_stop(row, tokens)`` ends a row early.

    ``sampling`` (None: greedy) draws each token instead, row ``r`` from a generator seeded ``seeds[r]``; a row draws
    one uniform per step, the prefill's token included, whether it has ended or not."""
    if sampling is not None and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError(f"sampling needs one seed per prompt ({len(prompts)}), got {seeds!r}")
    streams = RowStreams(seeds) if sampling is not None else None
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
    next_token = next_tokens(out.logits[:, -1, :], sampling, streams.next(1) if streams else None)
    _sync(device)
    prefill_seconds = time.perf_counter() - t0
    faults.reach("mid_sample")
    if faults.armed("oom"):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by KVBENCH_FAULT=oom)")

    t1 = time.perf_counter()
    steps = 0
    last_pos = position_ids[:, -1:]
    eos_ids = set(int(e) for e in eos_token_ids)

    def take(ids_now: list[int]) -> None:
        for row in range(len(prompts)):
            if done[row]:
                continue
            if ids_now[row] in eos_ids:
                done[row] = True
                continue
            tokens[row].append(int(ids_now[row]))
            if should_stop is not None and should_stop(row, tokens[row]):
                done[row] = True

    for step in range(max_new_tokens):
        # one device read per step for all rows (per-row reads each wait for the GPU)
        take(next_token.tolist())
        if all(done) or step == max_new_tokens - 1:
            break
        if session is not None and getattr(session, "can_capture", lambda: False)():
            # every later step is one captured step (engine/graph.py); the host reads the chosen ids every few steps
            from kvbench.engine.graph import captured_generate

            by_columns = _by_columns(take, done, step + 1, max_new_tokens)
            steps += captured_generate(session, model, next_token, last_pos, max_new_tokens - 1 - step, by_columns,
                                       read_every=getattr(session, "read_every", lambda: None)(),
                                       sampling=sampling, streams=streams)
            if by_columns.ended is not None:  # the steps run past it (read every few steps) are not the generation's
                session.generation_ended(by_columns.ended)
            break
        last_pos = last_pos + 1
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=-1)
        out = model(
            input_ids=next_token.view(-1, 1), attention_mask=mask if padded else None, position_ids=last_pos,
            **cache_kwargs(model, cache), use_cache=True,
        )
        next_token = next_tokens(out.logits[:, -1, :], sampling, streams.next(1) if streams else None)
        steps += 1
    _sync(device)
    decode_seconds = time.perf_counter() - t1
    return GenerationOutput(tokens, prefill_seconds, decode_seconds, steps, cache.resident_bytes())


# ---- question=after_compression and turns=N: the context alone, then the question as a continued forward -----------


@dataclass
class TurnOutput:
    """One question asked on the compressed context: what was fed, what came back, what the cache held."""

    tokens: list[int]  # generated ids (eos excluded)
    fed_tokens: int  # ids fed before decoding: the question (with, from the 2nd turn, the previous answer's last id)
    question_seconds: float  # the continued forward over the fed ids
    decode_seconds: float
    decode_steps: int
    layer_entries_after_question: list[float]  # per layer, right after the fed ids joined the cache
    resident_kv_bytes_after_question: int
    layer_entries_final: list[float]
    resident_kv_bytes_final: int


@dataclass
class StagedOutput:
    context_tokens: int
    prefill_seconds: float  # the context's forward (compression at its end included)
    layer_entries_after_compression: list[float]
    resident_kv_bytes_after_compression: int
    turns: list[TurnOutput]


def layer_entries(cache: KVCache) -> list[float]:
    """Valid entries per layer (mean over KV heads of row 0), as ``SessionStats.layer_entries_after_prefill``."""
    layers = [layer for layer in cache.layers if isinstance(layer, KVLayer) and layer.num_entries]
    if not layers:
        return []
    means = torch.stack([layer.valid_counts()[0].float().mean() for layer in layers]).tolist()
    return [int(m) if m.is_integer() else round(m, 2) for m in means]


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def snapshot_layers(cache: KVCache) -> list[dict]:
    """Every layer's state (entries, positions, validity, per-entry and per-row method state), cloned."""
    return [{k: _clone(v) for k, v in vars(layer).items()} for layer in cache.layers]


def restore_layers(cache: KVCache, saved: list[dict]) -> None:
    """Put the layers back as ``snapshot_layers`` saw them (in place: the session holds the same layer objects);
    clones again, so a snapshot can be restored any number of times (some methods edit values in place)."""
    if len(saved) != len(cache.layers):
        raise RuntimeError("the cache gained or lost layers since its snapshot")
    for layer, state in zip(cache.layers, saved):
        vars(layer).clear()
        vars(layer).update({k: _clone(v) for k, v in state.items()})


@torch.inference_mode()
def staged_generate(
    model,
    context: Sequence[int],
    turns: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    eos_token_ids: Sequence[int],
    should_stop: Callable[[int, list[int]], bool] | None = None,
    history: str = "keep",
) -> StagedOutput:
    """Greedy generation for one sequence, the question fed after the context was compressed.

    1. Prefill ``context`` alone: the session's method compresses it at the end of this forward, as at the end of any
       prefill (its budget resolves on the context's length).
    2. For each turn ``k``: one continued forward over ``turns[k]`` (the question ids; for ``k >= 1`` the follow-up,
       after the previous answer's last generated id, which no forward has fed yet), whose keys/values join the cache
       as decoded tokens do (uncompressed, unless the method evicts at decode time), then greedy decoding of up to
       ``max_new_tokens[k]`` tokens; ``should_stop(k, tokens)`` ends a turn early.
    ``history``: ``keep`` (each turn's question and answer stay in the cache for the next turns) or ``rollback`` (the
    cache returns to its state right after the compressed context before every turn: each turn sees the context
    only, at the same positions).
    """
    if history not in ("keep", "rollback"):
        raise ValueError(f"history={history!r}: keep or rollback")
    device = model.device
    cache = KVCache()
    eos = set(int(e) for e in eos_token_ids)
    ids = torch.tensor([list(context)], dtype=torch.long, device=device)
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=None, position_ids=torch.arange(ids.shape[1], device=device).view(1, -1),
                **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    _sync(device)
    prefill_seconds = time.perf_counter() - t0
    faults.reach("mid_sample")
    if faults.armed("oom"):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by KVBENCH_FAULT=oom)")
    result = StagedOutput(len(context), prefill_seconds, layer_entries(cache), cache.resident_bytes(), [])
    saved = snapshot_layers(cache) if history == "rollback" and len(turns) > 1 else None
    position, pending = len(context), []
    for k, question in enumerate(turns):
        if saved is not None and k > 0:
            restore_layers(cache, saved)
            position, pending = len(context), []
        fed = list(pending) + list(question)
        if not fed:
            raise ValueError(f"turn {k} has no question tokens")
        ids = torch.tensor([fed], dtype=torch.long, device=device)
        t1 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=None,
                    position_ids=torch.arange(position, position + len(fed), device=device).view(1, -1),
                    **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        _sync(device)
        question_seconds = time.perf_counter() - t1
        position += len(fed)
        after_question = (layer_entries(cache), cache.resident_bytes())
        next_token = int(out.logits[0, -1, :].argmax(-1))
        tokens: list[int] = []
        steps, pending = 0, []
        t2 = time.perf_counter()
        for step in range(max_new_tokens[k]):
            if next_token in eos:
                break
            tokens.append(next_token)
            if (should_stop is not None and should_stop(k, tokens)) or step == max_new_tokens[k] - 1:
                pending = [next_token]  # generated, not fed: the next turn feeds it first
                break
            out = model(input_ids=torch.tensor([[next_token]], device=device), attention_mask=None,
                        position_ids=torch.tensor([[position]], device=device), **cache_kwargs(model, cache),
                        use_cache=True)
            position += 1
            next_token = int(out.logits[0, -1, :].argmax(-1))
            steps += 1
        _sync(device)
        result.turns.append(TurnOutput(tokens, len(fed), question_seconds, time.perf_counter() - t2, steps,
                                       *after_question, layer_entries(cache), cache.resident_bytes()))
    return result
