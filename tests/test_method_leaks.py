"""A method holds nothing of a finished sample: the KVLayers of a sample die with it (issue: ``functools.cache`` on
DynamicKV's ``expand_to_query_heads`` kept every KVLayer of a long job alive)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.methods.d2o import D2O
from kvbench.methods.dynamickv import DynamicKV


def _prompt(n, seed):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("method", [DynamicKV(granularity="query_head"), DynamicKV(),
                                    D2O(granularity="query_head"), D2O(variant="official_code", bug_compat=True)],
                         ids=["dynamickv_query_head", "dynamickv", "d2o_query_head", "d2o_bug_compat"])
def test_layers_of_a_finished_sample_are_freed(toy_llama, method):
    refs: list[list[weakref.ref]] = []
    real_finish = method.finish_prefill

    def finish(layers, ctx):
        real_finish(layers, ctx)
        refs.append([weakref.ref(layer) for layer in layers])

    method.finish_prefill = finish
    try:
        for sample in range(2):
            with CompressionSession(toy_llama, method, Budget.parse(24)):
                greedy_generate(toy_llama, [_prompt(120, sample)], 4, [], 0)
            if sample == 0:
                gc.collect()
                assert [r() for r in refs[0]] == [None] * 3, "a finished sample's KVLayers are still alive"
    finally:
        del method.finish_prefill
    gc.collect()
    assert len(refs) == 2 and all(r() is None for rs in refs for r in rs)
