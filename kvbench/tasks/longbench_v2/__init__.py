"""LongBench v2 with the official prompts, truncation and answer extraction; see README.md in this folder."""

from kvbench.tasks.longbench_v2.task import LongBenchV2Task

__all__ = ["LongBenchV2Task"]
