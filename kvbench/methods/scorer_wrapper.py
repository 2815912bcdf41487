"""What AdaKV and ChunkKV share: a method that allocates entries over another method's scores (DESIGN principle 12).

The wrapped method (``scorer``, any registered method with ``prefill_scores``) is built from its name and
``scorer_fields`` (its own config fields; unset ones take its defaults). The wrapper never re-implements a score: it
calls ``scorer.prefill_attend`` and ``scorer.prefill_scores`` and selects over them. Its name is composed,
``adakv-snapkv``, and is what the job directory, the result key (``describe``) and the tables show; the key also holds
the scorer's resolved fields, so changing a scorer's default changes the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError
from kvbench.methods.base import Method, PrefillContext, scorer_names
from kvbench.methods.catalog import WRAPPERS, compose_method_name  # noqa: F401  (WRAPPERS: re-exported)
from kvbench.methods.decode_compression import (
    DecodeCompression,
    check_decode_compression,
    parse_decode_compression,
)

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


@dataclass
class ScorerWrapper(Method):
    """Base of the allocation wrappers: builds the scorer, delegates its prompt attention and scores."""

    name: ClassVar[str] = "scorer_wrapper"
    compression: ClassVar[str] = "prefill"
    scorer: str = "snapkv"
    scorer_fields: dict[str, Any] = field(default_factory=dict)
    #: compression during decode with the wrapper's own allocation over the scorer's scores
    #: (``methods.decode_compression``); left out of ``describe()`` when off
    decode_compression: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        from kvbench.methods.catalog import METHODS

        base = type(self).name
        if self.scorer not in METHODS.names():
            raise ConfigError(f"method {base!r}: scorer={self.scorer!r} is not a method; scorers: "
                              f"{', '.join(scorer_names())}")
        fields = dict(self.scorer_fields or {})
        if "decode_compression" in fields:
            raise ConfigError(f"method {base!r}: scorer_fields.decode_compression is the wrapper's own field; set "
                              f"method.decode_compression instead")
        self._scorer: Method = METHODS.build(self.scorer, fields)
        if not self._scorer.scores_available():
            raise ConfigError(f"method {base!r}: scorer={self.scorer!r} (with {fields or 'its defaults'}) exposes no "
                              f"per-entry prefill scores; scorers: {', '.join(scorer_names())}")
        # the scorer's resolved fields: the key changes when a scorer default does
        self.scorer_fields = {f.name: getattr(self._scorer, f.name) for f in dataclasses.fields(self._scorer)
                              if f.init and not f.name.startswith("_") and f.name != "decode_compression"}
        self.name = compose_method_name(base, self.scorer)
        self.decode_compression_spec()  # its one-line errors at build time

    def decode_compression_spec(self) -> DecodeCompression | None:
        return parse_decode_compression(self.name, self.decode_compression)

    def compress_decoded(self, layer: KVLayer, ctx: PrefillContext) -> None:
        self.prefill(layer, ctx)

    def scorer_must_keep(self, ctx: PrefillContext, row: int) -> int | None:
        """The scorer's must-keep count among row ``row``'s tokens (``Method.must_keep_count`` of its length), on the
        host: without padding or with left padding (the row's tokens its last ones: a window reaching into the padding
        keeps only its real tokens), else None (read from the scores)."""
        if ctx.key_valid is not None and not ctx.left_padded:
            return None
        return self._scorer.must_keep_count(ctx.host_ints()[0][row])

    def validate(self, budget: Budget) -> None:
        super().validate(budget)
        self._scorer.validate(budget)
        refusal = getattr(self._scorer, "decode_refusal", None)
        if self.decode_compression_spec() is not None and refusal is not None:
            raise ConfigError(f"method {self.name!r}: scorer {self.scorer!r} has no compression during decode: "
                              f"{refusal}; use decode_compression.interval=null")
        window = getattr(self._scorer, "observation_window", lambda: 0)()
        check_decode_compression(self, self.decode_compression_spec(), budget, window, self.min_budget_tokens())
        if hasattr(self._scorer, "check_decode_queries"):
            self._scorer.check_decode_queries(self.decode_compression_spec())

    def min_budget_tokens(self) -> int:
        return self._scorer.min_budget_tokens()

    def min_budget_reason(self) -> str:
        return f"scorer {self.scorer!r}: {self._scorer.min_budget_reason()}"

    def check_layers(self, num_layers: int) -> None:
        self._scorer.check_layers(num_layers)

    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        return self._scorer.prefill_attend(layer, ctx)

    def scorer_scores(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """The scorer's ``(B, H, n)`` scores of the layer (+inf kept, -inf padding), float32."""
        return self._scorer.prefill_scores(layer, ctx).float()

