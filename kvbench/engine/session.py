"""``CompressionSession``: plugs a method into a transformers model through public extension points only.

    with CompressionSession(model, method, budget) as session:
        out = model.generate(**inputs)            # or kvbench.engine.generate.greedy_generate(...)
    session.stats                                 # resident KV bytes, per-layer entries, attended tokens

While active, the model's attention implementation is ``kvbench_<impl>`` (registered via ``AttentionInterface``),
and a forward pre-hook on every attention module converts the layer's cache into a ``KVLayer`` (works with the
``DynamicCache`` that ``generate`` creates, or with a ``KVCache`` passed in). On exit the model is restored.

A method that scores tokens by the model's own predictions (``Method.needs_logits``, SirLLM's token entropy) also gets
three hooks: a pre-hook on the model records the forward's ``input_ids``, a hook on the decoder stack
(``get_decoder()``) records its final hidden states at every position (``generate`` and ``greedy_generate`` ask the
head for the last position only, ``logits_to_keep=1``), and a hook on the model calls ``Method.observe_logits`` after
the forward, i.e. before the next one, with a :class:`TokenLogits` that applies the output head in chunks; a decode
step's resident entries are counted after it. On static layers (``engine.decode=graph``) the method's step evicts
inside each layer instead, with the step's token's log-probability under the previous prediction
(``StaticPolicy.token_logp``: the pre-hook writes it for a host-driven step, the captured step for the next one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kvbench.budget import Budget, check_budget
from kvbench.engine.architecture import (
    SLIDING_POLICIES,
    LayerAttention,
    attention_modules,
    compressed_layers,
    layer_attention,
    resolve_policy,
)
from kvbench.engine.attention import (
    ACTIVE_SESSION,
    CAPTURED_SESSION,
    GRAPH_IMPL,
    backend_function,
    grouped_attention,
    register_backends,
)
from kvbench.engine.cache import KVLayer, check_deferred_valid, ensure_kv_layer
from kvbench.engine.compat import cache_kwargs, find_cache, output_cache, versions_line
from kvbench.engine.decode_compression import CapturedCompression, DecodeCompressor, decode_context, graph_refusal
from kvbench.engine.logits import TokenLogits
from kvbench.engine.options import POSITION_MODES
from kvbench.engine.rope import rotate_keys
from kvbench.engine.static import (
    StaticKVLayer,
    StaticPolicy,
    StepSlots,
    evict_oldest,
    repeat_last_row,
    slot_pool,
    static_step,
)
from kvbench.errors import CompressionInactiveError, ConfigError, NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, real_rank

_ROTATABLE_ROPE = ("default", "linear", "llama3")
#: engine.compile: slot counts that follow the prompt's length are rounded up to a multiple of this (graphs per bucket)
SLOT_ROUND = 256
#: slots of a layer whose heads hold entries of their own counts (AdaKV), rounded up to a multiple of this (where
#: they start and as they grow): the longest head differs per prompt and moves with every decode compression
GROW_ROUND = 64


@dataclass
class SessionStats:
    """Per generation call (reset at every new prefill)."""

    prompt_lens: list[int] = field(default_factory=list)
    layer_entries_after_prefill: list[float] = field(default_factory=list)  # valid entries per layer (row 0)
    resident_kv_bytes_after_prefill: int = 0
    #: sum over decode steps and layers of mean attended entries per (row, head); a device scalar when padded caches
    #: were counted (read once, here, not at every layer of every step)
    attended_entries_sum: int | torch.Tensor = 0
    decode_layer_calls: int = 0
    #: resident KV over the generation: ``[decode step, entries per layer]`` (the mean over attention layers of the
    #: entries each holds, slots of its longest (row, head); step 0: after prefill), kept piecewise linear: a point
    #: only where the slope changes (a growing cache is 2 points, a saw-tooth 2 per compression), so records stay small
    resident_curve: list[list[float]] = field(default_factory=list)

    def add_resident_point(self, step: int, entries: float) -> None:
        """One step's point of ``resident_curve``; the point before it is dropped when it lies on the line through its
        neighbours (a constant or linear stretch keeps its ends only)."""
        curve = self.resident_curve
        point = [step, entries]
        if len(curve) >= 2:
            (s0, e0), (s1, e1) = curve[-2], curve[-1]
            if (e1 - e0) * (step - s1) == (entries - e1) * (s1 - s0):
                curve[-1] = point
                return
        curve.append(point)

    @property
    def attended_tokens_mean(self) -> float:
        """Mean number of entries a (layer, head) attended at a decode step."""
        return float(self.attended_entries_sum) / self.decode_layer_calls if self.decode_layer_calls else 0.0


def _extra_slots(policy: StaticPolicy, caps: list[int], held: int, compression, budget: Budget,
                 reserve: int, seen: int | None = None) -> int:
    """Free slots after the ``held`` entries of a layer turned static for a generation that appends up to ``reserve``
    tokens: an evicting layer needs one slot for the step's token, or more where a row may grow before it evicts (a
    capacity above what the layer holds: D2O's rows that the official code never compresses); a layer that never
    evicts, one per token; a layer compressed during decode (``compression``) appends up to its target (or what it
    holds) plus one interval, or up to the forward a method's schedule acts at (``seen``: the tokens seen, default
    ``held``); a layer whose step frees entries on a schedule of its own (``StaticPolicy.entries``), the most that
    schedule holds during a step of the generation."""
    seen = held if seen is None else seen
    if compression is not None:
        return compression.extra_slots(held, seen, budget, reserve)
    if policy.entries is not None:  # a schedule of its own (PyramidInfer's chunks): the most it holds in a step
        # (after the step's token is written, before its step frees any)
        return max(1, max(policy.entries(held, step) for step in range(reserve)) + 1 - held)
    if policy.evict is not None:
        return max(1, min(reserve, max(caps) + 1 - held))
    return max(1, reserve)


def _holds_none(held: int, steps: int) -> int:
    """The entries a layer attending another layer's slots holds (``StaticPolicy.source``): none."""
    return 0


