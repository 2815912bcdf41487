"""ZeroSCROLLS (validation split) with the official prompts, truncation and metrics; see README.md in this folder."""

from kvbench.tasks.zeroscrolls.task import ZeroScrollsSample, ZeroScrollsTask

__all__ = ["ZeroScrollsSample", "ZeroScrollsTask"]
