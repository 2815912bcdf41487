"""LongBench v1 / LongBench-E with the official prompts and scorers; see README.md in this folder."""

from kvbench.tasks.longbench.task import LongBenchETask, LongBenchTask, LongBenchZhTask

__all__ = ["LongBenchETask", "LongBenchTask", "LongBenchZhTask"]
