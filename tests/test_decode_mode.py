"""engine.decode: how a job's decode steps run, resolved at plan time, before any model loads.

``graph`` (one captured step per token, kvbench/engine/graph.py), ``eager`` (the host-driven path), ``auto`` (graph on
CUDA where the job can take it, eager elsewhere); ``engine.compile=true`` is ``graph``. A graph the job cannot take is
refused in one line naming why and what to use; ``auto`` falls back with one log line. The resolved mode is in the job
key only when it is ``graph`` (so every result stored before the option keeps its hash).
"""

from __future__ import annotations

import logging

import pytest
from hydra import compose, initialize_config_dir

from kvbench.config import CONF_DIR, register_resolvers
from kvbench.errors import ConfigError
from kvbench.jobs import plan as plan_module
from kvbench.jobs.plan import plan_job
from kvbench.store import config_hash


def _cfg(*overrides: str):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def on_cuda(monkeypatch):
    """Plan as if torch saw a CUDA device (the model's device=auto resolves to cuda)."""
    import kvbench.models

    monkeypatch.setattr(kvbench.models, "resolve_device", lambda device: "cuda")


def test_auto_is_eager_on_a_cpu_and_keeps_the_key():
    job = plan_job(_cfg("model=tiny-random"))
    assert job.decode == "eager" and "engine_compile" not in job.key
    assert config_hash(plan_job(_cfg("model=tiny-random", "engine.decode=eager")).key) == config_hash(job.key)


def test_graph_and_compile_are_one_setting():
    graph = plan_job(_cfg("model=tiny-random", "engine.decode=graph"))
    compiled = plan_job(_cfg("model=tiny-random", "engine.compile=true"))
    assert graph.decode == compiled.decode == "graph"
    assert graph.key["engine_compile"] is True and config_hash(graph.key) == config_hash(compiled.key)


@pytest.mark.parametrize(("overrides", "message"), [
    (("engine.decode=fast",), "engine.decode='fast' is not valid; valid: auto, graph, eager"),
    (("engine.compile=true", "engine.decode=eager"), "engine.compile=true is engine.decode=graph; it contradicts"),
    (("engine.decode=graph", "method=sirllm", "method.entropy=official_code"),
     "engine.decode=graph: method 'sirllm' has no captured decode step .*; use engine.decode=eager"),
    (("engine.compile=true", "method=omnikv", "method.offload=always"),
     "engine.compile=true: method 'omnikv' has no captured decode step .*; use engine.compile=false"),
    (("engine.decode=graph", "task=pg19"), "task 'pg19' runs its own forwards"),
    (("engine.decode=graph", "position_mode=compact", "method=streamingllm"), "position_mode=compact re-rotates"),
])
def test_a_graph_the_job_cannot_take_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        plan_job(_cfg("model=tiny-random", *overrides))
    assert "\n" not in str(refused.value)


def test_auto_captures_on_cuda_where_the_job_can(on_cuda, caplog):
    assert plan_job(_cfg("model=tiny-random", "method=snapkv")).decode == "graph"
    assert plan_job(_cfg("model=tiny-random", "method=fullkv")).decode == "graph"
    assert plan_job(_cfg("model=tiny-random", "method=adakv")).decode == "graph"  # its ragged layers as padded slots
    with caplog.at_level(logging.INFO, logger="kvbench"):
        sirllm = plan_job(_cfg("model=tiny-random", "method=sirllm", "method.entropy=official_code"))
    assert sirllm.decode == "eager" and "engine_compile" not in sirllm.key
    lines = [r.getMessage() for r in caplog.records if "engine.decode=auto" in r.getMessage()]
    assert len(lines) == 1 and "method 'sirllm' has no captured decode step" in lines[0]
    assert plan_job(_cfg("model=tiny-random", "method=cam")).decode == "graph"  # its merge step is captured too
    assert plan_job(_cfg("model=tiny-random", "method=sirllm")).decode == "graph"  # the paper's surprisal too
    for override in ("budget=128", "method.allocation=paper", "budget=0.5"):  # W per prompt: a device value
        assert plan_job(_cfg("model=tiny-random", "method=pyramidinfer", override)).decode == "graph"
    assert plan_job(_cfg("model=tiny-random", "task=pg19")).decode == "eager"
    assert plan_job(_cfg("model=tiny-random", "task=longbench_v2", "task.cot=true")).decode == "eager"
    assert plan_job(_cfg("model=tiny-random", "task=longbench_v2", "task.cot=false")).decode == "graph"
    # compression during decode: captured with a fixed target, host-driven (one line) with one that grows
    decoding = ("method=snapkv", "budget=128", "method.decode_compression.interval=64")
    assert plan_job(_cfg("model=tiny-random", *decoding)).decode == "graph"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvbench"):
        ratio = plan_job(_cfg("model=tiny-random", *decoding, "budget=0.5"))
    lines = [r.getMessage() for r in caplog.records if "engine.decode=auto" in r.getMessage()]
    assert ratio.decode == "eager" and len(lines) == 1 and "budget=0.5 is a ratio" in lines[0]
    assert plan_job(_cfg("model=tiny-random", "question=after_compression", "task=passkey")).decode == "eager"


def test_the_reasons_are_the_methods_own():
    """The refusal text comes from the method contract (``static_refusal``), so the plan names no method."""
    import inspect

    source = inspect.getsource(plan_module._no_graph)
    for name in ("cam", "roco", "quest", "d2o", "omnikv"):
        assert f'"{name}"' not in source and f"'{name}'" not in source


def _local_model(tmp_path, **config) -> str:
    """A model directory holding only its config.json (a plan reads nothing else before loading)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "num_hidden_layers": 4, **config}))
    return f"model.path={tmp_path}"


def test_a_method_inside_sliding_windows_is_known_from_the_config_before_loading(tmp_path, on_cuda, caplog):
    """A model whose every layer slides (Mistral v0.1's 4096 window: sliding_layers=auto lets methods act inside the
    windows) cannot decode a method in the captured step: ``auto`` decodes host-driven with one line and ``graph``
    is refused in one line, both from the model's config.json, before any weight loads (before: the session refused
    after the model had loaded, naming engine.compile=true, which the user had not typed). FullKV, and a method
    left outside the windows (sliding_layers=window) or on a model without windows, capture."""
    sliding = _local_model(tmp_path, sliding_window=4096)
    base = ("model=mistral-7b-instruct-v0.1", sliding)
    with caplog.at_level(logging.INFO, logger="kvbench"):
        job = plan_job(_cfg(*base, "method=snapkv"))
    lines = [r.getMessage() for r in caplog.records if "engine.decode=auto" in r.getMessage()]
    assert job.decode == "eager" and len(lines) == 1 and "slides on 4 of its 4 layers" in lines[0]
    with pytest.raises(ConfigError, match="engine.decode=graph: model 'mistral-7b-instruct-v0.1' slides on 4 of its "
                                          "4 layers and sliding_layers=auto") as refused:
        plan_job(_cfg(*base, "method=snapkv", "engine.decode=graph"))
    assert "\n" not in str(refused.value)
    assert plan_job(_cfg(*base, "method=fullkv")).decode == "graph"
    assert plan_job(_cfg(*base, "method=snapkv", "sliding_layers=window")).decode == "graph"
    assert plan_job(_cfg("model=mistral-7b-instruct-v0.1", _local_model(tmp_path, sliding_window=None),
                         "method=snapkv")).decode == "graph"
