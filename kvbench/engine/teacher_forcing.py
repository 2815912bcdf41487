"""Teacher-forced scoring with the cache: the log-probability of given tokens, read the way decoding reads them.

``teacher_forced_logprobs(model, ids, prefill_len, score_from)`` runs ``ids[:prefill_len]`` as one prefill forward,
then feeds ``ids[prefill_len : N-1]`` one token per forward with the cache (``position_ids`` = the token's index),
exactly like greedy decoding except that the next token is the given one, not the argmax. It returns
``log p(ids[j] | ids[:j])`` for every ``j`` in ``[score_from, N)``, whether ``ids[j]`` is the argmax there, and how far
below the argmax its logit is. ``teacher_forced_scores`` does the same for a batch of rows of one length (no padding):
the bench feeds the captured decode's tokens to the host-driven path with it (``kvbench.bench.measure.forced_gaps``).

Where compression happens relative to the scores (inside a ``CompressionSession``):

* the prefill's logits come from full causal attention over the prefill; the method's ``prefill`` /
  ``finish_prefill`` run after each layer's attention output was computed, so they shape the cache for the
  *following* forwards only (a method with ``prefill_attend``, such as LM-Infinite's Λ mask, restricts the prefill
  attention itself);
* in the forward that feeds token ``t`` every layer first appends ``t``'s key and value, attends over the cache it
  had after step ``t-1`` plus ``t``, and only then calls the method's ``decode`` hook, which evicts. The logits of
  that forward, hence the log-probability of ``ids[t+1]``, are computed **before** step ``t``'s eviction, which
  affects forward ``t+1`` onwards. This is StreamingLLM's ``eval_long_ppl.py`` order: score, then evict.

PG-19 streaming perplexity uses ``score_from=1``; lm-eval loglikelihood requests use ``score_from=len(context)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbench.engine.cache import KVCache
from kvbench.engine.compat import cache_kwargs
from kvbench.engine.generate import _sync

_ROWS_PER_CHUNK = 1024  # log-softmax over the prefill's logits in chunks of positions (bounded extra memory)


@dataclass
class TokenScores:
    """logprobs / greedy / gaps: ``(N - score_from,)`` (``(B, N - score_from)`` from ``teacher_forced_scores``)
    float32 log-probabilities of ``ids[score_from:]``, whether each token is the argmax of its logits (lm-eval's
    ``is_greedy``) and ``max(logits) - logits[token]`` in float32 (0 where it is the argmax); seconds and steps as
    ``greedy_generate`` counts them (``decode_steps`` = single-token forwards after the prefill)."""

    logprobs: torch.Tensor
    greedy: torch.Tensor
    gaps: torch.Tensor
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    resident_kv_bytes_final: int


def _score_rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log_softmax(logits)[..., targets]``, ``argmax == target`` and ``max - logits[..., targets]`` for ``logits
    (..., vocab)`` and ``targets (...)``, in float32, shaped as ``targets``."""
    shape, logits, targets = targets.shape, logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    logprobs, greedy, gaps = [], [], []
    for start in range(0, logits.shape[0], _ROWS_PER_CHUNK):
        rows = logits[start : start + _ROWS_PER_CHUNK].float()
        target = targets[start : start + _ROWS_PER_CHUNK].view(-1, 1)
        chosen = rows.gather(-1, target)
        logprobs.append((chosen - torch.logsumexp(rows, dim=-1, keepdim=True)).view(-1))
        greedy.append(rows.argmax(-1) == target.view(-1))
        gaps.append((rows.amax(-1, keepdim=True) - chosen).view(-1))
    return torch.cat(logprobs).view(shape), torch.cat(greedy).view(shape), torch.cat(gaps).view(shape)


def teacher_forced_logprobs(model, ids: Sequence[int], prefill_len: int, score_from: int = 1) -> TokenScores:
    """Score ``ids[score_from:]`` with a prefill of ``prefill_len`` tokens and single-token steps after it.

    Requires ``1 <= score_from <= prefill_len <= len(ids) - 1``. Batch size 1, no padding.
    """
    out = teacher_forced_scores(model, [ids], prefill_len, score_from)
    out.logprobs, out.greedy, out.gaps = out.logprobs[0], out.greedy[0], out.gaps[0]
    return out


@torch.inference_mode()
def teacher_forced_scores(model, rows: Sequence[Sequence[int]], prefill_len: int, score_from: int = 1) -> TokenScores:
    """``teacher_forced_logprobs`` for a batch of rows of one length ``N`` (no padding: every row's token ``j`` is
    at position ``j``): scores ``(B, N - score_from)``, one prefill forward of ``(B, prefill_len)`` and
    ``N - 1 - prefill_len`` forwards of ``(B, 1)``, as ``greedy_generate`` decodes an unpadded batch."""
    n = len(rows[0]) if rows else 0
    if not rows or any(len(r) != n for r in rows):
        raise ValueError(f"need one or more rows of one length, got lengths {[len(r) for r in rows]}")
    if not 1 <= score_from <= prefill_len <= n - 1:
        raise ValueError(f"need 1 <= score_from ({score_from}) <= prefill_len ({prefill_len}) <= len(ids) - 1 "
                         f"({n - 1})")
    device = model.device
    batch = len(rows)
    tokens = torch.tensor([list(r) for r in rows], dtype=torch.long, device=device)
    cache = KVCache()

    _sync(device)
    t0 = time.perf_counter()
    keep = prefill_len - score_from + 1  # prefill positions whose logits predict a scored token
    out = model(
        input_ids=tokens[:, :prefill_len], position_ids=torch.arange(prefill_len, device=device).repeat(batch, 1),
        **cache_kwargs(model, cache), use_cache=True, logits_to_keep=keep,
    )
    first = _score_rows(out.logits[:, -keep:], tokens[:, score_from : prefill_len + 1])
    del out
    _sync(device)
    prefill_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    steps = n - 1 - prefill_len
    scores = [torch.empty(batch, steps, dtype=dtype, device=device)
              for dtype in (torch.float32, torch.bool, torch.float32)]
    for i, t in enumerate(range(prefill_len, n - 1)):
        out = model(
            input_ids=tokens[:, t : t + 1], position_ids=torch.full((batch, 1), t, device=device),
            **cache_kwargs(model, cache), use_cache=True,
        )
        for into, value in zip(scores, _score_rows(out.logits[:, -1], tokens[:, t + 1])):
            into[:, i] = value
    _sync(device)
    decode_seconds = time.perf_counter() - t1
    logprobs, greedy, gaps = (torch.cat([a, b], dim=1).cpu() for a, b in zip(first, scores))
    return TokenScores(
        logprobs=logprobs,
        greedy=greedy,
        gaps=gaps,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        decode_steps=steps,
        resident_kv_bytes_final=cache.resident_bytes(),
    )
