"""What kvbench's decode is measured against in the same run: plain transformers (the peer) and the bandwidth floor.

**The peer** is what a user would run instead of kvbench: ``model.generate`` with greedy decoding, on the same
weights (the bench's loaded model, outside any ``CompressionSession``) and the same prompts as the bench's cells
(``measure.prompts_for``). Two peers:

* ``transformers_dynamic``: transformers' default cache (``DynamicCache``), eager forward;
* ``transformers_static_compiled``: ``cache_implementation="static"``. In transformers 5.x ``generate`` then compiles
  the decode forward itself (``GenerationMixin._valid_auto_compile_criteria`` + ``get_compiled_call``: a
  ``torch.compile`` of the model's ``__call__`` with ``CompileConfig()``'s defaults, ``mode="reduce-overhead"``, i.e.
  CUDA graphs, ``fullgraph=False``; the prefill stays eager). Passing a ``compile_config`` changes nothing on CUDA
  unless it changes those options, but transformers compiles only on cuda / xpu / neuron / tpu: on any other device
  (the CPU) the bench sets ``CompileConfig._compile_all_devices`` so that the row named *compiled* is compiled. The
  row's ``peer_compiled`` says whether ``generate`` made its compiled call; a static peer that did not compile is an
  error, not a row under that name.

Timing (the protocol of ``/work/shared/reference/gpu.md``): per repeat ``t(1 + N new tokens) - t(1 new token)``, both
with ``min_new_tokens = max_new_tokens`` (EOS cannot end a row early), so the difference is N decode steps and no
prefill; the median over ``repeats`` after ``warmup`` repeats (the warm-ups compile). N is the cell's ``new_tokens``.

**The floor**: a decode step reads every weight once and the whole resident KV cache, so it cannot take less than
``(weight bytes + resident KV bytes) / memory bandwidth``. The bandwidth is measured on the same device in the same
run: a device-to-device copy of a large buffer (``copy_mib``, 1 GiB on a GPU), counted as ``2 x bytes / seconds``
(the copy reads every byte and writes it: the convention behind the ~4.3 TB/s an H200 reaches, 4.8 TB/s datasheet).
On a CPU it is the copy bandwidth of the process's threads, so the floor is testable there too.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvbench.errors import ConfigError, KVBenchError

if TYPE_CHECKING:
    import torch

#: peer name -> transformers cache implementation (None: the default DynamicCache)
PEERS = {"transformers_dynamic": None, "transformers_static_compiled": "static"}
#: the convention of ``copy_bandwidth_bytes_per_s``
BANDWIDTH_CONVENTION = "2 x copied bytes / seconds (a device-to-device copy reads and writes every byte)"


def check_peer(name: str) -> str:
    if name not in PEERS:
        raise ConfigError(f"bench: unknown peer {name!r}; valid peers: {', '.join(PEERS)}")
    return name


@dataclass
class PeerResult:
    """One peer cell: decode speed of plain transformers ``generate`` on the cell's prompts."""

    decode_ms_per_token: float
    decode_tokens_per_s: float
    decode_steps: int
    decode_seconds_all: list[float]  # t(1 + N) - t(1) per measured repeat
    peer_cache: str  # "dynamic" or "static"
    peer_compiled: bool  # generate ran its decode through torch.compile (transformers' auto-compile)
    peer_compile_config: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _compile_config(device: torch.device, options: dict[str, Any] | None):
    from transformers import CompileConfig

    config = CompileConfig(**(options or {}))
    if device.type not in ("cuda", "xpu"):  # transformers compiles on accelerators only; this row must be compiled
        config._compile_all_devices = True
    return config


