"""KV-cache compression methods: one dataclass per file, registered here by config name."""

from __future__ import annotations

from typing import Any

from kvbench.budget import Budget
from kvbench.methods.base import DecodeContext, Method, PrefillContext
from kvbench.registry import Registry

_BASELINE = "arrives with issue #4, the other baselines"

METHODS = Registry(
    "method",
    {
        "fullkv": "kvbench.methods.fullkv:FullKV",
        "streamingllm": "kvbench.methods.streamingllm:StreamingLLM",
        "snapkv": "kvbench.methods.snapkv:SnapKV",
        "pyramidkv": "kvbench.methods.pyramidkv:PyramidKV",
        "h2o": "kvbench.methods.h2o:H2O",
        "omnikv": "kvbench.methods.omnikv:OmniKV",
        "dynamickv": "kvbench.methods.dynamickv:DynamicKV",
        "kvmerger": "kvbench.methods.kvmerger:KVMerger",
        "d2o": "kvbench.methods.d2o:D2O",
        "pod": "kvbench.methods.pod:POD",
        "cam": "kvbench.methods.cam:CaM",
        "roco": "kvbench.methods.roco:RoCo",
        "local": "kvbench.methods.local:LocalWindow",
        "lminfinite": "kvbench.methods.lminfinite:LMInfinite",
        "sirllm": "kvbench.methods.sirllm:SirLLM",
    },
    pending={
        **{
            name: _BASELINE
            for name in (
                "quest", "infllm", "pyramidinfer", "offload", "cla", "lococo",
            )
        },
    },
)


def build_method(cfg: Any, budget: Budget) -> Method:
    """Method instance from the composed ``method`` config node (``name`` + fields), validated against ``budget``."""
    fields = {k: v for k, v in dict(cfg).items() if k != "name"}
    method = METHODS.build(str(cfg["name"]), fields)
    method.validate(budget)
    return method


__all__ = ["METHODS", "DecodeContext", "Method", "PrefillContext", "build_method"]
