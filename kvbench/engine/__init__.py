"""The only code that touches transformers internals: attention functions, cache layers, generation loop."""

from kvbench.engine.cache import KVCache, KVLayer
from kvbench.engine.generate import GenerationOutput, greedy_generate
from kvbench.engine.session import CompressionSession, SessionStats

__all__ = ["KVCache", "KVLayer", "CompressionSession", "SessionStats", "greedy_generate", "GenerationOutput"]