class CompressionSession:
    """``sliding_layers`` (``engine.architecture``): ``window`` leaves sliding-window layers to their window and lets
    the method compress the full-attention layers (seeing them as layers ``0 .. L'-1`` of an ``L'``-layer model, so
    per-layer allocations spread the budget over the layers they compress); ``compress`` applies the method inside
    every sliding layer's window too (its tokens are the window's, its budget at most ``window - 1``); ``auto``
    (default) is ``window``, or ``compress`` on a model whose every layer slides (Mistral v0.1)."""

    def __init__(self, model, method: Method, budget: Budget, position_mode: str = "original",
                 sliding_layers: str = "auto", compile: bool | str = False, tokenizer=None,
                 few_kernels: bool | None = None, job_lengths: tuple[int, int] | None = None,
                 job_rows: int | None = None):
        if position_mode not in POSITION_MODES:
            raise ConfigError(f"position_mode={position_mode!r} is not valid; valid: {', '.join(POSITION_MODES)}")
        if sliding_layers not in SLIDING_POLICIES:
            raise ConfigError(f"sliding_layers={sliding_layers!r} is not valid; valid: {', '.join(SLIDING_POLICIES)}")
        self.model = model
        self.method = method
        #: the model's tokenizer, for methods that feed the model text of their own (KVzip's repeat prompt)
        self.tokenizer = tokenizer
        self._reconstruct_pending = False  # needs_reconstruction: the prompt's forward ended, its repeat forwards not
        self._reconstructing: tuple[int, int] | None = None  # the chunk [start, end) a repeat forward reconstructs
        self._reconstruct_mask: torch.Tensor | None = None  # that forward's additive mask, built at its first layer
        self.budget = budget
        self.position_mode = position_mode
        self.sliding_layers = sliding_layers
        #: engine.compile: after prefill every layer becomes a fixed-capacity StaticKVLayer and each decode step runs
        #: one compiled function per layer (engine/static.py)
        self.compile = compile
        #: PrefillContext.few_kernels: None = on CUDA (launch-bound) only; True/False forces a form (tests, benches)
        self.few_kernels = few_kernels
        self._graph_live = False  # the captured decode steps are running (engine/graph.py)
        self._attended_acc: torch.Tensor | None = None  # their attended entries per step of a read block (device)
        self._attended_column: torch.Tensor | None = None  # the step's column of the block (the step buffer's)
        self._real_rows: torch.Tensor | None = None  # (bucket,) 1 for the batch's rows: the attended mean's weights
        self._last_block: torch.Tensor | None = None  # the last read block's per-step sums (generation_ended)
        self._static: dict[int, tuple[StaticPolicy, torch.Tensor]] = {}  # layer -> (policy, capacity (B, 1, 1))
        self._row_bases: dict[tuple, torch.Tensor] = {}  # capacities and selections at the batch bucket's rows
        #: static layer -> (decode step it turned static at, entries it held then, the most it holds or None)
        self._occupancy: dict[int, tuple[int, int, int | Callable[[int, int], int] | None]] = {}
        self._chosen: dict[int, torch.Tensor] = {}  # a selection shared between layers, by its writer (OmniKV's filter)
        self._shared: dict[str, torch.Tensor] = {}  # logits shared between layers, by name (StaticPolicy.shared: POD's)
        #: the step's input token's log-probability under the previous forward (StaticPolicy.token_logp: SirLLM's)
        self._token_logp: torch.Tensor | None = None
        self._static_pending = False  # engine.compile: the layers become static after this decode step
        self._reserve = 0  # decode steps the generation loop announced (slots for appended tokens)
        #: the job's longest prompt (tokens, as encoded) and its most new tokens: the captured decode sizes the layers
        #: whose slot count follows the prompt for the longest, so a job's samples replay one graph over one set of
        #: buffers (the same addresses) instead of a graph per SLOT_ROUND bucket of prompt length, in the job's order
        self.job_lengths = job_lengths
        #: the rows of the job's largest batch: a smaller batch of the job (its last, a resumed job's first) runs the
        #: captured step at that batch's bucket too, replaying its graph over its buffers instead of compiling one more
        self.job_rows = job_rows
        self._cache = None  # the cache container of the current forward (its layers are replaced by static ones)
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.stats = SessionStats()
        self._layers: dict[int, KVLayer | None] = {}
        #: key validity, prompt lengths, capacities (device tensors), the lengths and capacities as Python ints and
        #: whether the padding is on the left; set at layer 0's prefill
        self._prompt: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, tuple[list[int], list[int]], bool] | None
        self._prompt = None
        self._hooks: list = []
        self._token = None
        self._input_ids: torch.Tensor | None = None  # needs_logits: the current forward's tokens
        self._hidden: torch.Tensor | None = None  # needs_logits: its final hidden states (B, q, H)
        self._previous: torch.Tensor | None = None  # needs_logits: log-softmax of the previous forward's last position
        self._prefill_forward = False
        self._attention_layers: set[int] = set()  # layer_idx of every attention module hooked
        self.layer_specs: dict[int, LayerAttention] = {}  # how each attention layer attends (window, soft-cap, sinks)
        #: the layers the method acts on, in order; the method sees layer ``compressed[i]`` as its layer ``i``
        self.compressed: list[int] = []
        self._method_index: dict[int, int] = {}
        self._verified: set[int] = set()  # layers whose reading matched the model's own mask (_verify_layer_reading)
        self._attached: set[int] = set()  # layers that attended through a KVLayer in the current forward
        self._checked_decode = False  # the first decode step's compression check ran (methods that act then)
        self._first_step_attended: list = []  # attended entries of the compressed layers at the first decode step
        #: compression during decode (``Method.decode_compression_spec``, kvpress's DecodingPress): per-layer query
        #: buffers and step counts, or None
        spec = None if budget.is_full else method.decode_compression_spec()
        self._decode_compressor = DecodeCompressor(spec) if spec is not None else None
        self._decode_step = 0  # decode forwards of the current generation (the resident curve's x)
        #: engine.compile with a decode compression: the captured step appends, the host compresses between blocks
        self._captured_compression: CapturedCompression | None = None
        self._inv_freq = self._rope_inv_freq() if position_mode == "compact" else None
        #: RoPE frequencies for methods that re-rotate keys (LM-Infinite's distance ceiling); None if not rotatable
        self.rope_inv_freq = self._inv_freq if self._inv_freq is not None else self._rope_inv_freq(strict=False)

    # ---- context management ----------------------------------------------------------------------------------
    def __enter__(self) -> CompressionSession:
        register_backends()
        self._orig_impl = self.model.config._attn_implementation
        base = self._orig_impl.removeprefix("kvbench_")
        if base not in ("sdpa", "eager", "flash_attention_2"):
            raise ConfigError(
                f"attention implementation {base!r} is not supported; valid: sdpa, eager, flash_attention_2"
            )
        self.model.set_attn_implementation(f"kvbench_{base}")
        for idx, module in attention_modules(self.model).items():
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._attention_layers.add(idx)
            self.layer_specs[idx] = layer_attention(getattr(module, "config", self.model.config), module)
        self._last_attention_layer = max(self._attention_layers, default=-1)
        if not self._attention_layers:
            self.__exit__()
            raise CompressionInactiveError(
                f"kvbench found no attention module with a layer index in {type(self.model).__name__}: it cannot "
                f"attach its cache layers, so no method could act ({versions_line()})"
            )
        self.sliding_policy = resolve_policy(self.sliding_layers, self.layer_specs)
        self.compressed = compressed_layers(self.layer_specs, self.sliding_policy)
        self._method_index = {layer: i for i, layer in enumerate(self.compressed)}
        if not self.budget.is_full:
            try:
                self.method.check_layers(len(self.compressed))
            except ConfigError:
                self.__exit__()
                raise
        if not self.budget.is_full and self.method.own_attention:
            self._check_own_attention()
        if self.compile:
            self._check_static()
        if not self.budget.is_full and self.method.ragged_cache():
            self._check_ragged()
        if not self.compressed and not self.budget.is_full:
            self.__exit__()
            raise ConfigError(
                f"sliding_layers={self.sliding_layers} leaves method {self.method.name!r} no layer to compress: every "
                f"layer of {type(self.model).__name__} is a sliding window; use sliding_layers=compress or auto"
            )
        self._hooks += [
            self.model.register_forward_pre_hook(self._start_forward, with_kwargs=True),
            self.model.register_forward_hook(self._check_forward, with_kwargs=True),
        ]
        if getattr(self.method, "needs_reconstruction", False) and not self.budget.is_full:
            if self.tokenizer is None:
                self.__exit__()
                raise NotAvailableError(f"method {self.method.name!r} feeds the model a repeat prompt: the session "
                                        "needs the model's tokenizer (CompressionSession(..., tokenizer=...))")
            self._hooks.append(self.model.register_forward_hook(self._reconstruct, with_kwargs=True))
        if self.method.needs_logits:
            _check_plain_logit_head(self.model)
            self._hooks += [
                self.model.register_forward_pre_hook(self._capture_input_ids, with_kwargs=True),
                self.model.get_decoder().register_forward_hook(self._capture_hidden),
                self.model.register_forward_hook(self._observe_logits, with_kwargs=True),
            ]
        self._token = ACTIVE_SESSION.set(self)
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._token is not None:
            ACTIVE_SESSION.reset(self._token)
            self._token = None
        self.model.set_attn_implementation(self._orig_impl)

    def _pre_hook(self, module, args, kwargs):
        if self._graph_live:  # the captured step: the layers are the session's static ones already
            return
        cache = find_cache(kwargs)
        self._cache = cache
        self._layers[module.layer_idx] = None if cache is None else ensure_kv_layer(cache, module.layer_idx)

    # ---- engine.compile: fixed-capacity layers, one compiled step per layer ------------------------------------
    def reserve(self, decode_tokens: int) -> None:
        """The generation loop announces how many tokens it may append (the slots a method that never evicts needs)."""
        self._reserve = decode_tokens

    def bucket_rows(self, rows: int) -> int:
        """The batch bucket a captured step of ``rows`` rows runs at: that of the job's largest batch where it is
        larger (``job_rows``: the bucket's extra rows repeat the last one and are dropped; the buffers are the ones
        the job's other batches hold), so a job's short last batch replays their graph instead of compiling its own
        (about a minute of inductor for an 8B model)."""
        from kvbench.engine.graph import bucket

        return bucket(max(rows, self.job_rows or 0))

    def _job_slots(self, idx: int, policy: StaticPolicy, caps: list[int], compression) -> int | None:
        """The slots layer ``idx`` would take for the job's longest prompt and most new tokens (``job_lengths``): what
        the layer keeps of that prompt (all of it where the method does not act on the layer; else
        ``Method.prompt_entries``: all of it for Quest, POD and TriAttention, which keep it, PyramidKV's pyramid,
        PyramidInfer's contexts, the budget's tokens for the others) plus what the layer appends, by
        the same rule as the sample's own count, rounded up to ``SLOT_ROUND``: a sweep worker's jobs whose budgets or
        new tokens differ by less (LongBench's datasets: 32 to 512 new tokens) replay one graph over one buffer. None
        without job lengths. A sample whose layer needs more (a per-layer allocation above the budget's mean) takes
        its own count, as without job lengths."""
        if self.job_lengths is None:
            return None
        longest, new_tokens = self.job_lengths
        held = longest
        if idx in self._method_index and not self.budget.is_full:
            held = self.method.prompt_entries(self.budget, longest, len(self.compressed))[self._method_index[idx]]
        count = held + _extra_slots(policy, caps, held, compression, self.budget, max(self._reserve, new_tokens))
        return count + -count % SLOT_ROUND

    def _check_static(self) -> None:
        """Refuse a method without a static decode step (``Method.static_policy``), before any forward."""
        if not self.budget.is_full and any(self.layer_specs[i].sliding for i in self.compressed):
            self.__exit__()
            raise ConfigError("engine.decode=graph does not run methods inside sliding windows (sliding_layers="
                              f"{self.sliding_policy}); use sliding_layers=window or engine.decode=eager")
        if self._decode_compressor is not None:  # compressed on the host between blocks of captured steps
            refusal = graph_refusal(self.method, self._decode_compressor.spec, self.budget)
            if refusal is not None:
                self.__exit__()
                raise ConfigError(f"engine.compile=true: method {self.method.name!r} compresses during decode "
                                  f"(decode_compression) and {refusal}; use engine.compile=false")
        if not self.budget.is_full and not self.method.has_static_step():
            self.__exit__()
            raise ConfigError(
                f"engine.compile=true: method {self.method.name!r} has no static decode step "
                f"({self.method.static_refusal()}; docs/efficiency.md lists each method's); use engine.compile=false"
            )

    def _check_own_attention(self) -> None:
        """Refuse, before any forward, a method that computes attention itself (``Method.own_attention``) on a model
        whose compressed layers cap their logits or add sink logits, which its attention does not apply."""
        capped = [i for i in self.compressed if self.layer_specs[i].softcap is not None]
        sinks = [i for i in self.compressed if self.layer_specs[i].sinks is not None]
        if not capped and not sinks:
            return
        what = f"logit soft-cap ({len(capped)} of the layers it compresses)" if capped else \
            f"per-head sink logits ({len(sinks)} of the layers it compresses)"
        self.__exit__()
        raise NotAvailableError(f"method {self.method.name!r} computes attention itself, as plain softmax attention "
                                f"without {type(self.model).__name__}'s {what}: its outputs would not be this model's "
                                "attention under the method's change, so kvbench refuses to report them under its name")

    def _check_ragged(self) -> None:
        """Refuse, before any forward, what a method's ragged cache layers (``KVLayer.to_ragged``) cannot do."""
        why = None
        if self.position_mode == "compact":
            why = "position_mode=compact re-rotates the keys in place; use position_mode=original"
        if why is not None:
            self.__exit__()
            raise ConfigError(f"method {self.method.name!r} holds its heads' entries in a ragged cache "
                              f"(layout=ragged): {why}, or the method's layout=padded (heads padded to the longest)")

    def _to_static(self) -> None:
        """After prefill: every layer becomes a StaticKVLayer with the slots its decode steps need."""
        self._static.clear()
        self._occupancy.clear()
        self._chosen.clear()
        self._shared.clear()
        self._token_logp = None
        self._row_bases.clear()
        self._static_pending = False
        pool = slot_pool(self.model)
        first = self._layers[min(self._attention_layers)]
        b, device = first.keys.shape[0], first.keys.device
        rows = self.bucket_rows(b)  # every buffer at the captured step's batch bucket, allocated once
        # a layer's slot count follows the prompt's length where the prompt is not compressed to a fixed size (FullKV,
        # ratio budgets, prompts within the budget): each count would be a graph of its own (a recompile per sample of
        # a LongBench job), so such counts are rounded up to SLOT_ROUND; the empty slots are layout, not resident bytes
        lens = self.stats.prompt_lens or [0]
        varies = self.budget.is_full or self.budget.kind == "ratio" or \
            any(self.budget.tokens_for(n) >= n for n in lens)
        compression = None
        if self._decode_compressor is not None:
            compression = self._captured_compression = CapturedCompression(self._decode_compressor.spec)
        elif not self.budget.is_full and self.method.acts_on_schedule():  # after_decode_forward between blocks
            compression = self._captured_compression = CapturedCompression(None, self.method.after_decode_forward_due)
        plans = []  # per layer: idx, policy, capacities, held, extra slots, compresses in decode, heads differ
        jobs = set()  # the job's counts of the method's layers (its longest prompt's)
        for idx in sorted(self._attention_layers):
            layer, spec = self._layers[idx], self.layer_specs[idx]
            caps = layer.capacity_list() if layer.capacity is not None else [layer.num_entries]
            if idx in self._method_index and not self.budget.is_full:
                policy = self.method.static_policy(max(caps), self._method_index[idx])
            else:
                policy = StaticPolicy()
            if spec.sliding and policy.evict is None:  # the window: the oldest entry leaves past window - 1
                policy, caps = StaticPolicy(evict=evict_oldest), [spec.window - 1] * len(caps)
            # a ragged layer: its longest head and the tail; a layer with a key window: its values (keys: the window's)
            held = layer.num_entries if policy.key_window is None else layer.values.shape[2]
            compresses = compression is not None and idx in self._method_index
            extra = _extra_slots(policy, caps, held, compression if compresses else None, self.budget,
                                 self._reserve, layer.seen)
            job = None if spec.sliding else self._job_slots(idx, policy, caps, compression if compresses else None)
            if job is not None and idx in self._method_index:
                jobs.add(job)
            if job is not None and held + extra <= job:
                extra = job - held  # the job's longest prompt's count: every sample replays one graph over one buffer
            elif varies and not spec.sliding:  # a slot count the prompt's length sets: rounded, a graph per bucket
                extra += -(held + extra) % SLOT_ROUND
            differs = (layer.ragged is not None or layer.valid is not None) and (compresses or policy.evict is None)
            plans.append((idx, policy, caps, held, extra, compresses, differs))
        # heads of their own lengths (AdaKV): the longest one differs per layer and per prompt and moves at every
        # decode compression, so every such layer gets one slot count: the most any of them needs, rounded up to
        # GROW_ROUND, and never fewer than such layers have had for this method, budget and bucket (a job's samples
        # replay one graph; a new one only past the mark)
        self._slot_mark = ("heads", self.method.name, self.budget, rows)
        needs = [held + extra for _, _, _, held, extra, _, differs in plans if differs]
        if needs:
            need = max(needs)
            slots = pool.marks[self._slot_mark] = max(need + -need % GROW_ROUND, pool.marks.get(self._slot_mark, 0))
        # evicting layers whose capacities the method sets per layer from the prompt (D2O's allocation by attention
        # variance: 109-141 entries per layer around a budget of 128, other ones for the next sample) would make each
        # sample of a job a graph of its own: in a job (job_lengths), they share one count, the most any of them needs
        # rounded up to GROW_ROUND (a few empty slots per layer; one graph for the job's samples)
        # A method whose entry counts per layer (or per head) follow the prompt's content (``Method.
        # capacities_from_content``: DynamicKV's votes, KVMerger's merges, AdaKV's heads) does the same over every
        # layer it acts on, its layers of heads of their own lengths included: which layers exceed the budget's mean,
        # and which become ragged, change from sample to sample (DynamicKV: a graph per sample of a job)
        # So does a method whose layers hold different counts in this sample (PyramidKV's pyramid: under a ratio budget
        # each sample's counts were a slot count and a graph of their own), or for the job's longest prompt
        # (``Method.prompt_entries``: a first prompt within the budget takes the pyramid's largest count, not its own),
        # or did in an earlier sample of the job (a prompt within the budget, whose layers hold it whole, took the
        # job's count, a second graph, where it now replays the job's grown one)
        mark = ("content", self.method.name, self.budget, rows)
        content = self.job_lengths is not None and (
            self.method.capacities_from_content or mark in pool.marks or len(jobs) > 1
            or len({(max(caps), held) for idx, _, caps, held, *_ in plans if idx in self._method_index}) > 1)
        sharing = {idx: (held + extra, max(caps)) for idx, policy, caps, held, extra, _, differs in plans
                   if (policy.evict is not None or content) and not differs and idx in self._method_index
                   and not self.layer_specs[idx].sliding}
        shared = None
        if self.job_lengths is not None and sharing and (content or len({cap for _, cap in sharing.values()}) > 1):
            shared = max(need for need, _ in sharing.values())
            shared += -shared % GROW_ROUND
            if content:  # never fewer than this method's layers have had for this budget and bucket: a sample whose
                # allocation needs less than an earlier one's replays that graph (it only grows, a few times a job)
                shared = pool.marks[mark] = max(shared, pool.marks.get(mark, 0))
        if content and needs:  # heads of their own lengths in this sample (KVzip's, AdaKV's): the job's mark too, so
            # that a sample whose layers stay uniform (a prompt within the budget) replays the count a ragged one grew
            slots = pool.marks[mark] = max(slots, pool.marks.get(mark, 0))
            shared = None if shared is None else slots
        for idx, policy, caps, held, extra, compresses, differs in plans:
            layer = self._layers[idx]
            if differs:
                extra = slots - held
            elif shared is not None and idx in sharing:
                extra = shared - held
            extra += -(held + extra) % policy.slot_multiple  # whole pages of slots (Quest)
            if policy.source is not None:  # attends another layer's slots, keeps none (CLA's upper layers)
                held, extra = 0, 0
            state = ("acc",) * policy.accumulate + policy.state
            initial = self.method.static_state(layer, self._method_index[idx], held + extra) \
                if idx in self._method_index and not self.budget.is_full else ({}, {})
            static = StaticKVLayer.from_layer(layer, extra, state, rows, pool.taker((idx,), device),
                                              key_window=policy.key_window, initial=initial)
            static.borrows = policy.source is not None
            if compresses:
                self._captured_layer(compression, idx, layer, static, rows, pool)
            if policy.choose is not None:  # a selection later layers attend through (OmniKV's filter layer)
                source = policy.selection  # as wide as the layer's slots
                chosen = pool.take(("chosen", source), (rows, 1, static.values.shape[2]), torch.bool, device)
                self._chosen[source] = self._row_base(("chosen", source), chosen.zero_(), b)
            if policy.shared is not None:  # logits the layers naming the buffer write and read (POD's distant ones)
                hkv, slots_count = static.values.shape[1], static.values.shape[2]
                shape = (rows, hkv, self.num_heads // hkv, 1, slots_count)
                held_shared = self._shared.get(policy.shared)
                if held_shared is None:
                    base = pool.take(("shared", policy.shared), shape, torch.float32, device)
                    self._shared[policy.shared] = self._row_base(("shared", policy.shared), base.zero_(), b)
                elif tuple(held_shared.shape[1:]) != shape[1:]:
                    raise NotAvailableError(
                        f"engine.decode=graph: method {self.method.name!r} shares logits {policy.shared!r} between "
                        f"layers of {held_shared.shape[-1]} and {slots_count} slots; use engine.decode=eager")
            if policy.token_logp and self._token_logp is None:  # one for the step's layers, written outside them
                base = pool.take(("token_logp",), (rows, 1), torch.float32, device)
                self._token_logp = self._row_base(("token_logp", 0), base.zero_(), b)
            self._cache.layers[idx] = self._layers[idx] = static
            # the entries it holds from here on (``_record_resident``): one more per step, at most the capacity where
            # its step evicts (a row above its capacity, D2O's never-compressed ones: what it holds), or the count its
            # step's own schedule gives (StaticPolicy.entries)
            limit = _holds_none if policy.source is not None else \
                policy.entries or (None if policy.evict is None else max(max(caps), held))
            self._occupancy[idx] = (self._decode_step, held, limit)
            static.entries = held
            capacity = pool.take(("capacity", idx), (rows, 1, 1), torch.long, device)
            capacity[:b].copy_(torch.tensor(caps, device=device).view(-1, 1, 1))
            self._static[idx] = (policy, self._row_base(("capacity", idx), capacity, b))

    def _captured_layer(self, compression: CapturedCompression, idx: int, layer: KVLayer, static: StaticKVLayer,
                        rows: int, pool) -> None:
        """A layer compressed during decode under engine.compile: its static layer appends after the entries
        (``StaticKVLayer.fill``), its step's queries go to a ring of the pool; ``layer`` (the prefill's object) is
        the host layer the method compresses between blocks."""
        if layer.state or layer.key_channels is not None or layer.rope_pos is not None:
            raise NotAvailableError(f"engine.compile: method {self.method.name!r} leaves layer {idx} with per-entry "
                                    "state, pruned channels or re-rotated keys, which a decode compression between "
                                    "captured steps does not carry; use engine.compile=false")
        device = static.keys.device
        held = layer.num_entries
        static.fill = pool.take(("fill", idx), (), torch.long, device).fill_(held)
        if compression.spec is not None:  # a method's schedule keeps no queries
            ring = pool.take(("queries", idx), (rows, self.num_heads, compression.ring_len, static.keys.shape[-1]),
                             static.keys.dtype, device)
            compression.rings[idx] = (ring, pool.take(("queries_column", idx), (), torch.long, device).zero_())
        compression.layers[idx] = layer
        compression.fill[idx] = held
        b = layer.keys.shape[0]
        layer.keys, layer.values = static.keys[:b, :, :held], static.values[:b, :, :held]  # views: nothing held twice

    def compression_due_in(self) -> int | None:
        """Decode steps until the next compression during decode under engine.compile (the captured loop cuts its
        blocks there), or None."""
        compression = self._captured_compression
        if compression is None or not compression.layers:
            return None
        if compression.due is not None:  # the method's schedule, on the first compressed layer's counts
            first = next(iter(compression.layers))
            return compression.due_in(compression.fill[first], self._layers[first].seen)
        return self._captured_interval() - compression.count

    def _captured_interval(self) -> int:
        compression = self._captured_compression
        seen = self._layers[next(iter(compression.layers))].seen
        return compression.interval(compression.spec.target(seen, self.budget))

    def _captured_steps_done(self, steps: int) -> None:
        """After ``steps`` decode steps with the static layers (host-driven or captured): per step, the layers'
        slots in use grow by one and the resident curve gets its point, after a compression where the step is the
        ``interval``-th (then the host compresses every compressing layer: ``_compress_captured``)."""
        compression = self._captured_compression
        first = next(iter(compression.layers), None)
        for step in range(steps):
            self._decode_step += 1
            compression.count += 1
            compression.written += 1
            for idx in compression.fill:
                compression.fill[idx] += 1
            if compression.due is not None:  # the layers' counts already include every step of the block
                if first is not None and compression.due(compression.fill[first],
                                                         self._layers[first].seen - steps + step + 1):
                    self._after_forward_captured(steps - step - 1)
            elif compression.layers and compression.count >= self._captured_interval():
                self._compress_captured()
            self._record_resident(self._decode_step)

    def _compress_captured(self) -> None:
        """Every compressing layer compressed on the host as the eager path compresses it (``_compress_layer``): the
        slots in use as the eager layer holds them, the ring's queries in step order; the result back into the
        slots (``StaticKVLayer.hold_entries``)."""
        compression = self._captured_compression
        rows = next(iter(compression.layers.values())).keys.shape[0]  # the batch's real rows
        for idx, host in compression.layers.items():
            static = self._layers[idx]
            static.show_entries(host, rows, compression.fill[idx])
            target = compression.spec.target(host.seen, self.budget)
            self._compress_layer(idx, host, compression.queries(idx, rows), target, compression.scaling[idx])
            need = host.keys.shape[2] + compression.interval(target)
            if need > static.keys.shape[2]:  # a method keeping more than the target (AdaKV's heads): more slots
                self._grow_captured(idx, static, need)
            compression.fill[idx] = static.hold_entries(host, rows)
            host.keys, host.values = static.keys[:rows, :, : compression.fill[idx]], \
                static.values[:rows, :, : compression.fill[idx]]  # views: the host copies are freed
            self._decode_compressor.compressions.setdefault(idx, []).append(self._decode_step)
        compression.count = 0

    def _after_forward_captured(self, later: int) -> None:
        """The method's ``after_decode_forward`` at a forward its schedule names, between captured steps: every
        compressed layer as the host-driven path holds it (slots ``[0, fill)``), then the result back into the slots
        and each layer's slots grown where it needs more before the schedule's next forward. ``later``: steps of the
        block after this forward (none where the captured loop cut the block here, as it does)."""
        if later:
            raise RuntimeError(f"method {self.method.name!r}: its after_decode_forward was due {later} steps before "
                               "the end of a captured block (the captured loop cuts blocks at compression_due_in)")
        compression = self._captured_compression
        rows = next(iter(compression.layers.values())).keys.shape[0]  # the batch's real rows
        hosts = []
        for idx in self.compressed:
            host = compression.layers[idx]
            self._layers[idx].show_entries(host, rows, compression.fill[idx])
            hosts.append(host)
        last = hosts[-1]
        ctx = DecodeContext(layer_idx=len(hosts) - 1, num_layers=len(hosts), num_kv_heads=last.values.shape[1],
                            query=None, probs=None, capacity=last.capacity, scaling=None,
                            rope_inv_freq=self.rope_inv_freq)
        self.method.after_decode_forward(hosts, ctx)
        # the steps to the schedule's next forward, on the first compressed layer's counts (as compression_due_in)
        ahead = compression.due_in(hosts[0].keys.shape[2], hosts[0].seen, self._reserve) or 1
        for idx, host in zip(self.compressed, hosts):
            static = self._layers[idx]
            need = host.keys.shape[2] + ahead
            if need > static.keys.shape[2]:
                self._grow_captured(idx, static, need)
            compression.fill[idx] = static.hold_entries(host, rows)
            host.keys, host.values = static.keys[:rows, :, : compression.fill[idx]], \
                static.values[:rows, :, : compression.fill[idx]]  # views: the host copies are freed
        compression.count = 0

    def _grow_captured(self, idx: int, static: StaticKVLayer, need: int) -> None:
        """Layer ``idx`` needs ``need`` slots up to the next compression, more than it has: new slots (rounded up to
        ``GROW_ROUND``, so a slowly growing layout compiles a few more graphs, not one per compression), one log
        line."""
        import logging

        slots = need + -need % GROW_ROUND
        logging.getLogger("kvbench").info("engine.compile: method %r kept %d+ entries in layer %d during decode, more "
                                          "than its %d slots; %d slots from here (the captured step compiles again)",
                                          self.method.name, need, idx, static.keys.shape[2], slots)
        pool = slot_pool(self.model)
        static.grow(slots, pool.taker((idx,), static.keys.device))
        pool.marks[self._slot_mark] = max(pool.marks.get(self._slot_mark, 0), slots)  # the next generation's start
        if self._graph_live:
            from kvbench.engine.graph import mark_static

            mark_static(static.buffers())

    def _row_base(self, key: tuple, base: torch.Tensor, rows: int) -> torch.Tensor:
        """Remember ``base``, a buffer of the batch bucket's rows, for ``captured``; its first ``rows`` rows."""
        self._row_bases[key] = base
        return base[:rows]

    def _view_rows(self, rows: int, pad_from: int | None = None) -> None:
        """The capacities' and OmniKV's selections' buffers at their first ``rows`` rows (filling the rows after
        ``pad_from`` with its last row's, as ``StaticKVLayer.pad_rows`` does)."""
        for (kind, idx), base in self._row_bases.items():
            if pad_from is not None:
                repeat_last_row(base, pad_from, rows)
            if kind == "capacity":
                self._static[idx] = (self._static[idx][0], base[:rows])
            elif kind == "shared":
                self._shared[idx] = base[:rows]
            elif kind == "token_logp":  # the whole buffer is the step's own (StepBuffers.token_logp): the same
                # object, so the captured graph sees one input, not two aliasing ones
                self._token_logp = base if rows == base.shape[0] else base[:rows]
            else:
                self._chosen[idx] = base[:rows]

    def _layer_step(self, layer, idx: int, query: torch.Tensor, scaling: float):
        """One static layer's decode step (``engine.static.static_step``): the same function on the host-driven path
        (the first decode step) and inside the captured step."""
        policy, capacity = self._static[idx]
        spec = self.layer_specs[idx]
        chosen = self._chosen.get(policy.selection) if policy.selection is not None else None
        shared = self._shared.get(policy.shared) if policy.shared is not None else None
        if policy.source is not None:  # another layer's slots, this step's entry written there already (CLA)
            layer = self._layers[self.compressed[policy.source]]
        slots = StepSlots(layer.keys, layer.values, layer.positions, layer.valid, layer.state.get("acc"), capacity,
                          layer.row_state, chosen, query, scaling, self.rope_inv_freq, layer.key_channels,
                          spec.softcap, spec.sinks, layer.state, shared,
                          self._token_logp if policy.token_logp else None,
                          self._real_rows if self._graph_live else None)
        return static_step(slots, policy)

    def _static_decode(self, layer, idx: int, query: torch.Tensor, scaling: float):
        out, attended = self._layer_step(layer, idx, query, scaling)
        self._record_attended(attended, acts=idx in self._method_index)
        compression = self._captured_compression
        if compression is not None and idx in compression.rings:
            compression.write(idx, query)
            compression.scaling[idx] = scaling
        if not self._checked_decode and idx == self._last_attention_layer:
            self._check_first_decode_step()
        if idx == self._last_attention_layer and compression is not None:
            self._captured_steps_done(1)
        elif idx == self._last_attention_layer:
            self._decode_step += 1
            self._record_resident(self._decode_step)
        return out, None

    # ---- the captured decode step (engine/graph.py) ----------------------------------------------------------------
    def can_capture(self) -> bool:
        """Whether the next decode steps may run captured: ``engine.compile`` and every layer static already."""
        return bool(self.compile) and bool(self._static) and not self._static_pending and self._checked_decode

    def captured_step_function(self):
        """The compiled whole step (``engine.graph.compiled_decode_step``): a torch.compile backend named by
        ``compile`` (``"eager"``: capture only, for tests), else CUDA graphs on a GPU, inductor's kernels on a CPU."""
        from kvbench.engine.graph import compiled_decode_step

        if isinstance(self.compile, str) or callable(self.compile):
            return compiled_decode_step(self.compile, None)
        return compiled_decode_step(None, "reduce-overhead" if self.model.device.type == "cuda" else None)

    def graph_cache(self):
        return self._cache

    def token_logp(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Before the captured steps: the buffer of the log-probability of ``tokens`` ``(rows, 1)`` (the first captured
        step's input, a batch bucket's rows) under the last host-driven forward's prediction, which the layers of a
        method reading it (``StaticPolicy.token_logp``) see and every captured step rewrites for the next; None when
        no layer reads it."""
        if self._token_logp is None:
            return None
        base, real = self._row_bases[("token_logp", 0)], self._previous.shape[0]
        base[:real].copy_(torch.gather(self._previous, -1, tokens[:real]))
        repeat_last_row(base, real, base.shape[0])
        return base

    @contextlib.contextmanager
    def captured(self, rows: int, tensors: list[torch.Tensor], column: torch.Tensor, columns: int):
        """While the captured steps run: the static layers at ``rows`` rows (a batch bucket), written by the step's
        attention, every buffer a static address, the model on the ``kvbench_graph`` attention (no mask built, no
        cache length read), the session's hooks idle (the first decode step checked what they check). The entries
        the steps attend are summed per step of a read block (``column``: the step's column of the block, a 0-d
        device tensor of ``columns``; ``read_block`` adds them up after each read)."""
        from kvbench.engine.graph import mark_static

        layers = [self._layers[i] for i in sorted(self._attention_layers)]
        real = layers[0].keys.shape[0]
        for layer in layers:
            layer.pad_rows(rows)
            layer.captured = True
        self._view_rows(rows, pad_from=real)
        device = layers[0].keys.device
        pool = slot_pool(self.model)
        attended = pool.take(("attended",), (columns,), torch.long, device).zero_()
        self._real_rows = pool.take(("real_rows",), (rows,), torch.long, device).zero_()
        self._real_rows[:real] = 1  # the batch's rows among the bucket's (StepSlots.rows: the attended mean's)
        self._attended_acc = attended
        self._attended_column = column
        self._last_block = None
        rings = [] if self._captured_compression is None else \
            [t for ring in self._captured_compression.rings.values() for t in ring]  # decode compression's queries
        mark_static([t for layer in layers for t in layer.buffers()] + list(self._chosen.values()) +
                    list(self._shared.values()) + [self._static[i][1] for i in self._static] + tensors +
                    [attended, self._attended_column, self._real_rows] + rings)
        impl = self.model.config._attn_implementation
        self.model.set_attn_implementation(GRAPH_IMPL)
        CAPTURED_SESSION.append(self)
        self._graph_live = True
        try:
            yield
        finally:
            self._graph_live = False
            CAPTURED_SESSION.remove(self)
            self.model.set_attn_implementation(impl)
            for layer in layers:
                layer.captured = False
                layer.keep_rows(real)
            self._view_rows(real)
            # steps no read_block added (a caller that does not report its reads; zero after the captured loop's)
            self.stats.attended_entries_sum = self.stats.attended_entries_sum + attended.sum()
            if self.method.keeps_state_after_generation() and not self.budget.is_full:  # (D2O's carried thresholds)
                order = sorted(self._method_index, key=self._method_index.get)
                self.method.after_generation([self._layers[i] for i in order])

    def read_every(self) -> int | None:
        """Steps between the captured loop's reads of the chosen ids: every step for a method that carries its layers'
        state into the next sample (no step runs past the generation's end), else the loop's default."""
        return 1 if self.method.keeps_state_after_generation() and not self.budget.is_full else None

    def read_block(self, columns: int) -> None:
        """After the host read a block of ``columns`` captured steps: their attended entries join the stats (device
        ops, no read), the block's per-step sums are kept (``generation_ended`` takes back the steps run past the
        generation's end), and the sums start again at zero."""
        self._last_block = self._attended_acc[:columns].clone()
        self.stats.attended_entries_sum = self.stats.attended_entries_sum + self._last_block.sum()
        self._attended_acc.zero_()

    def advance(self, steps: int) -> None:
        """After ``steps`` captured steps: the host's counts (tokens seen per layer, layer calls) catch up."""
        for idx in self._attention_layers:
            self._layers[idx].seen += steps
        self.stats.decode_layer_calls += steps * len(self._attention_layers)
        if self._captured_compression is not None:  # the slots in use, and the compression closing the block
            self._captured_steps_done(steps)
            return
        for _ in range(steps):  # each step's point (host ints): a layer that fills to its capacity mid-block
            self._decode_step += 1
            self._record_resident(self._decode_step)

    def generation_ended(self, steps: int) -> None:
        """The generation ended after ``steps`` decode forwards, where the captured loop, which reads the chosen ids
        every few steps, ran a few more past the last row's end (their ids are dropped). The resident curve and the
        static layers' counts (the final resident bytes) are cut back to that step, as the host-driven path ended
        there; a layer compressed during decode reports what it held after that step (its slots keep what the extra
        steps appended and compressed: done, not the generation's)."""
        curve = self.stats.resident_curve
        if not curve or curve[-1][0] <= steps:
            return
        extra = curve[-1][0] - steps  # the steps run past the end, all in the last read block
        block = self._last_block
        if block is not None and extra <= block.shape[0]:  # the stats count the generation's steps only
            self.stats.attended_entries_sum = self.stats.attended_entries_sum - block[block.shape[0] - extra:].sum()
            self.stats.decode_layer_calls -= extra * len(self._attention_layers)
        after = next(i for i, (step, _) in enumerate(curve) if step > steps)
        (s0, e0), (s1, e1) = curve[after - 1], curve[after]
        entries = e0 + (e1 - e0) * (steps - s0) / (s1 - s0)  # the curve is linear between its points
        del curve[after:]
        if curve[-1][0] < steps:
            self.stats.add_resident_point(steps, int(entries) if float(entries).is_integer() else round(entries, 2))
        fill = self._captured_compression.fill if self._captured_compression is not None else {}
        for idx in self._occupancy:
            if idx in self._static and idx not in fill:
                self._layers[idx].entries = self._static_entries(idx, steps)
                if self._occupancy[idx][2] is None:  # its step frees none: each step past the end wrote one entry
                    self._layers[idx].past_end = extra  # per (row, head) (what a ragged one's count leaves out)
            elif idx in fill:  # what it held after that step (its slots keep the later steps' entries and compressions)
                held = self._captured_compression.held_at(steps, idx)
                self._layers[idx].entries = fill[idx] if held is None else held

    def _static_entries(self, idx: int, step: int) -> int:
        """The entries static layer ``idx`` holds after decode step ``step`` (``_occupancy``: what it held when it
        turned static, one more per step since, at most its capacity where its step evicts, or what its step's schedule
        holds)."""
        start, held, limit = self._occupancy[idx]
        if callable(limit):  # StaticPolicy.entries
            return limit(held, max(step - start, 0))
        count = held + max(step - start, 0)
        return count if limit is None else min(count, limit)

    def captured_attend(self, module, query, key, value, **kwargs):
        """A layer of the captured step: the step's key/value into a free slot, then the layer's static step. Pure
        tensor code; every tensor it writes was allocated before the first step."""
        idx = module.layer_idx
        layer = self._layers[idx]
        position_ids = kwargs["position_ids"]
        if not layer.borrows:
            layer.write_step(key, value, position_ids.view(position_ids.shape[0], -1)[:, -1:])
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        out, attended = self._layer_step(layer, idx, query, scaling)
        self._attended_acc.index_add_(0, self._attended_column.view(1), attended.view(1))
        if self._captured_compression is not None and idx in self._captured_compression.rings:
            self._captured_compression.write(idx, query)
        return out, None

    # ---- compression is verified, never assumed -----------------------------------------------------------------
    def _start_forward(self, module, args, kwargs):
        if self._graph_live:
            return
        self._attached.clear()
        self._use_cache = kwargs.get("use_cache")

    def _check_forward(self, module, args, kwargs, output):
        """After every forward of the model: a cached forward must have attended through a KVLayer on every attention
        layer. A transformers release that passes the cache under a new name, or an architecture whose attention does
        not go through ``AttentionInterface``, stops the job here instead of running FullKV under the method's name.
        The captured steps are not checked here: the first decode step, host-driven, was (``captured``)."""
        if self._graph_live:
            return
        if self._use_cache is False or (self._use_cache is None and output_cache(output) is None):
            return  # no cache: nothing to compress (a scoring forward)
        missing = sorted(self._attention_layers - self._attached)
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            raise CompressionInactiveError(
                f"method {self.method.name!r} was not attached to attention layer(s) {shown} of "
                f"{type(self.model).__name__} in a cached forward (kvbench found no cache layer there); refusing to "
                f"report FullKV numbers under its name; {versions_line()}"
            )

    # ---- the model's predictions, for methods that need them (needs_logits) ----------------------------------------
    def _capture_input_ids(self, module, args, kwargs):
        if self._graph_live:  # the captured step's tokens' log-probabilities are its own (engine.graph.decode_step)
            return
        self._input_ids = kwargs.get("input_ids", args[0] if args else None)
        self._hidden = None
        ids, logp = self._input_ids, self._token_logp
        if logp is not None and self._previous is not None and ids is not None and ids.shape[1] == 1 and \
                self._previous.shape[0] == ids.shape[0] == logp.shape[0]:
            # a host-driven step on static layers (the first decode step): its token's log-probability, for the
            # layers' own steps (StaticPolicy.token_logp), which evict there instead of in observe_logits
            self._token_logp.copy_(torch.gather(self._previous, -1, self._input_ids[:, -1:]))

    def _capture_hidden(self, module, args, output):
        if self._graph_live:
            return
        self._hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def _observe_logits(self, module, args, kwargs, output):
        if self._graph_live:
            return
        prefill, self._prefill_forward = self._prefill_forward, False
        layers = [self._layers.get(i) for i in sorted(self._attention_layers)]
        if any(layer is None for layer in layers) or self._hidden is None:
            return  # use_cache=False: no cache to act on
        if self._input_ids is None:
            raise NotAvailableError(f"method {self.method.name!r} scores the input tokens: call the model with "
                                    "input_ids (inputs_embeds were given)")
        logits = TokenLogits(self._hidden, self.model.get_output_embeddings(), None if prefill else self._previous)
        if not self.budget.is_full and (prefill or not self._static):  # static layers: their own steps did it
            self.method.observe_logits([self._layers[i] for i in self.compressed], self._input_ids, logits)
            if not prefill:  # a decode step's entries are those held after its eviction, as every method's are
                self._record_resident(self._decode_step)
        self._previous = logits.last()
        if prefill:  # the method may have compressed the prompt only now: measure what stays
            self._record_prefill_stats(layers, check=True)
            if self.compile and not self.budget.is_full:  # the captured step starts from that (_finish_prefill)
                self._to_static()

    # ---- scoring forwards: KVzip's context reconstruction (Method.needs_reconstruction) --------------------------
    def _reconstruct(self, module, args, kwargs, output):
        """After the prompt's forward of a method that scores entries by the context's reconstruction: one forward
        per chunk ``Method.reconstruction_chunks`` gives (the repeat prompt and the chunk's tokens, with the cache
        attached), each layer attending over the whole cache as usual and handing the method the repeat tokens'
        queries (``Method.score_reconstruction``); the repeat tokens then leave the cache (``KVLayer.drop_newest``).
        Then ``Method.finish_reconstruction`` evicts, and the prompt's resident bytes are measured and checked."""
        if not self._reconstruct_pending or self._reconstructing is not None:
            return
        self._reconstruct_pending = False
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise NotAvailableError(f"method {self.method.name!r} reconstructs the input tokens: call the model with "
                                    "input_ids (inputs_embeds were given)")
        layers = [self._layers[i] for i in sorted(self._attention_layers)]
        cache, device = self._cache, input_ids.device
        try:
            for start, end, ids in self.method.reconstruction_chunks(input_ids[0].tolist(), self.tokenizer):
                first, q = layers[0].seen, len(ids)
                self._reconstructing, self._reconstruct_mask = (start, end), None
                self.model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1,
                           position_ids=torch.arange(first, first + q, device=device).view(1, -1),
                           **cache_kwargs(self.model, cache))
                for layer in layers:
                    layer.drop_newest(q)
        finally:
            self._reconstructing, self._reconstruct_mask = None, None
        self.method.finish_reconstruction([self._layers[i] for i in self.compressed])
        self._record_prefill_stats(layers, check=True)
        if self.compile:  # the scoring forwards ran on the prefill's layers: the static ones start from their result
            self._to_static()

    def _reconstruct_attend(self, impl, backend, module, layer, query, kwargs):
        """A repeat forward's layer: the model's attention over the whole cache (causal among the repeat tokens), and
        the method's scores from the repeat tokens' queries. No decode statistics, no decode hook.

        A layer the backend can read as it is (every entry valid, KV-head-granular, full attention, no soft-cap or
        sinks) attends through the backend itself, as a plain continued forward would (sdpa: the fused kernel), with
        an additive mask built once per forward (a bool mask would be converted per layer); otherwise through
        ``grouped_attention``, which materialises ``(B, Hkv, g, q, T)`` probabilities: at 4k on SmolLM2 that path took
        111 s of a 200 s KVzip prefill (1 CPU thread), the backend about 20 s."""
        idx = module.layer_idx
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        spec = self.layer_specs[idx]
        plain = impl in ("sdpa", "eager") and layer.ragged is None and layer.valid is None
        plain = plain and layer.keys.shape[1] == self.num_kv_heads and layer.key_channels is None
        if plain and not spec.sliding and spec.softcap is None and spec.sinks is None:
            mask = self._repeat_mask(query, layer.num_entries)
            out, _ = backend(module, query, layer.keys, layer.values, mask, **kwargs)
        else:
            ctx = DecodeContext(layer_idx=self._method_index.get(idx, idx), num_layers=len(self.compressed),
                                num_kv_heads=layer.values.shape[1], query=query, probs=None, capacity=layer.capacity,
                                scaling=scaling)
            out, _, _ = self._engine_attention(backend, module, layer, query, scaling, ctx, kwargs, acts=False)
        if idx in self._method_index:
            start, end = self._reconstructing
            few = layer.keys.device.type == "cuda" if self.few_kernels is None else self.few_kernels
            self.method.score_reconstruction(self._method_index[idx], layer, query, start, end, scaling,
                                             few_kernels=few)
        return out, None

    def _repeat_mask(self, query: torch.Tensor, entries: int) -> torch.Tensor:
        """The repeat forward's additive mask ``(1, 1, q, T)``: 0 where a query may look (every cached entry, the
        repeat tokens causally), -inf elsewhere; built at the forward's first layer, shared by the others."""
        q, device = query.shape[2], query.device
        mask = self._reconstruct_mask
        if mask is None or mask.shape[-2:] != (q, entries) or mask.dtype != query.dtype:
            newest = torch.arange(entries - q, entries, device=device).view(-1, 1)  # each query's own entry
            hidden = torch.arange(entries, device=device) > newest
            mask = torch.zeros(1, 1, q, entries, dtype=query.dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._reconstruct_mask = mask
        return mask

    # ---- the attention call ------------------------------------------------------------------------------------
    def attend(self, impl, module, query, key, value, attention_mask, **kwargs):
        layer = self._layers.get(module.layer_idx)
        backend = backend_function(impl)
        if layer is None:  # use_cache=False: nothing to compress (a cached forward fails in _check_forward)
            return backend(module, query, key, value, attention_mask, **kwargs)
        self._attached.add(module.layer_idx)
        idx = module.layer_idx
        if self._reconstructing is not None:
            return self._reconstruct_attend(impl, backend, module, layer, query, kwargs)
        q_len = query.shape[2]
        position_ids = kwargs.get("position_ids")
        static = isinstance(layer, StaticKVLayer)
        if position_ids is not None and static:
            layer.assign_positions(position_ids.view(position_ids.shape[0], 1, -1)[..., -1:])
        elif position_ids is not None:
            pos = position_ids.view(position_ids.shape[0], 1, -1)[..., -q_len:]
            layer.positions[..., -q_len:] = pos.expand(layer.positions.shape[0], layer.positions.shape[1], q_len)
            if layer.rope_pos is not None:
                layer.rope_pos[..., -q_len:] = layer.positions[..., -q_len:].float()
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        if layer.seen == q_len:
            return self._prefill(backend, module, layer, query, key, value, attention_mask, scaling, kwargs)
        if static:
            return self._static_decode(layer, idx, query, scaling)
        return self._decode(backend, module, layer, query, scaling, kwargs)

    def _prefill(self, backend, module, layer, query, key, value, attention_mask, scaling, kwargs):
        b, n = query.shape[0], query.shape[2]
        idx, spec = module.layer_idx, self.layer_specs[module.layer_idx]
        if idx == 0:  # padding, prompt lengths and budgets are the same for every layer of a forward
            self._prefill_forward = True
            key_valid = _key_valid(attention_mask, n)
            prompt_lens = key_valid.sum(-1) if key_valid is not None else torch.full((b,), n, device=query.device)
            left = False  # each row's tokens are its last ones (left padding): read with the lengths
            if key_valid is None:
                lens = [int(x) for x in prompt_lens.tolist()]
            else:
                tail = torch.arange(n, device=query.device).view(1, n) >= (n - prompt_lens).view(b, 1)
                *lens, left = (int(x) for x in torch.cat([prompt_lens, (key_valid == tail).all().view(1)]).tolist())
            caps = [self.budget.tokens_for(x) for x in lens]
            capacity = torch.tensor(caps, device=query.device)
            self._prompt = (key_valid, prompt_lens, capacity, (lens, caps), left)
            self.stats = SessionStats(prompt_lens=lens)
            self._decode_step = 0
            if self._decode_compressor is not None:
                self._decode_compressor.reset()
                self._captured_compression = None  # a new one with the static layers (_to_static)
            self._static.clear()
            self._first_step_attended = []
            self._check_budget_minimum()
            self._checked_decode = False
        key_valid, prompt_lens, capacity, host, left_padded = self._prompt
        if key_valid is not None:
            # (key_valid is None where no key is padding: this mask has an empty slot, stored without a read)
            layer.valid = key_valid.view(b, 1, n).expand(b, layer.keys.shape[1], n).clone()
        if idx not in self._verified:
            self._verify_layer_reading(idx, spec, attention_mask, n, key_valid)
        acts = not self.budget.is_full and idx in self._method_index
        # the prompt's attention is plain causal softmax attention, which a method may compute itself
        plain = spec.softcap is None and spec.sinks is None and (spec.window is None or n < spec.window)
        ctx = PrefillContext(
            layer_idx=self._method_index.get(idx, idx), num_layers=len(self.compressed), num_heads=self.num_heads,
            num_kv_heads=layer.keys.shape[1], scaling=scaling, queries=query, key_valid=key_valid,
            prompt_lens=prompt_lens, capacity=capacity, rope_inv_freq=self.rope_inv_freq, plain_causal=plain,
            few_kernels=query.device.type == "cuda" if self.few_kernels is None else self.few_kernels, host=host,
            left_padded=bool(left_padded),
        )
        windowed = spec.sliding and n >= spec.window  # the layer's reach is shorter than the prompt
        out = self.method.prefill_attend(layer, ctx) if acts and not windowed else None  # Λ-masks (LM-Infinite, CaM)
        if out is None:
            out, _ = backend(module, query, key, value, attention_mask, **kwargs)
        prompt_ctx = ctx
        if windowed:  # the next query reaches back window - 1 tokens: nothing older stays
            layer.drop_oldest(n - (spec.window - 1))
            if acts:  # sliding_layers=compress: the method sees the window's tokens as its prompt
                ctx = _window_context(ctx, layer)
                self.method.prefill_attend(layer, ctx)  # its state only: the prompt's attention is the model's
        layer.set_capacity(ctx.capacity, ctx.host_ints()[1])
        if acts:
            layer.defer_valid_check = True  # the layer's new mask is read with the others' (_finish_prefill)
            try:
                self.method.prefill(layer, ctx)
            finally:
                layer.defer_valid_check = False
        if idx == self._last_attention_layer:
            self._finish_prefill(prompt_ctx)
        return out, None

    def _verify_layer_reading(self, idx: int, spec: LayerAttention, mask, n: int, key_valid) -> None:
        """Once per layer, at the first prefill whose prompt exceeds the layer's window (or any, for a full layer):
        the engine's reading of the layer (full, or a window of w) must match the mask the model built, whose last
        row lets the last query see exactly ``spec.visible_keys(n)`` real keys. A family whose window kvbench misreads
        fails here, in one line, instead of decoding with the wrong reach. Masks the model does not materialise (the
        sdpa and flash paths without padding) tell nothing and are not checked."""
        if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] != n:
            return
        if spec.sliding and n <= spec.window:
            return  # the window is not visible yet: check at a longer prompt
        row = mask[0, 0, -1, :n]
        seen = int((row if row.dtype == torch.bool else row == 0).sum())
        padding = 0 if key_valid is None else int((~key_valid[0]).sum())
        expected = spec.visible_keys(n - padding) if spec.sliding else n - padding
        self._verified.add(idx)
        if seen != expected:
            raise CompressionInactiveError(
                f"kvbench reads attention layer {idx} of {type(self.model).__name__} as {spec.describe()}, but the "
                f"model's mask lets the last of {n} queries see {seen} keys (expected {expected}); refusing to run a "
                f"model kvbench would change; {versions_line()}"
            )

    def _check_budget_minimum(self) -> None:
        """The plan's own budget check (``kvbench.budget.check_budget``) on each row's prompt: the plan can only check
        a ratio on the longest prompt a model takes, and a ratio resolves per prompt, so one that would compress a
        shorter prompt below the method's minimum (SnapKV's observation window) stops the job here (host ints only)."""
        for n in self.stats.prompt_lens:
            check_budget(self.budget, self.method, n, f"for a prompt of {n} tokens")

    def _finish_prefill(self, ctx: PrefillContext) -> None:
        """After the last layer: cross-layer decisions (D2O's allocation, DynamicKV's last update), then stats."""
        layers = [self._layers[i] for i in sorted(self._attention_layers)]
        check_deferred_valid(layers)  # the masks the layers' prefill stored unread, in one read
        if not self.budget.is_full:
            self.method.finish_prefill([self._layers[i] for i in self.compressed], ctx)
            unordered = [i for i in self.compressed if not self._layers[i].position_ordered]
            if unordered:  # a method's working order (KVLayer.gather(..., position_order=False)) must not reach decode
                raise RuntimeError(f"method {self.method.name!r} left attention layers {unordered} out of position "
                                   "order after its prefill (KVLayer.sort_by_position)")
        for i in self.compressed:  # compact positions are the compressed layers' (their RoPE: _rope_inv_freq)
            self._rerotate(self._layers[i])
        # a method that scores by the model's predictions evicts only in observe_logits, one that scores entries by
        # the context's reconstruction only after its repeat forwards (_reconstruct): each checks there
        reconstructs = getattr(self.method, "needs_reconstruction", False) and not self.budget.is_full
        self._reconstruct_pending = reconstructs
        self._record_prefill_stats(layers, check=not self.method.needs_logits and not reconstructs)
        # reconstructs: static after it (_reconstruct); scores by the model's predictions: after the prompt's
        # observe_logits (_observe_logits)
        self._static_pending = bool(self.compile) and not reconstructs
        later = reconstructs or self.method.needs_logits
        if self.compile and (self.budget.is_full or not (self.method.static_after_first_step() or later)):
            self._to_static()

    def _record_resident(self, step: int) -> None:
        """The resident curve's point at ``step`` (host ints: the layers' lengths, no device read). A static layer
        counts the entries it holds, as the host-driven path's layer does (not its slots, which follow the batch
        bucket and the job's longest prompt): what it held when it turned static plus one per step since, at most its
        capacity where its step evicts (``_occupancy``); a layer compressed during decode, its slots in use."""
        counts = []
        fill = self._captured_compression.fill if self._captured_compression is not None else {}
        for i in sorted(self._attention_layers):
            layer = self._layers.get(i)
            if layer is None:
                continue
            if i in fill:
                count = fill[i]
                self._captured_compression.log(step, i, count)
            elif i in self._static and i in self._occupancy:
                count = self._static_entries(i, step)
            else:
                count = layer.num_entries
            if i in self._static:
                layer.entries = count  # its resident bytes (StaticKVLayer.resident_bytes)
                count = layer.keys_held(count)  # what the host-driven layer's length counts: its keys (POD's trimmed)
            counts.append(count)
        if counts:
            mean = sum(counts) / len(counts)
            self.stats.add_resident_point(step, int(mean) if float(mean).is_integer() else round(mean, 2))

    def _compress_during_decode(self, idx: int, layer: KVLayer, query: torch.Tensor, scaling: float) -> None:
        """Buffer the step's queries of layer ``idx``; every ``interval`` steps the method compresses the layer
        (``Method.compress_decoded``) over everything it holds, the buffer as the queries (kvpress DecodingPress)."""

        def target_for() -> int:
            return self._decode_compressor.spec.target(layer.seen, self.budget)

        def compress(queries: torch.Tensor, target: int) -> None:
            self._compress_layer(idx, layer, queries, target, scaling)

        self._decode_compressor.after_step(idx, query, target_for, compress, self._decode_step + 1)

    def _compress_layer(self, idx: int, layer: KVLayer, queries: torch.Tensor, target: int, scaling: float) -> None:
        """One decode-time compression of layer ``idx`` (``Method.compress_decoded``), eager and captured paths."""
        few = layer.keys.device.type == "cuda" if self.few_kernels is None else self.few_kernels
        ctx = decode_context(layer, queries, target, self._method_index[idx], len(self.compressed),
                             self.num_heads, scaling, self.rope_inv_freq, few)
        self.method.compress_decoded(layer, ctx)

    def _record_prefill_stats(self, layers: list[KVLayer], check: bool) -> None:
        self.stats.resident_curve = []
        self._record_resident(0)
        self.stats.resident_kv_bytes_after_prefill = sum(layer.resident_bytes() for layer in layers)
        # mean over KV heads of row 0 (heads can keep different numbers: KVMerger's ragged sets); one device read
        means = torch.stack([layer.valid_counts()[0].float().mean() for layer in layers]).tolist() if layers else []
        self.stats.layer_entries_after_prefill = [int(m) if m.is_integer() else round(m, 2) for m in means]
        if check and self._expected_compression() == "prefill":
            self._check_evicted("after prefill")
        if check and not self.budget.is_full:
            self._check_key_channels()

    def _check_key_channels(self) -> None:
        """A method that prunes key channels (``Method.expected_key_channels``) must have left every layer it compresses
        with that many channels per key (stored: ``keys.shape[-1]``; ``kvpress_zero``: that many channels not all zero
        in every head): compression is verified, never assumed."""
        for i in self.compressed:
            layer = self._layers[i]
            expected = self.method.expected_key_channels(layer.values.shape[-1])
            if expected is None:
                return
            held = layer.keys.shape[-1] if layer.key_channels is not None else \
                int((layer.keys != 0).any(dim=2).sum(-1).max())
            if held > expected:
                raise CompressionInactiveError(
                    f"method {self.method.name!r} should keep {expected} key channels per head but layer {i} holds "
                    f"keys with {held}; refusing to report its numbers; {versions_line()}"
                )

    def _expected_compression(self) -> str:
        """What this sample's longest prompt must show for the method ("prefill", "decode", "attention") or "none"
        (a full budget, a prompt within the budget, a method that keeps everything): host ints only."""
        if self.budget.is_full or not self.stats.prompt_lens:
            return "none"
        return self.method.expected_compression(self.budget, max(self.stats.prompt_lens), len(self.compressed))

    def _check_evicted(self, when: str) -> None:
        """An evicting method on a prompt longer than the budget must have shrunk some layer it compresses below what
        the layer holds uncompressed (its window, for a sliding layer); host ints only."""
        layers = [self._layers[i] for i in self.compressed]
        full = [self._uncompressed_entries(i) for i in self.compressed]
        budget = self.budget.tokens_for(max(self.stats.prompt_lens))
        must = [(layer, size) for layer, size in zip(layers, full) if size > budget]
        if must and all(layer.num_entries >= size for layer, size in must):
            n = max(self.stats.prompt_lens)
            raise CompressionInactiveError(
                f"method {self.method.name!r} at budget={self.budget.label()} kept all {n} tokens of the prompt in "
                f"every layer {when} (resident KV = the uncompressed size); refusing to report FullKV numbers under "
                f"its name; {versions_line()}"
            )

    def _uncompressed_entries(self, idx: int) -> int:
        """Entries layer ``idx`` holds with nothing compressed: the tokens seen, at most ``window - 1`` when sliding."""
        seen, window = self._layers[idx].seen, self.layer_specs[idx].window
        return seen if window is None else min(seen, window - 1)

    def _check_first_decode_step(self) -> None:
        """Once per sample, after the first decode step's last layer: methods that evict at decode time must have
        shrunk the cache; methods that restrict attention must have attended to fewer entries than the prompt."""
        self._checked_decode = True
        expected = self._expected_compression()
        if expected == "decode":
            self._check_evicted("after the first decode step")
        elif expected == "attention":  # over the layers the method acts on (sliding ones attend their window)
            steps = self._first_step_attended
            attended = float(sum(steps)) / len(steps) if steps else 0.0
            n = max(self.stats.prompt_lens)
            if attended >= n:
                raise CompressionInactiveError(
                    f"method {self.method.name!r} at budget={self.budget.label()} attended to {attended:.0f} entries "
                    f"per layer and head at its first decode step, the whole {n}-token prompt and more; refusing to "
                    f"report FullKV numbers under its name; {versions_line()}"
                )

    def _decode(self, backend, module, layer, query, scaling, kwargs):
        idx, spec = module.layer_idx, self.layer_specs[module.layer_idx]
        acts = not self.budget.is_full and idx in self._method_index  # as in prefill and the captured step
        ctx = DecodeContext(
            layer_idx=self._method_index.get(idx, idx), num_layers=len(self.compressed),
            num_kv_heads=layer.values.shape[1], query=query, probs=None, capacity=layer.capacity, scaling=scaling,
            rope_inv_freq=self.rope_inv_freq,
        )
        if self.position_mode == "compact" and acts:
            self._rerotate(layer)
        out = self.method.attend(layer, ctx) if acts else None  # a method's own decode attention (POD); None: ours
        if out is not None:
            valid, entries = layer.valid, layer.values.shape[2]
        else:
            out, valid, entries = self._engine_attention(backend, module, layer, query, scaling, ctx, kwargs, acts)
        if ctx.attended is not None:
            attended = ctx.attended
        else:  # padded caches (KVMerger, D2O's padded heads): a device scalar, summed without a host read
            attended = valid.sum() // valid[..., 0].numel() if valid is not None else entries
        self._record_attended(attended, acts)
        if acts:
            self.method.decode(layer, ctx)
            if self._decode_compressor is not None:
                self._compress_during_decode(idx, layer, query, scaling)
        if spec.sliding:
            self._bound_to_window(layer, spec.window, untouched=not acts)
        if idx == self._last_attention_layer and not self.budget.is_full and self.method.acts_after_decode_forward():
            self.method.after_decode_forward([self._layers[i] for i in self.compressed], ctx)  # across layers
        if idx == self._last_attention_layer:
            self._decode_step += 1
            if not self.method.needs_logits or self.budget.is_full:  # else after its eviction (_observe_logits)
                self._record_resident(self._decode_step)
        if not self._checked_decode and idx == self._last_attention_layer:
            self._check_first_decode_step()
        if self._static_pending and idx == self._last_attention_layer:  # static_after_first_step: from the next step
            self._to_static()
        return out, None

    def _record_attended(self, attended, acts: bool) -> None:
        """One layer's decode step attended ``attended`` entries per (row, head) (a device scalar or an int): summed for
        the stats; kept for the first step's compression check when the method acts on the layer."""
        self.stats.attended_entries_sum += attended
        self.stats.decode_layer_calls += 1
        if acts and not self._checked_decode:
            self._first_step_attended.append(attended)

    def _bound_to_window(self, layer: KVLayer, window: int, untouched: bool) -> None:
        """After a forward: a sliding layer keeps what the next query can reach, the last ``window - 1`` positions
        (a contiguous tail when no method acted on it: a slice, no device read)."""
        if untouched:
            layer.drop_oldest(layer.num_entries - (window - 1))
        else:
            layer.keep_after(layer.positions.amax(-1, keepdim=True)[:, :1] - window + 2)

    def _engine_attention(self, backend, module, layer, query, scaling, ctx, kwargs, acts=True):
        q_len = query.shape[2]
        spec = self.layer_specs[module.layer_idx]
        selected = self.method.select(layer, ctx) if acts else None
        keys, values, valid = layer.attention_view()  # a ragged layer: a transient padded copy, freed after the layer
        if selected is not None:
            idx = selected.unsqueeze(-1)
            keys = torch.gather(keys, 2, idx.expand(*selected.shape, keys.shape[-1]))
            values = torch.gather(values, 2, idx.expand(*selected.shape, values.shape[-1]))
            valid = torch.gather(valid, -1, selected) if valid is not None else None
        if layer.key_channels is not None:  # channel-pruned keys (ThinK): q.k over the kept channels, the same scale
            query = layer.gather_query(query)
        # the backend repeats KV heads by the model's group size: only valid for KV-head-granular caches
        fast = not (acts and self.method.needs_decode_probs) and valid is None and q_len == 1
        fast = fast and keys.shape[1] == self.num_kv_heads and layer.key_channels is None
        if fast:  # numerically the backend's own decode path (FullKV == plain generate)
            out, _ = backend(module, query, keys, values, None, **kwargs)
        else:
            allowed = _decode_allowed(valid, keys.shape[:2], keys.shape[2], q_len, query.device)
            if spec.sliding and q_len > 1:  # a continued forward: each new query reaches back window - 1 tokens
                positions = layer.positions if selected is None else torch.gather(layer.positions, -1, selected)
                reach = positions.unsqueeze(2) > positions[..., -q_len:].unsqueeze(-1) - spec.window
                allowed = reach if allowed is None else allowed & reach
            out, probs = grouped_attention(query, keys, values, allowed, scaling, spec.softcap, spec.sinks)
            ctx.probs = probs
        return out, valid, keys.shape[2]

    # ---- compact positions (StreamingLLM's in-cache positions) -------------------------------------------------
    def _rope_inv_freq(self, strict: bool = True) -> torch.Tensor | None:
        """The RoPE inverse frequencies of the layers methods act on. Models with a RoPE per layer type (Gemma 3: a
        local base for sliding layers, a global one for full layers) give the full layers' (what methods compress by
        default); such a model under ``sliding_layers=compress`` would need both, and gets none."""
        params = getattr(self.model.config, "rope_parameters", None) or {}
        per_type = "full_attention" in params
        if per_type:
            if self.sliding_layers == "compress" and len({str(v) for v in params.values()}) > 1:
                if strict:
                    raise ConfigError("position_mode=compact with sliding_layers=compress needs one RoPE for every "
                                      "layer; this model has one per layer type")
                return None
            params = params["full_attention"]
        rope_type = params.get("rope_type", "default")
        if not strict:
            try:
                return self._rope_inv_freq()
            except ConfigError:
                return None
        if rope_type not in _ROTATABLE_ROPE:
            raise ConfigError(
                f"position_mode=compact needs a position-independent RoPE; rope_type={rope_type!r} is not one of "
                f"{', '.join(_ROTATABLE_ROPE)}"
            )
        prefix = "full_attention_" if per_type else ""
        for module in self.model.modules():
            inv_freq = getattr(module, f"{prefix}inv_freq", None)
            if inv_freq is not None and float(getattr(module, f"{prefix}attention_scaling", 1.0)) == 1.0:
                return inv_freq.detach().float()
        raise ConfigError("position_mode=compact: the model has no rotary embedding with attention_scaling 1")

    def _rerotate(self, layer: KVLayer) -> None:
        """Re-rotate keys so that relative distances equal those of a cache whose entries sit at 0..count-1."""
        if self.position_mode != "compact":
            return
        if layer.ragged is not None:
            raise NotAvailableError("position_mode=compact cannot re-rotate a ragged cache layer; use "
                                    "position_mode=original")
        if layer.key_channels is not None:
            raise NotAvailableError(f"position_mode=compact re-rotates keys by RoPE pairs; method {self.method.name!r} "
                                    "pruned key channels; use position_mode=original")
        rope_pos = layer.rope_pos if layer.rope_pos is not None else layer.positions.float()

        rank = real_rank(layer).float()
        counts = layer.valid_counts().unsqueeze(-1).float()
        latest = layer.positions.amax(-1, keepdim=True).float()
        target = torch.where(rank >= 0, latest - counts + 1 + rank, rope_pos)
        delta = target - rope_pos
        if bool((delta != 0).any()):
            layer.keys = rotate_keys(layer.keys, delta, self._inv_freq.to(layer.keys.device))
        layer.rope_pos = target


def _check_plain_logit_head(model) -> None:
    """``TokenLogits`` computes logits as ``head(hidden)``: refuse models that post-process them."""
    cfg = model.config
    for attr, neutral in (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0)):
        value = getattr(cfg, attr, None)
        if value is not None and value != neutral:
            raise NotAvailableError(
                f"this model post-processes its logits ({attr}={value}); methods that score tokens by the model's "
                "predictions (needs_logits) support plain output heads only"
            )


def _key_valid(attention_mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Per-key validity ``(B, n)`` from the model's 4-D prefill mask: a key some query attends is a real token (the
    last row alone would miss the keys a sliding-window mask hides from it)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    rows = attention_mask[:, 0, :, :n]
    valid = (rows if rows.dtype == torch.bool else rows == 0).any(dim=1)
    return None if bool(valid.all()) else valid


def _window_context(ctx: PrefillContext, layer: KVLayer) -> PrefillContext:
    """The prefill as a method acting inside a sliding window sees it (``sliding_layers=compress``): the window's
    tokens are the prompt, its queries the last ones, its budget at most the window."""

    m = layer.num_entries
    key_valid = ctx.key_valid[:, -m:] if ctx.key_valid is not None else None
    prompt_lens = torch.clamp(ctx.prompt_lens, max=m)
    lens, caps = ctx.host_ints()
    lens = [min(x, m) for x in lens]
    return replace(ctx, queries=ctx.queries[..., -m:, :], key_valid=key_valid, prompt_lens=prompt_lens,
                   capacity=torch.minimum(ctx.capacity, prompt_lens), column_sums=None,
                   host=(lens, [min(c, x) for c, x in zip(caps, lens)]))


def _decode_allowed(valid, bh, entries, q_len, device) -> torch.Tensor | None:
    """Mask ``(B, H, q, T)`` for decode/continuation: valid entries, causal among the ``q_len`` newest."""
    allowed = None
    if q_len > 1:
        i = torch.arange(q_len, device=device).view(-1, 1)
        j = torch.arange(entries, device=device).view(1, -1)
        allowed = (j <= entries - q_len + i).view(1, 1, q_len, entries).expand(*bh, q_len, entries)
    if valid is not None:
        v = valid.unsqueeze(2)
        allowed = v.expand(*bh, q_len, entries) if allowed is None else allowed & v
    return allowed
