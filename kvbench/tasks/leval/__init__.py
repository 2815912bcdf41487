"""LEval (20 sub-tasks) with the official prompts and scorers; see README.md in this folder."""

from kvbench.tasks.leval.task import LEvalSample, LEvalTask

__all__ = ["LEvalSample", "LEvalTask"]
