"""One captured decode step per token: the model's whole forward, the method's step inside it, the token choice
(greedy, or sampled with uniforms the host wrote into a static buffer before the block of steps).

Batch-1 decode of an 8B model on a GPU is bound by launches and host work (reference/gpu.md): capturing one layer's
attention at a time leaves every projection, norm and MLP, and the Python between them, on the host. Here the whole
step is one function, compiled once with ``torch.compile(fullgraph=True)`` (on CUDA ``mode="reduce-overhead"``: one
CUDA graph replayed per token):

* the step reads its token and position from, and writes the next ones into, buffers of the model's ``SlotPool``
  (``StepBuffers``: the same addresses for every generation of the same bucket), as it writes keys and values into
  the session's fixed-capacity cache layers
  (``engine.static.StaticKVLayer``): every tensor it mutates is allocated before the first step and marked a static
  address for the compiler, so nothing is copied into or out of the graph per step;
* the model runs with the ``kvbench_graph`` attention implementation, for which transformers builds no mask and reads
  no cache length: each layer's attention is the session's ``captured_attend`` (write the step's key/value into a free
  slot, then ``engine.static.static_step``: attention over the valid slots and the method's own step — score
  accumulation, eviction, merge, page or filter selection — all device tensors);
* a sampled generation (``kvbench.engine.sampling``) draws each row's uniforms for the next ``read_every`` steps on the
  host (its own seeded CPU generator, one per step) into ``StepBuffers.uniforms`` before each block; the step reads its
  column and chooses on the device (the same tokens as the host-driven loop, which draws the same uniforms one by one);
* nothing is read back inside a step: the generated tokens accumulate on the device and the host reads them every
  ``read_every`` steps (EOS, task stop strings, the token limit), then trims what follows a row's end, so the tokens
  equal the host-driven loop's;
* a batch runs at its bucket (1, 2, 4, 8, 16, ...): extra rows repeat the last row and are dropped, so a sweep
  captures a handful of graphs, not one per batch size.

Compression during decode (``method.decode_compression`` with a fixed target) runs here too: each compressing layer
appends (``StaticKVLayer.fill``) and its step writes its post-RoPE query into a ring of the pool
(``engine.decode_compression.CapturedCompression``); the host cuts a read block's steps at every ``interval``-th step
(``session.compression_due_in``) and, between two captured steps, compresses every layer eagerly through the eager
path's code on the slots laid out as the eager layer holds them, then writes the result back into the same slots (one
host phase per interval; the graph is not recompiled). A method whose cross-layer ``after_decode_forward`` acts at
forwards host counts name (``Method.after_decode_forward_due``: TriAttention) runs the same way: its layers append,
the host cuts the block at that forward and calls the method on the layers as the eager path holds them. A sampled
block's uniforms are drawn for the whole read block before it, and its sub-blocks read their columns on.

The first decode step of a generation runs on the host-driven path (``CompressionSession``'s per-layer attention), where
the session checks that the method compressed (compression is verified, never assumed) and D2O's official reading
compresses the prompt; every later step is the captured one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbench.engine.compat import cache_kwargs, versions_line
from kvbench.engine.sampling import RowStreams, Sampling, next_tokens
from kvbench.engine.static import slot_pool

log = logging.getLogger("kvbench")

#: host reads of the generated tokens: every this many captured steps (the EOS / stop-string check's period)
READ_EVERY = 16
#: whether the last generation's decode step was captured (``captured``), and why not (``refused``)
STATUS: dict[str, object] = {}
#: the batch buckets a captured step runs at (then multiples of the largest)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(rows: int) -> int:
    """The batch a captured step runs at for ``rows`` rows."""
    for size in BUCKETS:
        if rows <= size:
            return size
    return -(-rows // BUCKETS[-1]) * BUCKETS[-1]


@dataclass
class StepBuffers:
    """What a captured step reads and writes besides the cache, from the model's ``SlotPool`` (static addresses):
    ``tokens`` ``(B, 1)`` the step's input ids, ``positions`` ``(B, 1)`` their positions, ``generated`` ``(B, T)`` the
    chosen ids of the last ``T`` steps (a ring of one read's columns), ``step`` ``()`` the next column of it; for a
    sampled generation ``uniforms`` ``(B, T)`` float64 the draws of the same ``T`` steps (written by the host before
    each block) and ``sampling`` the settings (a constant of the graph); for a method that scores tokens by the model's
    predictions (``StaticPolicy.token_logp``) ``token_logp`` ``(B, 1)``: the log-probability of ``tokens`` under the
    step before's prediction (the session's buffer, which its layers read)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    generated: torch.Tensor
    step: torch.Tensor
    uniforms: torch.Tensor | None = None
    sampling: Sampling | None = None
    token_logp: torch.Tensor | None = None

    @classmethod
    def allocate(cls, tokens: torch.Tensor, positions: torch.Tensor, rows: int, steps: int,
                 take: Callable[[str, tuple, torch.dtype], torch.Tensor],
                 sampling: Sampling | None = None) -> StepBuffers:
        """Buffers of ``rows`` rows from ``take`` (the model's ``SlotPool``: the same addresses every generation of the
        same bucket and length), holding ``tokens`` ``(B,)`` and ``positions`` ``(B, 1)``, the last row repeated;
        with ``sampling``, a ``uniforms`` buffer too (zeros until the host fills it)."""
        def fill(name: str, t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(-1, 1)
            base = take(name, (rows, 1), torch.long)
            base.copy_(torch.cat([t, t[-1:].expand(rows - t.shape[0], 1)]))
            return base

        uniforms = None if sampling is None else take("uniforms", (rows, steps), torch.float64).zero_()
        return cls(fill("tokens", tokens), fill("positions", positions),
                   take("generated", (rows, steps), torch.long), take("step", (), torch.long).zero_(), uniforms,
                   sampling)

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.generated, self.step] + \
            ([] if self.uniforms is None else [self.uniforms]) + ([] if self.token_logp is None else [self.token_logp])

    def fill_uniforms(self, streams: RowStreams, steps: int) -> None:
        """The next ``steps`` uniforms of each real row into columns ``[0, steps)`` (every block starts the ring at
        column 0); the bucket's extra rows keep theirs (they are dropped)."""
        drawn = streams.next(steps)
        self.uniforms[: drawn.shape[0], :steps].copy_(drawn)


