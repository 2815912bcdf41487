"""PG-19 streaming perplexity (StreamingLLM eval_long_ppl.py protocol, D2O Figure 6)."""

from kvbench.tasks.pg19.task import PG19Task, curve_grid

__all__ = ["PG19Task", "curve_grid"]
