"""The method registry: config name -> ``module:Class`` (imported on first use), and the wrappers whose stored results
carry a composed name. Its own module so that the method contract (``base``) and the wrappers can look methods up
without importing the package that imports them (tests/test_layers.py: no import cycle)."""

from __future__ import annotations

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
        "rkv": "kvbench.methods.rkv:RKV",
        "triattention": "kvbench.methods.triattention:TriAttention",
    },
    pending={},  # every method the five papers compare against is implemented (issue #4)
)

#: methods that wrap a scorer; their results are stored under the composed name ``<wrapper>-<scorer>`` (adakv-snapkv)
WRAPPERS = ("adakv", "chunkkv")


def compose_method_name(wrapper: str, inner: str) -> str:
    """The name a wrapper over ``inner`` runs and is stored under (``adakv-snapkv``), split by ``parse_method_name``."""
    return f"{wrapper}-{inner}"


def parse_method_name(name: str) -> tuple[str | None, str]:
    """``(wrapper, inner)`` of a method name as configs and stored results spell it, the one place composed names are
    split: ``adakv-snapkv`` -> ``("adakv", "snapkv")`` (``ScorerWrapper.name``: a wrapper of ``WRAPPERS``, a dash,
    the scorer's name); a registered name -> ``(None, name)``, whatever it contains; anything else (``snapkv-x``
    whose head is not a wrapper, ``adakv-`` with no scorer, an unknown name) -> ``(None, name)``, for the registry to
    refuse or the caller to treat as unknown. The scorer part is split once at the first dash and not looked up: a
    scorer whose name held a dash stays whole. ThinK's ``think+snapkv`` is not a name (its ``composed`` field)."""
    if name in METHODS.entries:
        return None, name
    wrapper, dash, inner = name.partition("-")
    if dash and inner and wrapper in WRAPPERS:
        return wrapper, inner
    return None, name