def decode_step(model, cache_kw: dict, buffers: StepBuffers) -> None:
    """One decode step of ``model`` over the buffers and the cache, in place: no input, no output, no host read
    (the function ``compiled_decode_step`` captures). Greedy, or sampled with the step's column of ``uniforms``."""
    out = model(input_ids=buffers.tokens, position_ids=buffers.positions, use_cache=True, logits_to_keep=1,
                **cache_kw)
    uniforms = None
    if buffers.sampling is not None:
        uniforms = buffers.uniforms.index_select(1, buffers.step.view(1)).squeeze(1)  # (B,)
    chosen = next_tokens(out.logits[:, -1, :], buffers.sampling, uniforms).unsqueeze(-1)  # (B, 1)
    if buffers.token_logp is not None:  # the next step's input token's log-probability (SirLLM's surprisal)
        logp = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
        buffers.token_logp.copy_(torch.gather(logp, -1, chosen))
    buffers.tokens.copy_(chosen)
    buffers.positions.add_(1)
    buffers.generated.index_copy_(1, buffers.step.view(1), chosen)
    buffers.step.copy_((buffers.step + 1) % buffers.generated.shape[1])  # a ring of read_every columns


@functools.cache
def compiled_decode_step(backend: str | None, mode: str | None):
    """``decode_step`` compiled once per (backend, mode) for the process: every session of every method shares it (a
    graph per model, batch bucket, cache capacity and method step, told apart by dynamo's guards); the limit of
    graphs per function is raised for processes that decode with many methods (a test session, a sweep worker)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7: the old name
    setattr(config, name, max(getattr(config, name), 256))
    # a method's float hyperparameters (D2O's beta) stay constants of their graph: torch 2.6 otherwise turns a float
    # that differs between two compiled calls into a 0-d tensor read back with .item(), which fullgraph refuses
    config.specialize_float = True
    if backend is not None:
        return torch.compile(decode_step, fullgraph=True, dynamic=False, backend=backend)
    return torch.compile(decode_step, fullgraph=True, dynamic=False, options=inductor_options(mode))


def inductor_options(mode: str | None) -> dict:
    """Inductor's options for the captured step: ``mode``'s (``reduce-overhead``: CUDA graphs) and no
    ``reorder_for_locality``. That pass moves each value's producers to just before its first consumer before
    inductor re-places the functional writes of the step's buffers (``index_put`` into ``index_put_``); a read of a
    buffer that a method writes after its attention (the attention output of D2O's and CaM's merged values, the
    entries-attended count of an evicting layer's validity) then lands after the write, and the write gets a copy of
    the whole buffer instead (``tests/test_step_traffic.py``). Without it the graph keeps the step's order, in which
    every read of a buffer precedes its write."""
    import torch._inductor

    return {**(torch._inductor.list_mode_options(mode) if mode else {}), "reorder_for_locality": False}


def mark_static(tensors: list[torch.Tensor]) -> None:
    """Tell the compiler these tensors keep their address for the graph's life (CUDA graphs then read and write them
    in place instead of copying them in and out of the graph's own memory at every replay)."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)


def _first_call(fn, model, cache_kw: dict, buffers: StepBuffers):
    """The generation's first captured step, which traces and compiles the step where it is new; the function to call
    for the others. Where this torch / transformers pair cannot trace the model's forward whole (torch 2.6 with
    transformers 5.6 stops at the output-capturing wrapper's ``func.__code__``), the same step runs uncompiled, with
    one warning line: the tokens are the same, the step is not captured (``STATUS`` says so)."""
    try:
        fn(model, cache_kw, buffers)
        STATUS["captured"] = True
        return fn
    except torch._dynamo.exc.Unsupported as exc:  # raised while tracing: nothing ran, no buffer was touched
        reason = str(exc).strip().splitlines()[0]
        if STATUS.get("refused") != reason:
            log.warning("engine.decode=graph: dynamo cannot trace the model's forward whole here (%s; %s); the decode "
                        "step runs uncompiled (same tokens, not captured)", reason, versions_line())
        STATUS.update(captured=False, refused=reason)
        decode_step(model, cache_kw, buffers)
        return decode_step


def read_chosen(buffers: StepBuffers, rows: int, start: int, end: int) -> list[list[int]]:
    """The ids chosen by steps ``[start, end)`` of the first ``rows`` rows: the captured loop's only host read."""
    return buffers.generated[:rows, start:end].tolist()


def captured_generate(session, model, next_token: torch.Tensor, last_pos: torch.Tensor, steps: int,
                      take: Callable[[list[list[int]]], bool], read_every: int | None = None,
                      sampling: Sampling | None = None, streams: RowStreams | None = None) -> int:
    """Run up to ``steps`` captured decode steps after ``next_token`` ``(B,)`` at positions ``last_pos`` ``(B, 1)``
    (the token the host-driven loop would feed next, and the position before it), handing the host the chosen ids
    every ``read_every`` steps as ``take(columns)`` (per row, in step order), which returns True when every row has
    ended. Returns the number of steps run (the last read may include up to ``read_every - 1`` steps past the end).
    ``sampling`` with ``streams`` (one generator per real row, continuing the host-driven loop's draws): each block's
    uniforms are drawn before it runs."""
    if sampling is not None and streams is None:
        raise ValueError("a sampled captured generation needs the rows' streams")
    read_every = read_every or READ_EVERY
    rows = next_token.shape[0]
    pool = slot_pool(model).taker(("step",), next_token.device)
    # ``generated`` holds one read's columns (a ring), so its shape, and the graph, do not depend on the generation's
    # length (a bench's short warm-up and its measured runs replay one graph)
    buffers = StepBuffers.allocate(next_token, last_pos + 1, session.bucket_rows(rows), read_every, pool, sampling)
    buffers.token_logp = session.token_logp(buffers.tokens)
    fn = session.captured_step_function()
    done = 0
    with session.captured(session.bucket_rows(rows), buffers.tensors(), buffers.step, read_every):
        kw = cache_kwargs(model, session.graph_cache())
        while done < steps:
            chunk = min(read_every, steps - done)
            if sampling is not None:
                buffers.fill_uniforms(streams, chunk)
            i = 0
            while i < chunk:  # cut where the session compresses during decode (on the host, between steps)
                due = session.compression_due_in()
                part = chunk - i if due is None else min(chunk - i, max(1, due))
                for j in range(i, i + part):
                    if done == 0 and j == 0:
                        fn = _first_call(fn, model, kw, buffers)
                    else:
                        fn(model, kw, buffers)
                session.advance(part)
                i += part
            columns = read_chosen(buffers, rows, 0, chunk)  # every chunk starts the ring at column 0
            session.read_block(chunk)
            done += chunk
            if take(columns):
                break
    return done
