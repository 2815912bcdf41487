"""KV-cache compression methods: one dataclass per file, registered here by config name."""

from __future__ import annotations

from typing import Any

from kvbench.budget import Budget
from kvbench.methods.base import DecodeContext, Method, PrefillContext
from kvbench.registry import Registry

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
        "quest": "kvbench.methods.quest:Quest",
        "infllm": "kvbench.methods.infllm:InfLLM",
        "pyramidinfer": "kvbench.methods.pyramidinfer:PyramidInfer",
        "offload": "kvbench.methods.offload:BrutalOffload",
        "cla": "kvbench.methods.cla:CLA",
        "lococo": "kvbench.methods.lococo:LoCoCo",
        "cam": "kvbench.methods.cam:CaM",
        "roco": "kvbench.methods.roco:RoCo",
        "local": "kvbench.methods.local:LocalWindow",
        "lminfinite": "kvbench.methods.lminfinite:LMInfinite",
        "sirllm": "kvbench.methods.sirllm:SirLLM",
        "knorm": "kvbench.methods.knorm:KNorm",
        "keydiff": "kvbench.methods.keydiff:KeyDiff",
        "tova": "kvbench.methods.tova:TOVA",
        "expected_attention": "kvbench.methods.expected_attention:ExpectedAttention",
        "adakv": "kvbench.methods.adakv:AdaKV",
        "chunkkv": "kvbench.methods.chunkkv:ChunkKV",
        "think": "kvbench.methods.think:ThinK",
        "kvzip": "kvbench.methods.kvzip:KVzip",
    },
    pending={},  # every method the five papers compare against is implemented (issue #4)
)


def build_method(cfg: Any, budget: Budget) -> Method:
    """Method instance from the composed ``method`` config node (``name`` + fields), validated against ``budget``."""
    from kvbench.methods.scorer_wrapper import WRAPPERS

    fields = {k: v for k, v in dict(cfg).items() if k != "name"}
    name = str(cfg["name"])
    if name not in METHODS.entries and name.partition("-")[0] in WRAPPERS:  # a stored composed name: adakv-snapkv
        name = name.partition("-")[0]
    method = METHODS.build(name, fields)
    method.validate(budget)
    return method


__all__ = ["METHODS", "DecodeContext", "Method", "PrefillContext", "build_method"]
