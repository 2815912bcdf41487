"""Every architecture kvbench accepts is unchanged by the harness, and every method acts on it as the policy says.

Tiny random models of each family (``helpers.tiny_family``: sliding window 64, prompts of 300 tokens): FullKV equals
transformers' own generation token for token and logit for logit, beyond the window; a sliding layer's cache is the
model's (at most ``window - 1`` entries between forwards); methods compress the full-attention layers and leave the
sliding ones to their window (``sliding_layers=auto`` on hybrid models), or compress inside the window; no sliding
layer ever keeps a token it cannot attend to; Falcon and InternLM2, whose attention kvbench cannot reach, are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from helpers import FAMILIES, SLIDING_FAMILIES, WINDOW, tiny_family
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, KVCache, cache_kwargs, greedy_generate
from kvbench.engine.architecture import layer_attention
from kvbench.errors import CompressionInactiveError, ConfigError, NotAvailableError
from kvbench.methods import METHODS, build_method

pytestmark = pytest.mark.compat

NOT_ON_CPU = {"cla", "lococo", "offload"}
# KVzip: full-attention layers only and its own repeat prompt (a tokenizer); covered by test_method_matrix and
# test_parity_kvpress_kvzip (not run on the sliding-window families here)
# TriAttention: one kept set for every layer of the model, from statistics of every layer (its authors' code compresses
# all layers alike): a model whose sliding layers are left to their window is refused (tests/test_method_triattention)
NOT_ON_SLIDING = {"kvzip", "triattention"}
RUNNABLE = sorted(set(METHODS.names()) - NOT_ON_CPU - NOT_ON_SLIDING)
N = 300  # prompt tokens: beyond every window


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, family):
    if family not in models:
        models[family] = tiny_family(family)
    return models[family]


def _prompt(n=N, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _stepwise_logits(model, prompt, steps, cache):
    """Last-position logits of the prompt and of ``steps`` greedy steps through ``cache``."""
    out = model(torch.tensor([prompt]), **cache_kwargs(model, cache), use_cache=True)
    logits = [out.logits[0, -1].float()]
    for t in range(steps):
        token = logits[-1].argmax().view(1, 1)
        pos = torch.tensor([[len(prompt) + t]])
        out = model(token, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


# ---- FullKV is the model ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_fullkv_equals_plain_generate_beyond_the_window(models, family):
    model = _model(models, family)
    prompt = _prompt()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, N:]
    full = Budget.parse(None)
    with CompressionSession(model, build_method({"name": "fullkv"}, full), full):
        out = greedy_generate(model, [prompt], 16, [], 0)
        ours = _stepwise_logits(model, prompt, 16, KVCache())
    plain = _stepwise_logits(model, prompt, 16, DynamicCache(config=model.config))
    assert out.tokens[0] == ref.tolist()
    assert (ours - plain).abs().max() < 1e-4  # logit for logit, not only the argmax


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_fullkv_inside_model_generate_with_the_models_own_cache(models, family):
    """``model.generate`` builds DynamicCache(config): its sliding layers become kvbench's, bounded the same way."""
    model = _model(models, family)
    prompt = _prompt(seed=2)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        full = Budget.parse(None)
        with CompressionSession(model, build_method({"name": "fullkv"}, full), full):
            ours = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours.tolist() == ref.tolist()


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_fullkv_cache_is_the_models_cache(models, family):
    """A sliding layer holds at most window - 1 entries between forwards, as DynamicSlidingWindowLayer does: FullKV's
    resident bytes are transformers' own."""
    model = _model(models, family)
    prompt = _prompt()
    full = Budget.parse(None)
    with CompressionSession(model, build_method({"name": "fullkv"}, full), full) as session:
        cache = KVCache()
        _stepwise_logits(model, prompt, 3, cache)
    plain = DynamicCache(config=model.config)
    _stepwise_logits(model, prompt, 3, plain)
    ours = [layer.keys.shape[-2] for layer in cache.layers]
    theirs = [layer.keys.shape[-2] for layer in plain.layers]
    assert ours == theirs
    windows = [session.layer_specs[i].window for i in range(len(ours))]
    assert ours == [N + 3 if w is None else w - 1 for w in windows]
    assert cache.resident_bytes() == sum(layer.keys.numel() * 4 * 2 for layer in plain.layers)


def test_padded_batch_on_a_hybrid_model_equals_each_prompt_alone(models):
    model = _model(models, "gemma3")
    long, short = _prompt(300, 3), _prompt(173, 4)
    full = Budget.parse(None)
    with CompressionSession(model, build_method({"name": "fullkv"}, full), full):
        both = greedy_generate(model, [long, short], 10, [], 0)
        alone = [greedy_generate(model, [p], 10, [], 0).tokens[0] for p in (long, short)]
    assert both.tokens == alone


# ---- methods on sliding layers ---------------------------------------------------------------------------------------
def _within_window(cache, session):
    for idx, layer in enumerate(cache.layers):
        window = session.layer_specs[idx].window
        if window is None:
            continue
        positions, valid = layer.position_view()  # either layout (AdaKV's ragged heads)
        latest = int(positions.max())
        positions = positions if valid is None else positions[valid]
        assert int(positions.min()) >= latest - window + 2, f"layer {idx} keeps a token beyond its window"


