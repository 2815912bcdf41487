"""Reasoning math benchmarks (MATH-500, AIME 2024, AIME 2025) graded by math-verify; see README.md in this folder."""

from kvbench.tasks.math.task import Aime24Task, Aime25Task, Math500Task, MathTask

__all__ = ["Aime24Task", "Aime25Task", "Math500Task", "MathTask"]
