"""RULER: the 13 synthetic tasks of NVIDIA/RULER, generated locally (README.md)."""

from kvbench.tasks.ruler.task import QA_TASKS, RULER_TASKS, RulerTask

__all__ = ["QA_TASKS", "RULER_TASKS", "RulerTask"]
