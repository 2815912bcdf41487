"""Deterministic fault injection for the reliability tests and ``scripts/kill_resume_loop.py``.

``KVBENCH_FAULT=<point>:<n>`` (comma-separated for several) makes the process SIGKILL itself the ``n``-th time
(1-based) it reaches ``<point>``, so a test can kill a job at an exact place instead of at a random moment:

* ``model_load``: inside ``kvbench.models.load_model``, after the weights are read, before the model is ready;
* ``mid_sample``: inside ``greedy_generate``, after the prefill, before the first decode step;
* ``record_write``: in ``JobDir.append_record``, after the first half of the record's line is on disk (a torn line);
* ``scores_write``: in ``JobDir.write_scores``, after the temp file is fsynced, before the rename;
* ``oom``: at the ``mid_sample`` place, raise ``torch.OutOfMemoryError`` instead (a CUDA OOM without a GPU).

Unset (always, outside tests) ``reach`` is one dictionary lookup and does nothing.
"""

from __future__ import annotations

import os
import signal

POINTS = ("model_load", "mid_sample", "record_write", "scores_write", "oom")
_counts: dict[str, int] = {}


def _plan() -> dict[str, int]:
    spec = os.environ.get("KVBENCH_FAULT", "")
    plan = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, nth = item.partition(":")
        if point not in POINTS or not nth.isdigit() or int(nth) < 1:
            raise ValueError(f"KVBENCH_FAULT={spec!r}: expected <point>:<n> with n >= 1 and point one of "
                             f"{', '.join(POINTS)}")
        plan[point] = int(nth)
    return plan


def armed(point: str) -> bool:
    """Whether this call is the one that must die (counts the visit)."""
    if "KVBENCH_FAULT" not in os.environ:
        return False
    _counts[point] = _counts.get(point, 0) + 1
    return _plan().get(point) == _counts[point]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def reach(point: str) -> None:
    """SIGKILL this process if ``KVBENCH_FAULT`` names this visit of ``point``."""
    if armed(point):
        die()


__all__ = ["POINTS", "armed", "die", "reach"]
