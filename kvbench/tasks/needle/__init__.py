"""Needle in a haystack (PyramidKV / KVCache-Factory protocol); see README.md in this folder."""

from kvbench.tasks.needle.task import NeedleTask

__all__ = ["NeedleTask"]
