"""OmniKV 2StageRetr (dict lookup after an addition, CoT or direct); see README.md in this folder."""

from kvbench.tasks.twostage_retr.task import TwoStageRetrTask

__all__ = ["TwoStageRetrTask"]
