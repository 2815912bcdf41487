"""Small builders shared by the tests (tensor-level method tests need no model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbench.engine.cache import KVLayer
from kvbench.methods.base import DecodeContext, PrefillContext
from kvbench.tasks.base import Sample, Task


def make_layer(keys: torch.Tensor, values: torch.Tensor) -> KVLayer:
    layer = KVLayer()
    layer.update(keys, values)
    return layer


def prefill_ctx(queries, layer, capacity, layer_idx=0, num_layers=1, key_valid=None) -> PrefillContext:
    b, hq, n, d = queries.shape
    prompt_lens = key_valid.sum(-1) if key_valid is not None else torch.full((b,), n)
    return PrefillContext(
        layer_idx=layer_idx, num_layers=num_layers, num_heads=hq, num_kv_heads=layer.keys.shape[1],
        scaling=d**-0.5, queries=queries, key_valid=key_valid, prompt_lens=prompt_lens,
        capacity=torch.full((b,), capacity) if isinstance(capacity, int) else capacity,
    )


def decode_step(method, layer: KVLayer, query, key, value, capacity: int):
    """Append one token and run the method's decode hook with exact attention probabilities, as the engine does."""
    from kvbench.engine.attention import grouped_attention

    layer.update(key, value)
    _, probs = grouped_attention(query, layer.keys, layer.values, None, query.shape[-1] ** -0.5)
    ctx = DecodeContext(layer_idx=0, num_layers=1, num_kv_heads=layer.keys.shape[1], query=query, probs=probs,
                        capacity=torch.full((query.shape[0],), capacity))
    method.decode(layer, ctx)


def kept_positions(layer: KVLayer, row: int = 0) -> list[list[int]]:
    """Sorted kept original positions per head of one row (either cache layout: ``KVLayer.position_view``)."""
    positions, valid = layer.position_view()
    out = []
    for h in range(positions.shape[1]):
        pos = positions[row, h]
        if valid is not None:
            pos = pos[valid[row, h]]
        out.append(sorted(int(p) for p in pos))
    return out


def softmax_row(q_vec, keys, upto, d):
    logits = torch.tensor([float(q_vec @ keys[j]) / math.sqrt(d) for j in range(upto + 1)], dtype=torch.float64)
    return torch.softmax(logits, 0)


def assert_same_up_to_ties(ours: list[int], ref: list[int], scores: dict[int, float], forced: set[int]):
    """Sets must be equal, except entries whose score ties the selection threshold exactly."""
    ours_s, ref_s = set(ours), set(ref)
    if ours_s == ref_s:
        return
    chosen = [scores[i] for i in ref_s - forced]
    threshold = min(chosen)
    for i in ours_s ^ ref_s:
        assert i not in forced and math.isclose(scores[i], threshold, rel_tol=1e-5, abs_tol=1e-7), (i, scores[i])


def snapkv_reference(q, k, capacity, window, kernel, pooling):
    """SnapKV paper procedure for one row, with Python loops: returns kept positions per KV head and the scores."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    prefix = n - window
    votes = [[0.0] * prefix for _ in range(hq)]
    for h in range(hq):
        for i in range(prefix, n):
            p = softmax_row(q[h, i], k[h // g], i, d)
            for j in range(prefix):
                votes[h][j] += float(p[j])
    r = kernel // 2
    pooled = []
    for h in range(hq):
        row = []
        for j in range(prefix):
            neighbours = votes[h][max(0, j - r) : min(prefix, j + r + 1)]
            row.append(max(neighbours) if pooling == "max" else sum(neighbours) / kernel)
        pooled.append(row)
    kept, all_scores = [], []
    for kv in range(hkv):
        agg = [sum(pooled[kv * g + x][j] for x in range(g)) / g for j in range(prefix)]
        top = sorted(range(prefix), key=lambda j: -agg[j])[: capacity - window]
        kept.append(sorted(top + list(range(prefix, n))))
        all_scores.append({j: agg[j] for j in range(prefix)})
    return kept, all_scores


@dataclass
class PerSampleLimitsTask(Task):
    """A toy task whose samples carry their own max_new_tokens (as LongBench's dataset2maxlen does)."""

    name: ClassVar[str] = "per_sample_limits"
    max_new_tokens: int = 50
    limits: list[int] = field(default_factory=lambda: [3, 9, 5])

    def samples(self, tokenizer: Any) -> list[Sample]:
        text = "The grass is green. The sky is blue. " * 20
        return [Sample(id=f"s{i}", prompt=text[: 300 + 40 * i], answers=["x"], max_new_tokens=limit)
                for i, limit in enumerate(self.limits)]

    def score(self, prediction: str, sample: Sample) -> float:
        return 0.0


@dataclass
class FlakyScorerTask(PerSampleLimitsTask):
    """PerSampleLimitsTask whose scorer raises for the ids in ``bad`` (a scorer bug or a malformed row)."""

    name: ClassVar[str] = "flaky_scorer"
    bad: list[str] = field(default_factory=lambda: ["s1"])

    def score(self, prediction: str, sample: Sample) -> float:
        if sample.id in self.bad:
            raise ValueError(f"cannot score {sample.id}")
        return 1.0


def run_job_in(results_dir, overrides: list[str]) -> tuple[dict, list[dict]]:
    """Compose the real configs with ``overrides``, run the job into ``results_dir``: its scores and records."""
    import json

    from hydra import compose, initialize_config_dir

    from kvbench.config import CONF_DIR, register_resolvers
    from kvbench.jobs import run_job

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"paths.results_dir={results_dir}",
                                                         "print_table=false"])
    scores = run_job(cfg)
    samples = next(results_dir.rglob("samples.jsonl")).read_text().splitlines()
    return scores, [json.loads(line) for line in samples]


