"""Models: config -> validated ``ModelSpec`` -> ``LoadedModel`` (model, tokenizer, shape, EOS ids).

``spec_from_config`` only validates (no torch or transformers import unless CUDA must be checked), so configs fail
fast; ``load_model`` does the loading. See ``kvbench/models/README.md`` for sources and the cache.
"""

from kvbench.models.loading import (
    attention_shape,
    collect_eos_token_ids,
    embedded_model_dir,
    embedded_tokenizer_dir,
    load_model,
    resolve_device,
    spec_from_config,
)
from kvbench.models.spec import ATTN_IMPLEMENTATIONS, DEVICES, DTYPES, SOURCES, LoadedModel, ModelSpec

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "DEVICES",
    "DTYPES",
    "SOURCES",
    "LoadedModel",
    "ModelSpec",
    "attention_shape",
    "collect_eos_token_ids",
    "embedded_model_dir",
    "embedded_tokenizer_dir",
    "load_model",
    "resolve_device",
    "spec_from_config",
]