def measure_peer(loaded, peer: str, context_length: int, batch_size: int, new_tokens: int = 64, warmup: int = 2,
                 repeats: int = 3, compile_options: dict[str, Any] | None = None) -> PeerResult:
    """Time ``peer`` (a name of ``PEERS``) decoding ``new_tokens`` steps after the cell's prompts (see the module)."""
    import torch

    from kvbench.bench.measure import prompts_for

    check_peer(peer)
    model, tokenizer = loaded.model, loaded.tokenizer
    device = model.device
    ids = torch.tensor(prompts_for(tokenizer, context_length, batch_size), device=device)
    kwargs: dict[str, Any] = {"attention_mask": torch.ones_like(ids), "do_sample": False, "num_beams": 1,
                              "temperature": None, "top_p": None, "top_k": None,
                              "pad_token_id": tokenizer.pad_token_id}
    implementation = PEERS[peer]
    compile_config = None
    if implementation == "static":
        compile_config = _compile_config(device, compile_options)
        kwargs.update(cache_implementation="static", compile_config=compile_config)
        model.__dict__.pop("_compiled_call", None)  # so that peer_compiled says what this cell's generate did
        # generate sizes a new static cache to the largest of every earlier call on this model: an earlier, longer
        # cell would leave this one a larger cache (more bytes per step) than a fresh process gives it
        model.__dict__.pop("_previous_max_cache_length", None)

    def timed(new: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        _sync(device)
        return time.perf_counter() - start

    diffs = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            one = timed(1)
            full = timed(1 + new_tokens)
            if i >= warmup:
                diffs.append(full - one)
    compiled = getattr(model, "_compiled_call", None) is not None
    if implementation == "static" and not compiled:
        raise KVBenchError(f"bench: peer {peer}: transformers' generate did not compile its decode forward on "
                           f"{device} (GenerationMixin._valid_auto_compile_criteria refused); no row is written "
                           f"under that name")
    ms = 1000 * statistics.median(diffs) / new_tokens
    return PeerResult(decode_ms_per_token=round(ms, 3), decode_tokens_per_s=round(batch_size * 1000 / ms, 3),
                      decode_steps=new_tokens, decode_seconds_all=[float(f"{d:.6g}") for d in diffs],
                      peer_cache=implementation or "dynamic", peer_compiled=compiled,
                      peer_compile_config=None if compile_config is None else
                      {**compile_config.to_dict(), "_compile_all_devices": compile_config._compile_all_devices})


# ---- the floor ---------------------------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device | str, copy_mib: int = 1024, warmup: int = 2, repeats: int = 5
                   ) -> dict[str, Any]:
    """Memory bandwidth of ``device`` from a timed copy of ``copy_mib`` MiB into a second buffer (median of
    ``repeats`` after ``warmup``), as ``2 x bytes / seconds`` (``BANDWIDTH_CONVENTION``)."""
    import torch

    device = torch.device(device)
    if not isinstance(copy_mib, int) or copy_mib < 1:
        raise ConfigError(f"bench: floor.copy_mib={copy_mib!r} must be a positive integer (MiB per buffer)")
    nbytes = copy_mib * 2**20
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # written, so every page is resident
    dst = torch.zeros_like(src)
    seconds = []
    for i in range(warmup + repeats):
        if device.type == "cuda":  # events: a 1 GiB copy is ~0.5 ms on an H200, host timers would add a few %
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1000
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - begin
        if i >= warmup:
            seconds.append(elapsed)
    del src, dst
    seconds = [float(f"{s:.6g}") for s in seconds]  # the bandwidth is recomputable from the stored timings exactly
    median = statistics.median(seconds)
    return {"device": str(device), "threads": torch.get_num_threads(), "copy_bytes": nbytes,
            "copy_seconds_all": seconds, "copy_seconds": median,
            "copy_bandwidth_bytes_per_s": round(2 * nbytes / median), "convention": BANDWIDTH_CONVENTION}


def weight_bytes(model) -> int:
    """Bytes of every parameter (a tied embedding / LM head counted once, as ``parameters()`` yields it once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def floor_fields(weights: int, kv_bytes: int | None, bandwidth: float) -> dict[str, Any]:
    """The floor of one decode step: every weight and the resident KV read once at the measured bandwidth."""
    if kv_bytes is None:
        return {}
    return {"weight_bytes": weights, "floor_kv_bytes": kv_bytes, "copy_bandwidth_bytes_per_s": bandwidth,
            "floor_ms_per_token": float(f"{1000 * (weights + kv_bytes) / bandwidth:.6g}")}