# ---- tiny random models of each architecture family (tests/test_architectures.py) ------------------------------------
WINDOW = 64  # sliding window of the tiny families that have one: shorter than the test prompts
FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "mistral", "gemma2", "gemma3", "gpt_oss")
SLIDING_FAMILIES = ("qwen2", "phi3", "mistral", "gemma2", "gemma3", "gpt_oss")


def tiny_family(family: str, layers: int = 4):
    """A seeded random model of ``family`` (4 layers, 4 query / 2 KV heads, head_dim 16, vocab 256) with a sliding
    window of ``WINDOW`` where the family has one: Qwen2 slides from layer 2 on (max_window_layers), Phi-3 and
    Mistral on every layer, Gemma 2 and GPT-OSS alternate (GPT-OSS with learned sinks; both eager, as transformers
    runs them; Gemma 2 with logit soft-capping), Gemma 3 is hybrid (layer 2 full, the others sliding). Falcon is
    built too (multi-query), to show that kvbench refuses it."""
    import transformers as tr

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    pattern = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    builders = {
        "llama": (tr.LlamaConfig, tr.LlamaForCausalLM, dict(head_dim=16)),
        "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                           max_window_layers=2)),
        "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM, dict(head_dim=16)),
        "phi3": (tr.Phi3Config, tr.Phi3ForCausalLM, dict(sliding_window=WINDOW)),
        "mistral": (tr.MistralConfig, tr.MistralForCausalLM, dict(head_dim=16, sliding_window=WINDOW)),
        "gemma2": (tr.Gemma2Config, tr.Gemma2ForCausalLM, dict(head_dim=16, sliding_window=WINDOW,
                                                               layer_types=pattern, attn_implementation="eager")),
        "gemma3": (tr.Gemma3TextConfig, tr.Gemma3ForCausalLM, dict(
            head_dim=16, sliding_window=WINDOW,
            layer_types=["full_attention" if i == 2 else "sliding_attention" for i in range(layers)])),
        "gpt_oss": (tr.GptOssConfig, tr.GptOssForCausalLM, dict(head_dim=16, sliding_window=WINDOW, layer_types=pattern,
                                                                num_local_experts=4, num_experts_per_tok=2,
                                                                attn_implementation="eager")),
        "falcon": (tr.FalconConfig, tr.FalconForCausalLM, dict(multi_query=True, num_kv_heads=1)),
    }
    config_cls, model_cls, extra = builders[family]
    extra = dict(extra)
    impl = extra.pop("attn_implementation", "sdpa")
    config = config_cls(**{**common, **extra})
    config._attn_implementation = impl
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_cls(config)
    if family == "gpt_oss":  # sinks are created empty: give them values, or they are whatever memory held
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(1)
            for module in model.modules():
                if hasattr(module, "sinks"):
                    module.sinks.normal_()
    return model.eval().requires_grad_(False)


