"""Passkey retrieval (InfiniteBench protocol, data generated at any length); see README.md in this folder."""

from kvbench.tasks.passkey.task import PasskeyTask

__all__ = ["PasskeyTask"]
