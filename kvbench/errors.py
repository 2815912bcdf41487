"""Errors kvbench reports to users as one clear line (exit code 2), never as a traceback."""

from __future__ import annotations

from collections.abc import Iterable


class KVBenchError(Exception):
    """Base class for errors that are the user's input, not a bug in kvbench."""

    exit_code = 2


class ConfigError(KVBenchError):
    """A configuration value is invalid: names the value and the valid choices."""


class NotAvailableError(KVBenchError):
    """Something the config asks for exists as configuration but is not implemented or not installed here."""


class DataError(KVBenchError):
    """Input data is missing or malformed."""


def invalid_choice(kind: str, value: object, choices: Iterable[str]) -> ConfigError:
    """`unknown method 'snapkvv'; valid methods: fullkv, h2o, ...`"""
    valid = ", ".join(sorted(str(c) for c in choices))
    return ConfigError(f"unknown {kind} {value!r}; valid {kind}s: {valid}")


class CompressionInactiveError(KVBenchError):
    """A method with a finite budget did not act on the model (no cache layer attached, or a prompt longer than the
    budget left uncompressed): the job stops rather than report FullKV numbers under the method's name."""
