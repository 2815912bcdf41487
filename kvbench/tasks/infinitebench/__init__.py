"""InfiniteBench (the 12 tasks) with the official open-model prompts and scorers; see README.md in this folder."""

from kvbench.tasks.infinitebench.task import InfiniteBenchTask

__all__ = ["InfiniteBenchTask"]