@pytest.mark.parametrize("method", RUNNABLE)
@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_every_method_runs_and_holds_the_arithmetic(models, family, method):
    """gemma3 is hybrid (auto -> window: the method compresses layer 2 only, sliding layers keep their window);
    mistral slides everywhere (auto -> compress: the method compresses inside every window, budget <= 63)."""
    model = _model(models, family)
    budget = max(48, METHODS.build(method, {}).min_budget_tokens())
    b = Budget.parse(None if method == "fullkv" else budget)
    if method == "omnikv" and family == "gemma3":  # one compressed layer: no room for a filter and a sparse layer
        with pytest.raises(ConfigError, match="leave no sparse layer"):
            with CompressionSession(model, build_method({"name": method}, b), b):
                pass
        return
    m = build_method({"name": method, **({"filter_layers": [0]} if method == "omnikv" else {})}, b)
    cache = KVCache()
    with CompressionSession(model, m, b) as session, torch.inference_mode():
        _stepwise_logits(model, _prompt(), 3, cache)
    assert session.compressed == ([2] if family == "gemma3" else [0, 1, 2, 3])
    entries = [layer.num_entries for layer in cache.layers]
    resident = cache.resident_bytes()
    held = [(layer.keys, layer.values) + ((layer.ragged.keys, layer.ragged.values) if layer.ragged else ())
            for layer in cache.layers]  # a ragged layer: its flat entries and its appended tail
    assert resident == sum(t.numel() for tensors in held for t in tensors) * 4
    _within_window(cache, session)
    for idx, count in enumerate(entries):
        window = session.layer_specs[idx].window
        if window is not None:
            assert count <= window - 1
    if method in ("fullkv", "pod", "quest", "omnikv", "infllm"):  # keep everything the model keeps
        assert entries == [N + 3 if session.layer_specs[i].window is None else WINDOW - 1 for i in range(4)]
    elif family == "gemma3":  # sliding layers: their window; the full layer: the budget (+ appended steps)
        assert [entries[i] for i in (0, 1, 3)] == [WINDOW - 1] * 3
        if method == "adakv":  # heads keep different numbers: the layer is as long as its longest head
            assert budget <= float(cache.layers[2].valid_counts().float().mean()) <= budget + 3 <= entries[2] + 3
        elif method == "chunkkv":  # whole chunks: at most the budget (here the window and no whole chunk)
            assert entries[2] <= budget + 3
        else:
            assert budget <= entries[2] <= budget + 3
    else:  # inside every window: never beyond it, and the budget on average (per-layer allocations vary)
        if method == "adakv":  # valid entries per head hold the budget; the longest head sets the allocated length
            entries = [float(layer.valid_counts().float().mean()) for layer in cache.layers]
        assert sum(entries) <= 4 * (min(budget, WINDOW - 1) + 3) < 4 * (WINDOW - 1)


def test_sliding_layers_compress_on_a_hybrid_model(models):
    model = _model(models, "gemma3")
    b = Budget.parse(40)
    cache = KVCache()
    with CompressionSession(model, build_method({"name": "snapkv"}, b), b, sliding_layers="compress") as session:
        _stepwise_logits(model, _prompt(), 2, cache)
    assert session.compressed == [0, 1, 2, 3]
    # SnapKV is prefill-only: every layer appends the steps; sliding layers drop what left the window
    assert [layer.num_entries for layer in cache.layers] == [42, 42, 42, 42]
    _within_window(cache, session)


def test_window_policy_on_a_model_that_only_slides_is_refused(models):
    model = _model(models, "mistral")
    b = Budget.parse(40)
    with pytest.raises(ConfigError, match="sliding_layers=window leaves method 'snapkv' no layer to compress"):
        with CompressionSession(model, build_method({"name": "snapkv"}, b), b, sliding_layers="window"):
            pass


def test_per_layer_allocations_spread_the_budget_over_the_layers_they_compress(models):
    """PyramidKV on gemma2 (layers 1 and 3 full): its schedule runs over 2 layers, their entries sum to 2 x budget."""
    model = _model(models, "gemma2")
    b = Budget.parse(40)
    cache = KVCache()
    with CompressionSession(model, build_method({"name": "pyramidkv"}, b), b) as session:
        with torch.inference_mode():
            model(torch.tensor([_prompt()]), **cache_kwargs(model, cache), use_cache=True)
    assert session.compressed == [1, 3]
    entries = [layer.num_entries for layer in cache.layers]
    assert entries[0] == entries[2] == WINDOW - 1
    assert entries[1] + entries[3] == 2 * 40 and entries[1] > entries[3]


