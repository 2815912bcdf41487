"""Official-equivalent scorers: small functions, each pinned by tests against hand-computed values.

Tasks refer to them by name (``METRICS``) so a predictions file from another harness can be re-scored.
"""

from __future__ import annotations

from kvbench.metrics.rouge import rouge1_f_x10
from kvbench.metrics.string_match import first_int, first_int_match, substring_any

METRICS = {
    "rouge1_f_x10": rouge1_f_x10,
    "first_int_match": first_int_match,
    "substring_any": substring_any,
}

__all__ = ["METRICS", "first_int", "first_int_match", "rouge1_f_x10", "substring_any"]
