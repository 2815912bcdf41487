"""Compression during decode for any method with a prefill score: the ``decode_compression`` field.

kvpress 0.5.5's ``DecodingPress`` / ``CompressionRatioDecodingPress`` (``kvpress/presses/decoding_press.py``), whose
semantics kvbench follows (tests/test_parity_kvpress_decoding.py pins the kept sets on kvpress's own outputs):

* every decode forward of a layer appends its queries to the layer's buffer and counts one step; when the count
  reaches ``interval`` (or a forward feeds at least the target's number of tokens at once) the layer is compressed and
  the count and the buffer are reset;
* a compression scores every entry the layer holds (the prompt's kept entries and the generated ones) with the
  method's own prefill score, the buffered queries standing for the prompt's queries (SnapKV's observation window is
  the newest of them), and keeps ``target`` entries: ``target_size``, or ``max(1, int(seen * (1 - compression_ratio)))``
  of the ``seen`` tokens so far (``CompressionRatioDecodingPress``), or by default the job's budget for ``seen``
  tokens; a layer holding no more than that is left as it is;
* the buffer keeps the last ``query_buffer`` steps' queries between steps (kvpress's ``hidden_states_buffer_size``), so
  a compression scores with ``min(steps since the last one, query_buffer + 1)`` queries (kvpress trims after appending).

The engine (``engine.decode_compression``) keeps the buffers and counts and calls the method's
``compress_decoded``; the method never sees a step it does not compress. Off (``interval: null``) it is left out of
``describe()``, so results stored before it existed keep their key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbench.errors import ConfigError

if TYPE_CHECKING:
    from kvbench.budget import Budget

#: the keys of ``method.decode_compression`` (conf/method/<scorer>.yaml) with their defaults
FIELDS = {"interval": None, "target_size": None, "compression_ratio": None, "query_buffer": 128}


@dataclass(frozen=True)
class DecodeCompression:
    """``method.decode_compression`` parsed: compress every ``interval`` decode steps to ``target_size`` entries (or
    to ``1 - compression_ratio`` of the tokens seen, or to the budget), scoring with ``query_buffer`` (+1) queries."""

    interval: int
    target_size: int | None = None
    compression_ratio: float | None = None
    query_buffer: int = 128

    def target(self, seen: int, budget: Budget) -> int:
        """Entries a layer keeps at a compression after ``seen`` tokens (prompt and generated)."""
        if self.target_size is not None:
            return self.target_size
        if self.compression_ratio is not None:
            return max(1, int(seen * (1 - self.compression_ratio)))
        return budget.tokens_for(seen)

    def min_queries(self) -> int:
        """The fewest buffered queries a compression scores with (the first compression's, or any)."""
        return min(self.interval, self.query_buffer + 1)


def _int(method: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"method {method!r}: decode_compression.{key}={value!r} must be an integer >= {minimum}")
    return value


def parse_decode_compression(method: str, value: Any) -> DecodeCompression | None:
    """The field as configured (None or a mapping of ``FIELDS``) -> a ``DecodeCompression``, or None when off
    (``interval`` null). Bad keys or values: ConfigError in one line naming them and the valid ones."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"method {method!r}: decode_compression={value!r} must be a mapping with keys "
                          f"{', '.join(FIELDS)}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise ConfigError(f"method {method!r}: decode_compression has no key(s) {', '.join(unknown)}; valid: "
                          f"{', '.join(FIELDS)}")
    cfg = {**FIELDS, **value}
    if cfg["interval"] is None:
        for key in ("target_size", "compression_ratio"):
            if cfg[key] is not None:
                raise ConfigError(f"method {method!r}: decode_compression.{key}={cfg[key]!r} needs "
                                  "decode_compression.interval (null: no compression during decode)")
        return None
    interval = _int(method, "interval", cfg["interval"], 1)
    buffer = _int(method, "query_buffer", cfg["query_buffer"], 0)
    target = cfg["target_size"]
    if target is not None:
        target = _int(method, "target_size", target, 1)
    ratio = cfg["compression_ratio"]
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ConfigError(f"method {method!r}: decode_compression.compression_ratio={ratio!r} must be a number "
                              "in [0, 1) (the fraction of the tokens seen that is removed)")
        ratio = float(ratio)
    if target is not None and ratio is not None:
        raise ConfigError(f"method {method!r}: decode_compression sets both target_size={target} and "
                          f"compression_ratio={ratio}; set one (null: the job's budget)")
    return DecodeCompression(interval, target, ratio, buffer)


def describe_decode_compression(spec: DecodeCompression | None) -> dict | None:
    """What ``describe()`` records (None: off, left out of the key)."""
    if spec is None:
        return None
    return {"interval": spec.interval, "target_size": spec.target_size, "compression_ratio": spec.compression_ratio,
            "query_buffer": spec.query_buffer}


def check_decode_compression(method: Any, spec: DecodeCompression | None, budget: Budget, window: int,
                             min_tokens: int) -> None:
    """The checks a configured decode compression needs against the job (ConfigError in one line): a finite budget
    (the method acts only under one), enough buffered queries for the method's observation window (``window``: a
    compression must score with more queries than it, as kvpress's SnapKV asserts), a target holding the method's
    minimum (``min_tokens``)."""
    if spec is None:
        return
    name = method.name
    if budget.is_full:
        raise ConfigError(f"method {name!r}: decode_compression needs a finite budget (the method does not act under "
                          "budget=full); give budget=<tokens or ratio>")
    if spec.min_queries() <= window:
        raise ConfigError(f"method {name!r}: decode_compression scores with min(interval={spec.interval}, "
                          f"query_buffer+1={spec.query_buffer + 1}) = {spec.min_queries()} queries, not more than its "
                          f"observation window of {window}; raise interval and query_buffer above {window}")
    if spec.target_size is not None and spec.target_size < min_tokens:
        raise ConfigError(f"method {name!r}: decode_compression.target_size={spec.target_size} is below the "
                          f"{min_tokens} tokens it needs ({method.min_budget_reason()})")

