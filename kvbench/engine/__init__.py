"""The only code that touches transformers internals: attention functions, cache layers, generation and
teacher-forced scoring loops.

Names are imported lazily so that ``kvbench.methods`` (which the session imports) can use ``kvbench.engine.cache``
without an import cycle.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "KVCache": "kvbench.engine.cache",
    "KVLayer": "kvbench.engine.cache",
    "CompressionSession": "kvbench.engine.session",
    "SessionStats": "kvbench.engine.session",
    "greedy_generate": "kvbench.engine.generate",
    "GenerationOutput": "kvbench.engine.generate",
    "staged_generate": "kvbench.engine.generate",
    "StagedOutput": "kvbench.engine.generate",
    "teacher_forced_logprobs": "kvbench.engine.teacher_forcing",
    "teacher_forced_scores": "kvbench.engine.teacher_forcing",
    "TokenScores": "kvbench.engine.teacher_forcing",
    "cache_kwargs": "kvbench.engine.compat",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvbench.engine' has no attribute {name!r}")
