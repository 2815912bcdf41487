"""docs/method_ambiguities.md says, per method, which reading is the default and which option gives the other one:
every option it names (``field=value`` in backticks) must be a field of the method the row is about, with a valid
value where the field has a fixed set of choices, so that the page cannot drift from the code."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest

from kvbench.methods import METHODS

DOC = Path(__file__).parents[1] / "docs" / "method_ambiguities.md"
SECTION = re.compile(r"^#{2,3} .*?`kvbench/methods/(\w+)\.py`", re.M)
OPTION = re.compile(r"`([^`]*)`")
ASSIGNMENT = re.compile(r"^([a-z_]+)=(\S+)$")


CONF = Path(__file__).parents[1] / "conf"
#: parameters of the authors' code the page quotes (not kvbench options): name -> whose
FOREIGN = {"offload_sid": "OmniKV's brutal_offload_llama.py", "keep_attention": "EasyKV's encoding loop"}


def _fields(name: str) -> set[str]:
    """The method's dataclass fields and its class-level switches (``supports_batching``)."""
    cls = METHODS.get_class(name)
    return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")} | {
        k for k in ("supports_batching", "needs_logits", "requires_training") if hasattr(cls, k)}


@functools.cache
def _config_keys() -> set[str]:
    """Top-level config values (``budget``, ``position_mode``) and task fields (``truncate_to``, ``cot``): rows name
    them where a method's reading depends on them."""
    from omegaconf import OmegaConf

    keys = set(OmegaConf.load(CONF / "config.yaml"))
    for path in (CONF / "task").glob("*.yaml"):
        keys |= set(OmegaConf.load(path))
    return keys


def _rows() -> list[tuple[str, str]]:
    """(method of the section, a table row or paragraph) for every line of the method sections."""
    text = DOC.read_text()
    starts = [(m.start(), m.group(1)) for m in SECTION.finditer(text)]
    out = []
    for (start, module), (end, _) in zip(starts, [*starts[1:], (len(text), "")]):
        method = module if module in METHODS.names() else None
        if method is None:
            continue
        out += [(method, line) for line in text[start:end].splitlines()[1:] if line.strip()]
    return out


def _named_methods(row: str) -> set[str]:
    return {token for token in OPTION.findall(row) if token in METHODS.names()} | {
        token.split()[0] for token in OPTION.findall(row) if token.split() and token.split()[0] in METHODS.names()}


def _options(row: str) -> list[tuple[str, str]]:
    out = []
    for token in OPTION.findall(row):
        for part in re.split(r",\s*|\s+", token):
            match = ASSIGNMENT.match(part)
            if match:
                out.append((match.group(1), match.group(2).rstrip(".;)")))
    return out


def test_the_page_names_the_methods_it_documents():
    methods = {method for method, _ in _rows()}
    assert {"d2o", "dynamickv", "omnikv", "kvmerger", "pod", "quest", "infllm", "cam", "roco", "sirllm"} <= methods


@pytest.mark.parametrize("method", sorted({m for m, _ in _rows()}))
def test_every_option_named_is_a_field_of_its_method(method):
    unknown = []
    for section, row in _rows():
        if section != method:
            continue
        owners = {method} | _named_methods(row)  # a row about a baseline names it: `h2o` `recent_ratio=0.5`
        for field, value in _options(row):
            if field in FOREIGN or field in _config_keys():
                continue
            if not any(field in _fields(owner) for owner in owners):
                unknown.append(f"{field}={value}")
    assert not unknown, f"{method}: options the page names that no method of the row has: {unknown}"


def test_the_check_catches_a_renamed_field():
    """The walker sees real options: D2O's `allocation=kvbench_zscore` is found, a made-up one is not a field."""
    d2o_rows = [row for method, row in _rows() if method == "d2o"]
    assert ("allocation", "kvbench_zscore") in [opt for row in d2o_rows for opt in _options(row)]
    assert "variance_norm" not in _fields("d2o")
