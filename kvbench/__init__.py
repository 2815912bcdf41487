"""kvbench: a reproducible benchmark harness for KV-cache compression in LLMs."""

__version__ = "0.1.0"
