"""The scorer base (``methods.scorer.ScorerMethod``): a method that only defines ``score`` runs through the engine like
the real scorers; the shared helpers live outside any method's file; composed names are split in one place
(``methods.catalog.parse_method_name``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from helpers import kept_positions, make_layer, prefill_ctx
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, KVCache, cache_kwargs
from kvbench.errors import ConfigError
from kvbench.methods import METHODS, build_method
from kvbench.methods.base import scorer_names
from kvbench.methods.catalog import WRAPPERS, compose_method_name, parse_method_name
from kvbench.methods.scorer import ScorerMethod


# ---- a new method that only scores: the whole of what a contributor writes ------------------------------------------
@dataclass
class ToyNorm(ScorerMethod):
    """Keep the keys with the smallest L2 norm (a toy: K-norm written against the scorer base)."""

    name: ClassVar[str] = "toy_norm"

    def score(self, layer, ctx):
        return -layer.keys.float().norm(dim=-1)  # (B, Hkv, n): higher is kept


TOY_ENTRY = f"{__name__}:ToyNorm"  # its line in methods/catalog.py's METHODS


def test_a_method_that_only_scores_is_under_30_lines_and_runs_through_the_engine(toy_llama, monkeypatch):
    assert len(inspect.getsource(ToyNorm).splitlines()) + 1 < 30  # the class and its registry line
    monkeypatch.setitem(METHODS.entries, "toy_norm", TOY_ENTRY)
    assert "toy_norm" in scorer_names()  # a scorer the wrappers (AdaKV, ChunkKV) may name
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(3))
    caches = {}
    for name, budget in (("fullkv", None), ("toy_norm", 20)):
        b = Budget.parse(budget)
        caches[name] = KVCache()
        with CompressionSession(toy_llama, build_method({"name": name}, b), b) as session:
            toy_llama(ids, **cache_kwargs(toy_llama, caches[name]), use_cache=True)
    assert session.stats.layer_entries_after_prefill == [20, 20, 20]
    for full, kept in zip(caches["fullkv"].layers, caches["toy_norm"].layers):
        norms = full.keys[0].norm(dim=-1)  # (Hkv, 60): the prompt's keys before eviction
        assert kept_positions(kept) == [sorted(norms[h].topk(20, largest=False).indices.tolist())
                                        for h in range(norms.shape[0])]
    wrapped = build_method({"name": "adakv", "scorer": "toy_norm"}, Budget.parse(20))
    assert wrapped.name == "adakv-toy_norm" and parse_method_name(wrapped.name) == ("adakv", "toy_norm")


def test_a_scorer_without_a_score_is_refused_when_defined():
    with pytest.raises(TypeError, match="Forgetful derives from ScorerMethod but does not implement score"):
        @dataclass
        class Forgetful(ScorerMethod):
            name: ClassVar[str] = "forgetful"


@dataclass
class PerQueryHead(ScorerMethod):
    """Scores each query head on its own (the last query's logits), leaving the KV group to the base."""

    name: ClassVar[str] = "per_query_head"

    def score(self, layer, ctx):
        keys = layer.keys.repeat_interleave(ctx.num_heads // layer.keys.shape[1], dim=1)
        return torch.einsum("bhd,bhnd->bhn", ctx.queries[:, :, -1], keys)  # (B, Hq, n)


@dataclass
class PerQueryHeadMax(PerQueryHead):
    name: ClassVar[str] = "per_query_head_max"

    def group_aggregation(self) -> str:
        return "max"


@pytest.mark.parametrize("how", ["mean", "max"])
def test_query_head_scores_are_reduced_over_each_kv_group(how):
    """The group's mean by default (kvpress's presses average a KV group), or what ``group_aggregation`` says."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 32, 8, generator=g) for h in (4, 2, 2))
    layer = make_layer(k, v)
    (PerQueryHead if how == "mean" else PerQueryHeadMax)().prefill(layer, prefill_ctx(q, layer, 10))
    logits = torch.einsum("hd,hnd->hn", q[0, :, -1], k[0].repeat_interleave(2, dim=0)).view(2, 2, 32)
    group = logits.mean(1) if how == "mean" else logits.amax(1)
    assert kept_positions(layer) == [sorted(group[h].topk(10).indices.tolist()) for h in range(2)]


@dataclass
class Windowed(ToyNorm):
    name: ClassVar[str] = "windowed"
    granularity: str = "kv_head"

    def observation_window(self) -> int:
        return 6


def test_the_base_keeps_the_observation_window_and_applies_granularity():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 32, 8, generator=g) for h in (4, 2, 2))
    layer = make_layer(k, v)
    Windowed().prefill(layer, prefill_ctx(q, layer, 10))
    past = (-k[0, :, :26].norm(dim=-1)).topk(4).indices  # top capacity - window of the older entries alone
    assert kept_positions(layer) == [sorted(past[h].tolist() + list(range(26, 32))) for h in range(2)]
    layer = make_layer(k, v)
    Windowed(granularity="query_head").prefill(layer, prefill_ctx(q, layer, 10))
    assert layer.keys.shape[:3] == (1, 4, 10)  # K/V repeated to the 4 query heads before selection
    assert Windowed().min_budget_tokens() == 7 and "window of 6 tokens" in Windowed().min_budget_reason()
    with pytest.raises(ConfigError, match="granularity='per_head' is not valid; valid: kv_head, query_head"):
        Windowed(granularity="per_head")
    short = make_layer(k[:, :, :5], v[:, :, :5])  # a prompt no longer than the window is all window: kept whole
    Windowed().prefill(short, prefill_ctx(q[:, :, :5], short, 3))
    assert kept_positions(short) == [list(range(5))] * 2


# ---- shared helpers out of the methods' files ------------------------------------------------------------------------
def test_shared_helpers_live_in_cache_ops_not_in_a_methods_file():
    import kvbench.methods.cache_ops as cache_ops
    import kvbench.methods.snapkv as snapkv

    assert not hasattr(snapkv, "to_query_heads") and not hasattr(snapkv, "GRANULARITY")
    for module in ("h2o", "cam", "streamingllm", "d2o", "dynamickv"):
        imported = __import__(f"kvbench.methods.{module}", fromlist=["GRANULARITY"])
        assert imported.GRANULARITY is cache_ops.GRANULARITY


# ---- composed names, split in one place ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, parsed", [
    ("adakv-snapkv", ("adakv", "snapkv")),
    ("chunkkv-expected_attention", ("chunkkv", "expected_attention")),
    ("adakv-some-scorer", ("adakv", "some-scorer")),  # split once: a scorer name holding a dash stays whole
    ("snapkv", (None, "snapkv")),  # no wrapper
    ("adakv", (None, "adakv")),  # the wrapper itself, as configured
    ("adakv-", (None, "adakv-")),  # no scorer: not a composed name
    ("snapkv-knorm", (None, "snapkv-knorm")),  # snapkv wraps nothing
    ("quest-x", (None, "quest-x")),
    ("", (None, "")),
])
def test_parse_method_name(name, parsed):
    assert parse_method_name(name) == parsed


def test_a_registered_name_with_a_dash_is_never_split(monkeypatch):
    monkeypatch.setitem(METHODS.entries, "adakv-special", TOY_ENTRY)
    assert parse_method_name("adakv-special") == (None, "adakv-special")
    assert parse_method_name(compose_method_name("adakv", "knorm")) == ("adakv", "knorm")
    assert set(WRAPPERS) == {"adakv", "chunkkv"}


def test_build_method_and_the_report_split_names_alike():
    from kvbench.report.store import method_defaults, method_key_omitted

    method = build_method({"name": "adakv-knorm", "scorer": "knorm"}, Budget.parse(16))  # a stored composed name
    assert type(method).name == "adakv" and method.name == "adakv-knorm"
    assert method_key_omitted("adakv-knorm") == {"allocation": "kvpress"} == method_key_omitted("adakv")
    assert method_defaults("adakv-knorm")["scorer"] == "knorm" and method_defaults("snapkv-knorm") is None
    assert method_key_omitted("snapkv-knorm") == {}
    with pytest.raises(ConfigError, match="'snapkv-knorm'"):
        build_method({"name": "snapkv-knorm"}, Budget.parse(16))
