"""The method contract.

A method is a small dataclass whose fields are its hyperparameters (paper defaults). The engine calls it at up to
three points, one layer at a time (plus one call across layers after prefill) and never with a model class in sight:

* ``prefill(layer, ctx)`` once per layer at the end of the prompt forward pass (select / evict / merge /
  allocate), after the layer's attention output was computed with the full prompt; then
  ``finish_prefill(layers, ctx)`` once with every layer, for decisions across layers (D2O, DynamicKV);
* ``decode(layer, ctx)`` after every decode step's attention (H2O/D2O eviction, merging);
* ``select(layer, ctx)`` before a decode step's attention, to restrict what is *attended* without evicting
  (OmniKV, Quest): returns entry indices or None;
* ``prefill_attend(layer, ctx)`` before ``prefill``, for methods whose prompt attention is not full causal
  attention (LM-Infinite's Λ mask): returns the layer's output ``(B, n, Hq, D)`` or None for the backend's;
* ``attend(layer, ctx)`` before ``select``, for methods that define their own decode attention (POD's shared
  distant scores, Quest/InfLLM's block retrieval): returns the layer's attention output ``(B, q, Hq, D)`` or None
  for the engine's attention. When it returns a tensor, ``select`` and the engine's attention are skipped and
  ``decode`` follows with ``ctx.probs`` as the method left it (None unless it set them);
* ``after_decode_forward(layers, ctx)`` once after every decode forward of the model (each layer has its step's
  entries appended and attended), with every layer the method compresses, for decisions across layers during decoding
  (TriAttention's one kept set per KV head for every layer, its authors' ``triattention_forward`` wrapping
  ``model.forward``); ``ctx`` is the last layer's ``DecodeContext``. A method that implements it has no captured
  decode step (``static_policy`` None);
* ``observe_logits(layers, input_ids, logits)`` after every forward of the model (the prompt, then each decode step),
  before the next one, only for methods that set ``needs_logits`` (SirLLM scores tokens by their surprisal under the
  model): ``logits`` gives the model's log-probabilities of chosen tokens (``engine.session.TokenLogits``);
* ``reconstruction_chunks`` / ``score_reconstruction`` / ``finish_reconstruction``, only for methods that set
  ``needs_reconstruction`` (KVzip): after the prompt's forward the session feeds the model each chunk's token ids the
  method gives (a repeat prompt and the chunk) with the cache attached, calls ``score_reconstruction`` at every layer
  it compresses with those tokens' queries, drops their entries again, and finally calls ``finish_reconstruction``
  (the eviction); the prompt's resident bytes are measured after it. The session needs the model's tokenizer.

A method whose prefill is "score the prompt's entries, keep the top" derives from ``methods.scorer.ScorerMethod`` and
implements only ``score`` (kvpress's ``ScorerPress``): selection, observation window, granularity, GQA aggregation,
the compression check and ``prefill_scores`` are the base's.

Methods change the cache only through ``KVLayer.gather`` / ``KVLayer.evict_one`` (real eviction) or by assigning
new tensors (merging), so resident memory is what the method keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget, check_budget
from kvbench.errors import ConfigError
from kvbench.methods.contexts import DecodeContext, PrefillContext
from kvbench.methods.decode_compression import DecodeCompression  # method.decode_compression, parsed

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer
    from kvbench.engine.logits import TokenLogits
    from kvbench.engine.static import StaticPolicy


@dataclass
class Method:
    """Base class; on its own it is FullKV (keeps everything)."""

    name: ClassVar[str] = "base"
    #: prefill-only methods never evict during decoding; generated tokens are appended
    needs_decode_probs: ClassVar[bool] = False
    #: a method whose paper defines it per sequence sets this to refuse batch > 1
    supports_batching: ClassVar[bool] = True
    #: the method needs trained or adapted weights (CLA, LoCoCo): its ``validate`` refuses with a NotAvailableError
    #: naming the paper and what to provide, unless the user declares an adapted checkpoint
    requires_training: ClassVar[bool] = False
    #: the method only makes sense on a CUDA device (Brutal Offload's host<->GPU transfers); ``plan_job`` refuses
    #: before the model loads when the model would run elsewhere
    requires_cuda: ClassVar[bool] = False
    #: a method that scores tokens by the model's predictions sets this: the session then calls ``observe_logits``
    needs_logits: ClassVar[bool] = False
    #: a method that scores entries by extra forwards of the model over text of its own (KVzip's context reconstruction)
    needs_reconstruction: ClassVar[bool] = False
    #: what a prompt longer than a finite budget must show, checked by the session (compression is verified, never
    #: assumed): "prefill" (some layer holds fewer entries than the prompt after prefill), "decode" (the same after the
    #: first decode step: a method that evicts only then), "attention" (the first decode step attends to fewer entries
    #: than the prompt: methods that keep everything resident and select what to attend), or "none" (the method keeps
    #: and attends to everything by definition, FullKV; ``expected_compression`` may decide per instance and prompt)
    compression: ClassVar[str] = "none"
    #: the entries each layer (or head) keeps follow the prompt's content, not only its length (DynamicKV's votes,
    #: D2O's variance, KVMerger's merges, AdaKV's heads): in a captured decode of a job (``job_lengths``) the layers
    #: the method acts on share one slot count, the most any of them needs rounded up to 64, so the job's samples
    #: replay one graph (a few empty slots per layer: layout, not resident bytes, which count the entries held)
    capacities_from_content: ClassVar[bool] = False
    #: the method computes (some of) its layers' attention itself (``prefill_attend`` / ``attend`` return an output:
    #: Λ masks, merged values, attention over another layer's cache or a host bank) as plain softmax attention,
    #: without a model's logit soft-cap (Gemma 2) or per-head sink logits (GPT-OSS): the session refuses it on a model
    #: whose compressed layers have either (its outputs would not be the model's attention under the method's change)
    own_attention: ClassVar[bool] = False
    #: question=after_compression / turns=N feed the question as a continued multi-token forward after the compressed
    #: prompt (queries attend the cache and each other causally, through ``decode``/``select``/``attend``); a method
    #: whose decode path is single-query by design (its own attention or selection per step) sets this False and
    #: ``plan_job`` refuses it in one line
    supports_continued_forward: ClassVar[bool] = True
    #: the method keeps decode-time state outside the cache layers (PyramidInfer's attention rows): turn_history=
    #: rollback, which restores the cache layers only, refuses it
    decode_state_outside_cache: ClassVar[bool] = False
    #: fields added after results were stored, with the value those results ran with: a result key leaves such a
    #: field out while it holds that value (stored results keep their hash), and reports read a key without the field
    #: as holding it (``report.store.non_default_fields``), whatever the field's default is today
    key_omitted: ClassVar[dict[str, object]] = {}

    def validate(self, budget: Budget) -> None:
        """Reject a budget or hyperparameters before any model loads (raise ConfigError naming the value). The
        budget's own checks (``min_budget_tokens``) are ``kvbench.budget.check_budget``'s; a method that overrides
        this for checks of its own calls ``super().validate(budget)``."""
        check_budget(budget, self)

    def min_budget_tokens(self) -> int:
        """The fewest tokens per layer a budget may give this method (1 where its own fields, not the budget, decide
        what it keeps)."""
        return 1

    def fetch_assets(self) -> None:
        """Before any model loads (``refuse_before_loading``): obtain the files the method's config names
        (TriAttention's statistics), refusing in one line if they cannot be had. Most methods name no file."""

    def check_layers(self, num_layers: int) -> None:
        """Refuse (ConfigError) a model on which this method would act on no layer: called when a session starts, with
        the number of layers it compresses (OmniKV's filter layers may cover them all). Default: nothing."""

    def static_policy(self, capacity: int, layer_idx: int = 0) -> StaticPolicy | None:
        """This method's decode step, for its ``layer_idx``-th layer keeping ``capacity`` entries, in the form the
        captured decode step runs (``engine.decode=graph``; ``engine.static.StaticPolicy``: the method's own
        pure-tensor functions choosing the slots to attend and to evict, defined at module level in its file): None
        when it has none (its own attention, merging, per-step logits): ``engine.decode=graph`` then refuses it and
        ``auto`` decodes on the host-driven path. FullKV and every method that does nothing after prefill:
        ``StaticPolicy()`` (appended tokens stay)."""
        if type(self).decode is Method.decode and type(self).select is Method.select and \
                type(self).attend is Method.attend and not self.needs_logits and \
                (not self.acts_after_decode_forward() or self.acts_on_schedule()):
            from kvbench.engine.static import StaticPolicy

            return StaticPolicy()
        return None

    def static_state(self, layer: KVLayer, layer_idx: int,
                     slots: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The per-entry and per-row state the captured step of this method's ``layer_idx``-th layer starts from that
        the method keeps outside the layer, when the layer turns static with ``slots`` slots per (row, head):
        per-entry tensors ``(B, H, n)`` or ``(B, H, n, k)`` named in its ``StaticPolicy.state`` (entries in the
        layer's order), per-row tensors ``(B, ...)`` its functions read as ``slots.row_state`` (sized for what the
        generation can reach: InfLLM's memory blocks). Default: none (the layer's own ``state`` and ``row_state``)."""
        return {}, {}

    def ragged_cache(self) -> bool:
        """Whether this method leaves ragged cache layers (``KVLayer.to_ragged``: each head holds its own number of
        entries, flat), as AdaKV's and KVzip's ``layout=ragged``. The session then refuses, before any forward, what
        such layers cannot do: engine.compile (fixed ``(B, H, slots, D)`` layers) and position_mode=compact
        (re-rotating keys in place)."""
        return False

    def static_after_first_step(self) -> bool:
        """``engine.compile``: the layers become static after the first decode step instead of after prefill (a method
        that compresses the prompt at its first decode step, D2O's official code: that step runs on the default
        path)."""
        return False

    def has_static_step(self) -> bool:
        """Whether this method decodes as the captured step at any capacity (``static_policy`` is not None)."""
        return self.static_policy(1 << 30) is not None

    def static_refusal(self) -> str:
        """Why ``static_policy`` is None: one line naming what the method does per step that the captured step cannot
        (``engine.decode=graph``'s refusal, ``auto``'s log line and the generated table in docs/efficiency.md). Every
        method whose ``static_policy`` can be None overrides it (tests/test_static_decode.py)."""
        return "it has per-step work with no static form"

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """What a prompt of ``prompt_len`` tokens must show under ``budget`` on a model of ``num_layers`` attention
        layers (see ``compression``): "none" when the budget holds the whole prompt. A method whose own fields decide
        what it keeps or attends overrides this (POD's window, InfLLM's blocks, OmniKV's and Quest's dense layers)."""
        if budget.is_full or budget.tokens_for(prompt_len) >= prompt_len:
            return "none"
        return self.compression

    def prompt_entries(self, budget: Budget, prompt_len: int, num_layers: int) -> list[int]:
        """The most entries each of the ``num_layers`` layers the method acts on holds once a prompt of
        ``prompt_len`` tokens is prefilled under ``budget`` (not full), host arithmetic, layer 0 first: the captured
        decode of a job sizes every sample's slots from its longest prompt's (``CompressionSession(job_lengths=...)``;
        a sample whose layer holds more takes a count, and a graph, of its own). Default: the budget's tokens in every
        layer (ChunkKV keeps fewer: whole chunks), or the whole prompt for a method that keeps it (``compression``
        "none" or "attention"). A method whose layers hold other counts says them (PyramidKV's pyramid, PyramidInfer's
        contexts); where they follow the prompt's content (``capacities_from_content``) this is their mean, and the
        job's count grows past it where a sample needs more."""
        if self.compression in ("none", "attention"):
            return [prompt_len] * num_layers
        return [budget.tokens_for(prompt_len)] * num_layers

    def min_budget_reason(self) -> str:
        return "at least one token"

    def expected_key_channels(self, head_dim: int) -> int | None:
        """Key channels per head every compressed layer must hold after prefill, for a method that prunes key channels
        (ThinK); None (default): the method keeps every channel. The session checks it (compression is verified)."""
        return None

    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        """The layer's prompt attention output ``(B, n, Hq, D)`` when the method restricts prefill attention itself
        (LM-Infinite's Λ mask, CaM's start+recent mask), or None (default) for the backend's full causal attention.
        ``layer`` holds the whole prompt's post-RoPE keys/values; called before ``prefill``."""
        return None

    def prefill_scores(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """The method's per-entry scores of the layer's prompt, ``(B, H, n)`` with H the layer's heads (after any layout
        change the method makes, KVCache-Factory's ``query_head``): higher is kept first; ``+inf`` marks entries the
        method always keeps (observation window, sinks, recent tokens), ``-inf`` padding. Called after
        ``prefill_attend``, in place of ``prefill``. The one interface through which wrappers (AdaKV across heads,
        ChunkKV across chunks) select: they never re-implement a score. A method without per-entry prompt scores
        refuses (NotAvailableError naming it)."""
        from kvbench.errors import NotAvailableError

        raise NotAvailableError(f"method {self.name!r} exposes no per-entry prefill scores; scorers: "
                                f"{', '.join(scorer_names())}")

    def must_keep_count(self, n: int) -> int | None:
        """How many entries of an unpadded ``n``-token prompt ``prefill_scores`` marks ``+inf`` (must stay), the same
        number in every head, where the method knows it without reading its scores (SnapKV's window), else None: a
        wrapper selecting over the scores (AdaKV, ChunkKV) then reads the count from them, a wait for the GPU per
        layer. Default: None."""
        return None

    @classmethod
    def has_prefill_scores(cls) -> bool:
        """Whether the method implements ``prefill_scores`` (checked by the wrappers when they are configured)."""
        return cls.prefill_scores is not Method.prefill_scores

    def scores_available(self) -> bool:
        """Whether this instance gives scores (KeyDiff's block mode does not); default: ``has_prefill_scores``."""
        return self.has_prefill_scores()

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        """Compress ``layer`` at the end of prefill (default: keep everything)."""

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        """Called once after the last layer's ``prefill`` with every layer, for decisions that need all layers
        (D2O's per-layer allocation, DynamicKV's final re-allocation). ``ctx`` is the last layer's context."""

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        """Act after a decode step (default: nothing; the new token stays)."""

    def select(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        """Entries to attend at this decode step ``(B, H, k)``, or None for all."""
        return None

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        """The layer's decode attention output ``(B, q, Hq, D)`` computed by the method itself, or None (default)
        for the engine's attention. Called after the step's key/value were appended to ``layer``."""
        return None

    def after_decode_forward(self, layers: list[KVLayer], ctx: DecodeContext) -> None:
        """After every decode forward of the model (the prompt's excluded), once, with every layer the method
        compresses (the step's entries appended): cross-layer decode-time decisions (TriAttention). Default: nothing."""

    @classmethod
    def acts_after_decode_forward(cls) -> bool:
        """Whether the method implements ``after_decode_forward`` (the session then calls it)."""
        return cls.after_decode_forward is not Method.after_decode_forward

    def after_decode_forward_due(self, entries: int, seen: int) -> bool:
        """Whether ``after_decode_forward`` acts after the decode forward that leaves every layer it compresses holding
        ``entries`` entries with ``seen`` tokens seen (host ints), for a method that acts only at forwards these
        counts name (TriAttention's trigger) and implements this. The captured decode (``engine.decode=graph``) then
        runs blocks of captured steps between those forwards, the layers appending, and calls
        ``after_decode_forward`` on the host at each (``engine.decode_compression.CapturedCompression``), with the
        layers as the host-driven path holds them and a context without the step's query (it stayed in the graph).
        A method without it that implements ``after_decode_forward`` may act at any forward: it has no captured
        step."""
        raise NotImplementedError(f"method {self.name!r} acts after decode forwards without a schedule")

    @classmethod
    def acts_on_schedule(cls) -> bool:
        """Whether the method names the forwards its ``after_decode_forward`` acts at (``after_decode_forward_due``)."""
        return cls.after_decode_forward_due is not Method.after_decode_forward_due

    def keeps_state_after_generation(self) -> bool:
        """Whether the method carries what its layers hold at the end of a generation into the next sample (D2O's
        ``carry_tau``). The captured decode then reads the chosen ids after every step, so it runs no step past the
        generation's end, and hands the method its layers at the end (``after_generation``). Default: False."""
        return False

    def after_generation(self, layers: list[KVLayer]) -> None:
        """At the end of a captured generation (``keeps_state_after_generation``), with every layer the method
        compresses as the captured step left it, in the method's layer order: take what the next sample starts from
        (the host-driven path's hooks saw every step). Default: nothing."""

    def observe_logits(self, layers: list[KVLayer], input_ids: torch.Tensor, logits: TokenLogits) -> None:
        """After every forward (prompt or decode step) when ``needs_logits`` is set; default: nothing.

        ``layers``: every layer's cache, the forward's tokens already appended; ``input_ids`` ``(B, q)``: the
        forward's tokens; ``logits.gather(ids)`` ``(B, q)``: log-probability of ``ids[:, i]`` under the prediction
        made at position i; ``logits.previous`` ``(B, V)``: the previous forward's last prediction (the one that
        scored ``input_ids[:, 0]``), None after a prompt. The method may evict here (``keep_top``); the session
        measures the prompt's resident bytes after this call.
        """

    def reconstruction_chunks(self, prompt_ids: list[int], tokenizer) -> list[tuple[int, int, list[int]]]:
        """``needs_reconstruction``: per scoring forward, the prompt entries ``[start, end)`` it scores and the token
        ids fed to the model (batch 1). Default: none."""
        return []

    def score_reconstruction(self, layer_idx: int, layer: KVLayer, query: torch.Tensor, start: int, end: int,
                             scaling: float, few_kernels: bool = False) -> None:
        """``needs_reconstruction``: one scoring forward's layer ``layer_idx``; ``layer`` holds the prompt's entries
        then the forward's own, ``query`` ``(B, Hq, q, D)`` its post-RoPE queries. ``few_kernels``: as
        ``PrefillContext.few_kernels`` (the session sets it on CUDA), a form whose kernels do not grow with the
        chunk."""

    def finish_reconstruction(self, layers: list[KVLayer]) -> None:
        """``needs_reconstruction``: after the last scoring forward, every layer the method compresses (evict here)."""

    def budget_label(self, budget: Budget) -> str | None:
        """How results of this method are filed and keyed; None: the budget's own label. A method whose memory is
        set by its own fields rather than the budget (POD's window) returns a label of those."""
        return None

    def decode_compression_spec(self) -> DecodeCompression | None:
        """The configured compression during decode (``methods.decode_compression``; ``method.decode_compression``
        of the methods with a prefill score), or None (default: off). The engine keeps each layer's buffer of recent
        queries and calls ``compress_decoded`` every ``interval`` decode steps."""
        return None

    def compress_decoded(self, layer: KVLayer, ctx: PrefillContext) -> None:
        """Compress ``layer`` during decode (``decode_compression_spec``) as the method compresses a prompt: ``ctx`` is
        a ``PrefillContext`` over every entry the layer holds, ``ctx.queries`` ``(B, Hq, m, D)`` the buffered recent
        post-RoPE queries (the newest ``m`` entries' own), ``ctx.capacity`` the target. Only methods with a decode
        compression are called."""
        from kvbench.errors import NotAvailableError

        raise NotAvailableError(f"method {self.name!r} has no compression during decode")

    def describe(self) -> dict:
        """Hyperparameters as data (stored in meta.json)."""
        from dataclasses import asdict

        fields = {k: v for k, v in asdict(self).items() if k not in self.key_omitted or v != self.key_omitted[k]}
        if "decode_compression" in fields:  # off: left out (results stored before it existed keep their key)
            from kvbench.methods.decode_compression import describe_decode_compression

            described = describe_decode_compression(self.decode_compression_spec())
            if described is None:
                del fields["decode_compression"]
            else:
                fields["decode_compression"] = described
        return {"name": self.name, **fields}

    def sample_stats(self, row: int) -> dict:
        """Per-layer decisions of the last prefill for batch row ``row`` as JSON data (lists of numbers), stored in
        that sample's record under ``method_stats`` for the report's figures (D2O's layer variances, DynamicKV's and
        D2O's allocations, KVMerger's per-layer ratios). Default: nothing."""
        return {}


def scorer_names() -> list[str]:
    """Registered methods that implement ``prefill_scores`` (what ``method.scorer`` of a wrapper may name)."""
    from kvbench.methods.catalog import METHODS

    return [name for name in METHODS.names() if METHODS.get_class(name).has_prefill_scores()]


def check_positive(method: str, **fields: float) -> None:
    for key, value in fields.items():
        if value is None or value <= 0:
            raise ConfigError(f"method {method!r}: {key}={value!r} must be > 0")


def check_choice(method: str, key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"method {method!r}: {key}={value!r} is not valid; valid: {', '.join(choices)}")


# the cache operations every method shares (keep_top & co.), in their own module; imported here so that methods can
# take the contract and its helpers from one place
from kvbench.methods.cache_ops import (  # noqa: E402
    GRANULARITY,
    attend_with_column_sums,
    expand_to_query_heads,
    host_ints,
    keep_entries,
    keep_top,
    prompt_column_sums,
    real_rank,
    to_query_heads,
    unpadded_overflow,
)

__all__ = [
    "GRANULARITY", "DecodeCompression", "DecodeContext", "Method", "PrefillContext", "attend_with_column_sums",
    "check_choice", "check_positive", "expand_to_query_heads", "host_ints", "keep_entries", "keep_top",
    "prompt_column_sums", "real_rank", "to_query_heads", "unpadded_overflow",
]
