"""LoCoCo: a fixed-size KV memory fused by learned 1-D convolutions (needs its trained kernels; refuses without).

Cai et al., "LoCoCo: Dropping In Convolutions for Long Context Compression" (ICML 2024, arXiv:2406.05317), code
VITA-Group/LoCoCo. reference/methods.md B15.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.budget import Budget
from kvbench.errors import NotAvailableError
from kvbench.methods.base import Method


@dataclass
class LoCoCo(Method):
    """Refuses to run, always, before any model loads.

    LoCoCo keeps ``mem_size`` KV slots per layer and, for every incoming chunk, computes the mixing weights of old
    slots and new tokens with 1-D convolution heads (kernel 21) trained on top of a frozen model (optionally with
    LoRA); the kernels are the method. No checkpoints are released (the repository's README: "The model checkpoints
    is coming soon!"), and running the mechanism with untrained kernels would be a different method, so kvbench
    offers no proxy. To add it: train the convolution heads (the authors' ``train.py``; ``scripts/pod_adapt.py`` is
    kvbench's pattern for a method's adaptation run) and implement the fusion as a ``decode``/``prefill`` hook that
    loads them.
    """

    name: ClassVar[str] = "lococo"
    compression: ClassVar[str] = "prefill"
    requires_training: ClassVar[bool] = True

    def validate(self, budget: Budget) -> None:
        raise NotAvailableError(
            "method 'lococo' (Cai et al. 2024, arXiv:2406.05317) needs its learned 1-D convolution kernels, trained "
            "per model; none are released (VITA-Group/LoCoCo: checkpoints 'coming soon') and kvbench runs no untrained "
            "proxy; train them with the authors' train.py (scripts/pod_adapt.py is kvbench's pattern for an "
            "adaptation run) and add a loader"
        )