def load_gemma3_270m():
    """The embedded Gemma-3-270M (conf/model/gemma3-270m.yaml), or a skip where this transformers cannot convert it:
    releases before 5.23 build its tokenizer from the GGUF wrongly, and kvbench refuses to convert it with them (a
    copy converted by a newer release loads on any)."""
    import pytest
    from omegaconf import OmegaConf

    from kvbench.config import CONF_DIR
    from kvbench.errors import NotAvailableError
    from kvbench.models import load_model, spec_from_config

    try:
        return load_model(spec_from_config(OmegaConf.load(CONF_DIR / "model" / "gemma3-270m.yaml")))
    except NotAvailableError as exc:
        if "tokenizer from its GGUF file wrongly" not in str(exc):
            raise
        pytest.skip(str(exc))


class ByteTokenizer:
    """A stub tokenizer for methods that feed the model text of their own (KVzip's repeat prompt) on toy models: one id
    per UTF-8 byte in a 256-token vocabulary, no chat template (``scripts/parity/kvpress/cases.byte_encode``)."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + b % 250 for b in text.encode("utf-8")]


UNREACHABLE = "huggingface.co:443 cannot be reached: the test's reason"


def record_caches(monkeypatch) -> list:
    """Every ``KVCache`` the engine's generation loop builds from now on, appended to the returned list (the session's
    layers as the generation left them: kept positions, entry counts)."""
    from kvbench.engine import generate as generate_module
    from kvbench.engine.cache import KVCache

    caches: list = []

    class Recording(KVCache):
        def __init__(self):
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(generate_module, "KVCache", Recording)
    return caches


def hub_without_network(monkeypatch) -> list[tuple[str, tuple, dict]]:
    """A machine without the hub: ``kvbench.hub.hub_unreachable`` gives ``UNREACHABLE``; huggingface_hub's cache
    lookups (``local_files_only=True``) find nothing, and every network call (download, listing) is recorded in the
    returned list, which a loader that asks first leaves empty, and fails."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    network: list[tuple[str, tuple, dict]] = []

    def fake(name: str):
        def call(*args, **kwargs):
            if kwargs.get("local_files_only"):
                raise LocalEntryNotFoundError("not in the test's hub cache")
            network.append((name, args, kwargs))
            raise OSError(f"the test forbids the network ({name})")
        return call

    for name in ("hf_hub_download", "list_repo_files", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, fake(name))
    monkeypatch.setattr("kvbench.hub.hub_unreachable", lambda *a, **k: UNREACHABLE)
    return network


# ---- TriAttention's calibrated statistics for a test model -----------------------------------------------------------
def triattention_stats(model) -> str:
    """A statistics file in the authors' format (``pruning_utils.save_head_frequency_stats``) for ``model``'s shape
    (every layer and query head, seeded random means with ``E|q| >= |E q|``), written once per shape under the temp
    dir: the method's field ``stats_path`` for models without a calibrated file (SmolLM2-135M has one:
    ``tests/fixtures/triattention/smollm2-135m.pt``)."""
    import tempfile
    from pathlib import Path

    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    path = Path(tempfile.gettempdir()) / f"kvbench-triattention-{layers}x{heads}x{head_dim}.pt"
    if not path.exists():
        g = torch.Generator().manual_seed(layers * 1000 + heads * 10 + head_dim)
        stats = {}
        for layer in range(layers):
            for head in range(heads):
                real, imag = torch.randn(head_dim // 2, generator=g), torch.randn(head_dim // 2, generator=g)
                stats[f"layer{layer:02d}_head{head:02d}"] = {
                    "q_mean_real": real, "q_mean_imag": imag,
                    "q_abs_mean": torch.complex(real, imag).abs() + torch.rand(head_dim // 2, generator=g)}
        meta = {"head_dim": head_dim, "rope_style": "half", "rope_type": "default",
                "sampled_heads": [[layer, head] for layer in range(layers) for head in range(heads)]}
        tmp = path.with_suffix(f".{id(path)}.tmp")
        torch.save({"metadata": meta, "stats": stats}, tmp)
        tmp.replace(path)
    return str(path)


def method_fields(name: str, model) -> dict:
    """Fields a method needs for ``model`` beyond its defaults (TriAttention's statistics file)."""
    return {"stats_path": triattention_stats(model)} if name == "triattention" else {}