# ---- the engine's reading of a layer is checked against the model's own mask ----------------------------------------
def test_a_misread_window_is_a_loud_error(models, monkeypatch):
    """Llama ignores ``config.sliding_window``; were kvbench to read it as a window, the model's mask (full causal)
    would contradict it at the first prompt longer than the window."""
    from kvbench.engine import architecture

    model = _model(models, "llama")
    model.config.sliding_window = WINDOW
    try:
        assert layer_attention(model.config, model.model.layers[0].self_attn).window is None
        monkeypatch.setattr(architecture, "CONFIG_WIDE_WINDOW", architecture.CONFIG_WIDE_WINDOW | {"llama"})
        full = Budget.parse(None)
        model.set_attn_implementation("eager")  # eager materialises the mask the check reads
        with pytest.raises(CompressionInactiveError, match="reads attention layer 0 of LlamaForCausalLM as sliding64"):
            with CompressionSession(model, build_method({"name": "fullkv"}, full), full):
                greedy_generate(model, [_prompt()], 2, [], 0)
    finally:
        model.config.sliding_window = None
        model.set_attn_implementation("sdpa")


# ---- architectures outside the attention interface -------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fullkv", "snapkv"])
def test_falcon_is_never_run_uncompressed(method):
    """Falcon attends inline (F.scaled_dot_product_attention): kvbench's attention never runs there."""
    model = tiny_family("falcon")
    b = Budget.parse(None if method == "fullkv" else 48)
    with pytest.raises(CompressionInactiveError, match="not attached to attention layer"):
        with CompressionSession(model, build_method({"name": method}, b), b):
            greedy_generate(model, [_prompt(100)], 2, [], 0)


@pytest.mark.parametrize(("model_type", "reason"), [("falcon", "outside transformers' AttentionInterface"),
                                                     ("internlm2", "convert2llama.py")])
def test_unreachable_architectures_are_refused_before_any_weight_loads(tmp_path, model_type, reason):
    from kvbench.models import load_model, spec_from_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    spec = spec_from_config({"name": "x", "source": "hf", "path": str(tmp_path), "device": "cpu"})
    with pytest.raises(NotAvailableError, match=reason):  # no weights in the directory: refused before reading them
        load_model(spec)


def test_a_selection_method_attending_everything_is_caught_on_a_hybrid_model(models, monkeypatch):
    """The attention check averages the layers the method compresses: sliding layers (which attend their window, far
    fewer than the prompt) must not hide a selection method that attends everything where it acts."""
    from kvbench.methods.quest import Quest

    model = _model(models, "gemma3")
    monkeypatch.setattr(Quest, "select", lambda self, layer, ctx: None)
    b = Budget.parse(64)
    with pytest.raises(CompressionInactiveError, match="attended to 301 entries"):
        with CompressionSession(model, build_method({"name": "quest", "dense_layers": 0}, b), b):
            greedy_generate(model, [_prompt()], 4, [], 0)


def test_a_refused_architecture_leaves_no_job_behind(tmp_path):
    """The job stops at the model's loading with one line; its directory (config, meta, lock) is not left empty."""
    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import run_job

    model_dir = tmp_path / "falcon"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=falcon-7b", f"model.path={model_dir}", "model.device=cpu", "model.dtype=float32", "task=passkey",
            "task.context_lengths=[256]", "task.depths=[50]", "print_table=false", f"paths.results_dir={tmp_path}"])
    with pytest.raises(NotAvailableError, match="'falcon' model"):
        run_job(cfg)
    assert not list(tmp_path.glob("runs/*/*/*/*/*"))


# (OmniKV's and ThinK's depend on their fields: a property, left out here)
OWN_ATTENTION = sorted(name for name in set(METHODS.names()) - NOT_ON_CPU
                       if METHODS.get_class(name).own_attention is True)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_a_method_computing_attention_itself_is_refused_where_the_model_caps_or_sinks_it(models, family):
    """CaM, RoCo, LM-Infinite, POD, PyramidInfer and InfLLM compute (part of) the attention themselves, as plain
    softmax attention: on Gemma 2 (logit soft-cap) and GPT-OSS (sink logits) that is not the model's attention, so the
    session refuses them in one line before any forward (before, they ran and reported another attention under their
    name). Methods that score with the model's attention run (SnapKV, H2O)."""
    from helpers import ByteTokenizer

    model = _model(models, family)
    assert {"cam", "roco", "lminfinite", "pod", "pyramidinfer", "infllm"} <= set(OWN_ATTENTION)
    b = Budget.parse(64)
    for name in OWN_ATTENTION:
        with pytest.raises(NotAvailableError, match=f"method '{name}' computes attention itself") as refused:
            with CompressionSession(model, build_method({"name": name}, b), b, tokenizer=ByteTokenizer()):
                pytest.fail("no refusal")
        assert "\n" not in str(refused.value)
        assert ("soft-cap" if family == "gemma2" else "sink logits") in str(refused.value)
    with pytest.raises(NotAvailableError, match="method 'think' computes attention itself"):  # its inner method's
        with CompressionSession(model, build_method({"name": "think", "inner": {"name": "roco"}}, b), b):
            pass
    for name in ("snapkv", "h2o"):
        with CompressionSession(model, build_method({"name": name}, b), b):
            greedy_generate(model, [_prompt()], 3, [], 0)
