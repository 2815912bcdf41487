"""The job runner's answers to a task's requests (``kvbench.tasks.requests``), computed with the engine.

``EngineAnswerer(loaded, new_session, budget)`` implements the tasks layer's ``Answerer``: a ``GenerateUntil`` is
``engine.greedy_generate`` and a ``TeacherForced`` is ``engine.teacher_forcing.teacher_forced_logprobs``, each inside
a fresh session of the job's method and budget (``new_session()``), or of FullKV where the request asks for the full
cache. The statistics of each answer are the session's after the request (resident KV after the prefill's
compression, entries per layer, attended tokens) and the engine's output (seconds, steps, final resident KV).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbench.tasks.requests import AnswerStats, GenerateUntil, Generation, TeacherForced, TokenLogProbs


class EngineAnswerer:
    """``loaded``: the job's ``kvbench.models.LoadedModel``; ``new_session()``: a fresh ``CompressionSession`` of the
    job's method and budget (a context manager around each request); ``budget``: the job's budget."""

    def __init__(self, loaded: Any, new_session: Callable[[], Any], budget: Any):
        self.loaded = loaded
        self.new_session = new_session
        self.budget = budget

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def spec(self) -> Any:
        return self.loaded.spec

    def generate(self, request: GenerateUntil) -> Generation:
        from kvbench.engine import greedy_generate

        tokenizer = self.tokenizer
        stop = stop_checker(tokenizer, request.stop_strings, request.stop_tail)
        with self._session(request.full_cache) as session:
            out = greedy_generate(self.loaded.model, [list(p) for p in request.prompts], request.max_new_tokens,
                                  self.loaded.eos_token_ids, tokenizer.pad_token_id, stop)
        return Generation(tokens=out.tokens, stats=_stats(out, session))

    def loglikelihood(self, request: TeacherForced) -> TokenLogProbs:
        from kvbench.engine.teacher_forcing import teacher_forced_logprobs

        with self._session(request.full_cache) as session:
            out = teacher_forced_logprobs(self.loaded.model, list(request.ids), request.prefill,
                                          score_from=request.score_from)
        return TokenLogProbs(logprobs=out.logprobs, greedy=out.greedy, stats=_stats(out, session))

    def _session(self, full_cache: bool) -> Any:
        if not full_cache:
            return self.new_session()
        from kvbench.budget import Budget
        from kvbench.engine import CompressionSession
        from kvbench.methods import METHODS

        return CompressionSession(self.loaded.model, METHODS.build("fullkv", {}), Budget.full())


def stop_checker(tokenizer: Any, stop_strings: tuple[str, ...], tail: int) -> Callable[[int, list[int]], bool] | None:
    """None without stop strings; else a row stops once the decoded text of its last ``tail`` tokens holds one."""
    if not stop_strings:
        return None

    def should_stop(row: int, tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens[-tail:])
        return any(stop and stop in text for stop in stop_strings)

    return should_stop


def _stats(out: Any, session: Any) -> AnswerStats:
    stats = session.stats
    return AnswerStats(
        prefill_seconds=out.prefill_seconds,
        decode_seconds=out.decode_seconds,
        decode_steps=out.decode_steps,
        resident_kv_bytes=stats.resident_kv_bytes_after_prefill,
        resident_kv_bytes_final=out.resident_kv_bytes_final,
        layer_entries=stats.layer_entries_after_prefill,
        attended_tokens_mean=stats.attended_tokens_mean,
    )


__all__ = ["EngineAnswerer", "stop_checker"]
