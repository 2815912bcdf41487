"""Brutal Offload: OmniKV's latency baseline. Full attention, with the last layers' prompt KV kept in host memory and
copied back to the GPU a few layers before it is needed.

Hao et al., OmniKV (ICLR 2025) Fig. 4 and App. (Brutal Offload), code ``modeling/brutal_offload_llama.py`` with
``DynamicBrutalOffloadCache`` (``spec_cache.py``). reference/methods.md B16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


class CudaTransport:
    """Host <-> GPU copies on one side CUDA stream, ordered with the compute stream by events.

    ``to_host``: device -> (pinned) host copy on the side stream after the compute stream's pending work; the source
    is marked as used by the side stream so the allocator does not reuse it early. ``fetch``: host -> device copy on
    the side stream, returning the tensors and an event; ``ready`` makes the compute stream wait for that event and
    marks the tensors as used by it (they were allocated on the side stream).
    """

    def __init__(self, device: torch.device, pin_memory: bool):
        self.device = device
        self.pin_memory = pin_memory
        self.stream = torch.cuda.Stream(device=device)

    def to_host(self, tensor: torch.Tensor) -> Any:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return host, event

    def fetch(self, stored: Any) -> Any:
        host, offloaded = stored
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(offloaded)  # the host copy must be complete before it is read back
            tensor = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return tensor, event

    def ready(self, fetched: Any) -> torch.Tensor:
        tensor, event = fetched
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        tensor.record_stream(current)
        return tensor


@dataclass
class BrutalOffload(Method):
    """After prefill, every layer from ``offload_start`` on keeps its prompt K/V in host memory (pinned by default)
    and only the generated tokens' K/V on the GPU. At each decode step, layer ``l`` issues the host-to-GPU copy of
    layer ``l + prefetch_ahead``'s prompt K/V on a side CUDA stream before its own attention (the code prefetches in
    ``update`` of layer ``l`` for layer ``l + 4``); an offloaded layer waits for its copy, attends over prompt +
    generated K/V with full attention and frees the GPU copy. Outputs equal FullKV's (same keys, same attention);
    only latency and GPU memory differ. Resident KV bytes count what stays on the GPU.

    ``offload_start``: an int is a layer index; a float in [0, 1) is a fraction of the depth, rounded
    (``0.375`` = the code's ``offload_sid = 12`` of Llama-3-8B's 32 layers, "the final 20 layers"). Layers whose copy
    would be issued before layer 0 (``offload_start < prefetch_ahead``) are fetched at layer 0.
    ``pin_memory=false`` is the code's pageable ``.to("cpu")``, with which ``non_blocking`` copies are synchronous.
    Needs the model on a CUDA device (``requires_cuda``: the runner refuses before loading). Batch size 1 (code).
    """

    name: ClassVar[str] = "offload"
    own_attention: ClassVar[bool] = True
    supports_continued_forward: ClassVar[bool] = False  # its own single-query decode attention/selection
    #: every token stays (the prompt's in host memory) and is attended; the budget is unused
    compression: ClassVar[str] = "none"
    supports_batching: ClassVar[bool] = False
    requires_cuda: ClassVar[bool] = True
    offload_start: int | float = 0.375
    prefetch_ahead: int = 4
    pin_memory: bool = True
    _transport: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        start = self.offload_start
        if isinstance(start, bool) or not isinstance(start, (int, float)):
            raise ConfigError(f"method 'offload': offload_start={start!r} must be a layer index or a fraction in "
                              "[0, 1)")
        if isinstance(start, float) and not 0 <= start < 1 or isinstance(start, int) and start < 0:
            raise ConfigError(f"method 'offload': offload_start={start!r} must be a layer index >= 0 (int) or a "
                              "fraction of the depth in [0, 1) (float)")
        if self.prefetch_ahead < 1:
            raise ConfigError(f"method 'offload': prefetch_ahead={self.prefetch_ahead} must be >= 1")
        self._host: dict[int, tuple[Any, Any]] = {}  # layer -> offloaded prompt (keys, values)
        self._fetched: dict[int, tuple[Any, Any]] = {}  # layer -> in-flight GPU copies
        self.host_bytes = 0  # prompt KV bytes held in host memory for the current sample

    def static_refusal(self) -> str:
        return (
            "it copies the last layers' prompt KV between host and GPU memory on a side stream at every step, which a "
            "captured graph cannot replay"
        )

    def budget_label(self, budget: Budget) -> str:
        return "full"  # the budget is unused: every token is attended

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    # ---- the plan as data ------------------------------------------------------------------------------------------
    def start_layer(self, num_layers: int) -> int:
        if isinstance(self.offload_start, float):
            return round(self.offload_start * num_layers)
        if self.offload_start >= num_layers:
            raise ConfigError(f"method 'offload': offload_start={self.offload_start} is not a layer of a "
                              f"{num_layers}-layer model")
        return self.offload_start

    def offloaded_layers(self, num_layers: int) -> list[int]:
        return list(range(self.start_layer(num_layers), num_layers))

    def prefetch_schedule(self, num_layers: int) -> dict[int, list[int]]:
        """Decode step: layer -> the offloaded layers whose copies it issues, before its own attention."""
        schedule: dict[int, list[int]] = {}
        for target in self.offloaded_layers(num_layers):
            schedule.setdefault(max(0, target - self.prefetch_ahead), []).append(target)
        return schedule

    # ---- engine hooks ----------------------------------------------------------------------------------------------
    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.layer_idx == 0:
            self._host.clear()
            self._fetched.clear()
            self.host_bytes = 0
        if self._transport is None:
            if layer.keys.device.type != "cuda":
                raise NotAvailableError(f"method 'offload' needs the model on a CUDA device; its KV is on "
                                        f"{layer.keys.device.type!r}")
            self._transport = CudaTransport(layer.keys.device, self.pin_memory)
        if layer.valid is not None or layer.keys.shape[0] != 1:
            raise NotAvailableError("method 'offload' runs one sequence at a time (batch_size=1, no padding)")
        if ctx.layer_idx < self.start_layer(ctx.num_layers):
            return
        self.host_bytes += layer.resident_bytes()
        self._host[ctx.layer_idx] = (self._transport.to_host(layer.keys), self._transport.to_host(layer.values))
        # the GPU keeps only what later steps append (generated tokens); fresh empty tensors free the prompt's
        layer.keys = layer.keys.new_empty(*layer.keys.shape[:2], 0, layer.keys.shape[-1])
        layer.values = layer.values.new_empty(*layer.values.shape[:2], 0, layer.values.shape[-1])
        layer.positions = layer.positions[..., :0].clone()

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        if not self._host:
            return None
        for target in self.prefetch_schedule(ctx.num_layers).get(ctx.layer_idx, []):
            keys, values = self._host[target]
            self._fetched[target] = (self._transport.fetch(keys), self._transport.fetch(values))
        if ctx.layer_idx not in self._host:
            return None
        fetched_k, fetched_v = self._fetched.pop(ctx.layer_idx)
        keys = torch.cat([self._transport.ready(fetched_k), layer.keys], dim=2)
        values = torch.cat([self._transport.ready(fetched_v), layer.values], dim=2)
        ctx.attended = keys.shape[2]  # prompt (fetched) + generated: the layer's own entries are only the latter
        return full_attention(ctx.query, keys, values, ctx.scaling or ctx.query.shape[-1] ** -0.5)


def full_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """SDPA over every entry, KV heads repeated as transformers' ``sdpa_attention_forward`` does; the ``q`` queries
    are the newest tokens (causal among themselves). Returns ``(B, q, Hq, D)``."""
    b, hq, q, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    keys = keys[:, :, None].expand(b, hkv, rep, t, d).reshape(b, hq, t, d)
    values = values[:, :, None].expand(b, hkv, rep, t, d).reshape(b, hq, t, d)
    mask = None
    if q > 1:
        j = torch.arange(t, device=query.device).view(1, -1)
        mask = j <= torch.arange(t - q, t, device=query.device).view(-1, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()
