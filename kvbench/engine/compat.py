"""Where transformers keeps the cache: one place that knows every name it has used.

transformers 5.24 renamed the cache keyword of every model and attention module from ``past_key_values`` to ``cache``
(``@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")``) and the model output's field with it. An engine
that read only the old name found no cache, attached nothing, and every method ran as FullKV under its own name.
Everything in kvbench that passes a cache to a model, finds a layer's cache in an attention call, or reads a cache
from a model output goes through the three functions below, so the next rename is one line here — and the
session's per-forward check (``CompressionSession``) makes a missed one a loud error, never a FullKV result.

The supported ranges are the ones CI tests at both ends (``.ci/run``: the newest that pip resolves, and the lowest).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

#: the keyword names transformers has used for the cache, newest first (5.24+: ``cache``; before: the old name)
CACHE_KEYWORDS = ("cache", "past_key_values")
#: the ranges pyproject declares and CI tests at both ends (a test checks that pyproject says the same)
SUPPORTED_TRANSFORMERS = ">=5.6,<6"
SUPPORTED_TORCH = ">=2.6,<2.16"


def _is_cache(value: Any) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


def find_cache(kwargs: Mapping[str, Any]) -> Any:
    """The ``Cache`` in the keyword arguments of an attention module's (or a model's) forward, or None.

    Known names first; then any ``Cache`` among the values, so that a rename we have not seen yet still finds it."""
    for name in CACHE_KEYWORDS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return next((v for v in kwargs.values() if _is_cache(v)), None)


def output_cache(output: Any) -> Any:
    """The cache a model's forward returned (``output.cache`` on 5.24+, ``output.past_key_values`` before), or None."""
    if output is None:
        return None
    for name in CACHE_KEYWORDS:
        value = getattr(output, name, None)
        if value is not None:
            return value
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, tuple) else ()
    return next((v for v in values if _is_cache(v)), None)


def cache_keyword(model: Any) -> str:
    """The keyword ``model.forward`` takes its cache by: ``cache`` (transformers >= 5.24), ``past_key_values`` (older
    transformers and remote-code models written for them). Read from the signature, so no deprecation warning."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    return "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{<the model's cache keyword>: cache}``, to pass to ``model(...)``."""
    return {cache_keyword(model): cache}


def versions_line() -> str:
    """``transformers 5.24.0, torch 2.13.0 (supported: transformers >=5.6,<6, torch >=2.6,<2.16)``."""
    import torch
    import transformers

    return (f"transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]} "
            f"(supported: transformers {SUPPORTED_TRANSFORMERS}, torch {SUPPORTED_TORCH})")
