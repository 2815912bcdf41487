"""One job, below the command line: ``plan_job`` (validate, key; loads nothing) -> ``run_job`` (load, samples,
records, resume) -> scores and meta (``records``). ``kvbench.run`` (the CLI), ``kvbench.sweep`` (workers) and the
tests call these; nothing here imports the CLI."""

from kvbench.jobs.plan import Job, plan_job
from kvbench.jobs.runner import run_job
from kvbench.store.scores import record_scores

__all__ = ["Job", "plan_job", "record_scores", "run_job"]
