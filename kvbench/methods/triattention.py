"""TriAttention: keep the keys whose trigonometric (frequency-domain) score against calibrated query statistics is
highest, one kept set per KV head for every layer, compressed during decoding (reasoning traces).

Mao et al., "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression" (arXiv:2604.04921), code
WeianMao/triattention at c3744ee (``triattention/methods/triattention.py``, ``triattention/methods/pruning_utils.py``,
``scripts/calibrate.py``, ``scripts/cli.py``, ``scripts/worker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.assets.github import fetch_file, named_stats
from kvbench.engine.rope import rotate_keys
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import Method, check_choice, check_positive

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.budget import Budget
    from kvbench.engine.cache import KVLayer
    from kvbench.methods.contexts import DecodeContext, PrefillContext

#: ``--triattention_score_aggregation`` (``scripts/worker.py:333``, ``choices=["mean", "max"]``): over the offsets
AGGREGATIONS = ("mean", "max")
#: how to produce a statistics file (the refusal's advice)
HOW_TO_CALIBRATE = ("produce it with the authors' scripts/calibrate.py (WeianMao/triattention c3744ee: --model <the "
                    "model> --input <text> --output <file.pt>)")
#: the tie-break noise's scale (``triattention.py`` ``compute_keep_indices``: ``torch.rand(...) * 1e-6``)
NOISE = 1e-6


def geometric_offsets(max_length: int, device: torch.device) -> torch.Tensor:
    """``pruning_utils.build_geometric_offsets``: 1, 2, 4, ... up to ``max_length`` (float32)."""
    offsets, value = [], 1
    while value <= max_length:
        offsets.append(float(value))
        value *= 2
    return torch.tensor(offsets, device=device, dtype=torch.float32)


def trig_scores(q_mean: torch.Tensor, q_abs_mean: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                round_start: int, inv_freq: torch.Tensor, offsets: torch.Tensor, aggregation: str,
                disable_mlr: bool = False, disable_trig: bool = False) -> torch.Tensor:
    """TriAttention's score ``(S, n)`` of ``n`` post-RoPE keys ``(S, n, D)`` at ``positions`` ``(S, n)`` for ``S``
    sampled query heads with calibrated statistics ``q_mean`` ``(S, D/2)`` complex and ``q_abs_mean`` ``(S, D/2)``
    (``_compute_layer_head_scores`` + ``compute_frequency_statistics_from_means`` + ``score_keys_for_round``): RoPE is
    inverted at each key's position; per frequency f, amplitude ``|E q_f| |k_f|``, phase ``phi = arg(E q_f conj k_f)``;
    for each future distance ``delta = round_start - position + offset`` (offsets 1, 2, 4, ...),
    ``sum_f amp_f cos(delta omega_f + phi_f) + sum_f (E|q_f| - |E q_f|) |k_f|`` (the second term: ``E|q_f| |k_f|``
    with ``disable_mlr``; the first dropped with ``disable_trig``), then the mean (or max) over the offsets."""
    k = rotate_keys(keys.float(), -positions.float(), inv_freq.float())  # RoPE inverted at each key's position
    half = k.shape[-1] // 2
    k_complex = torch.complex(k[..., :half].contiguous(), k[..., half:].contiguous())  # (S, n, F)
    q_mean_abs = q_mean.abs()
    k_abs = k_complex.abs()
    relative = q_mean.unsqueeze(1) * torch.conj(k_complex)
    phi = torch.atan2(relative.imag, relative.real)
    amp = q_mean_abs.unsqueeze(1) * k_abs
    extra = (q_abs_mean if disable_mlr else q_abs_mean - q_mean_abs).unsqueeze(1) * k_abs
    omega = inv_freq.float()[:half]
    delta = (round_start - positions.float()).unsqueeze(-1) + offsets  # (S, n, O)
    phase = delta.unsqueeze(-1) * omega + phi.unsqueeze(2)  # (S, n, O, F)
    base = (amp.unsqueeze(2) * torch.cos(phase)).sum(-1)  # freq_scale_sq = 1 (attention scaling 1)
    additive = extra.sum(-1, keepdim=True)
    combined = additive if disable_trig else base + additive
    return combined.mean(-1) if aggregation == "mean" else combined.amax(-1)


def load_stats(path: str) -> tuple[list[tuple[int, int]], dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
                                   dict]:
    """The authors' statistics file (``pruning_utils.load_head_frequency_stats``'s format: ``metadata`` with
    ``sampled_heads``/``head_dim``/``rope_style``, ``stats`` ``layerLL_headHH`` -> ``q_mean_real``/``q_mean_imag``/
    ``q_abs_mean``): the sampled heads in the file's order, their ``(q_mean complex, q_abs_mean)``, the metadata.
    A missing or unreadable file refuses in one line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"method 'triattention': stats_path={path!r} does not exist; {HOW_TO_CALIBRATE}")
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True)
        metadata, raw = payload["metadata"], payload["stats"]
        heads = [(int(layer), int(head)) for layer, head in metadata["sampled_heads"]]
        stats = {}
        for layer, head in heads:
            entry = raw.get(f"layer{layer:02d}_head{head:02d}")
            if entry is None:  # the code skips a sampled head without statistics (load_head_frequency_stats)
                continue
            stats[(layer, head)] = (torch.complex(entry["q_mean_real"].float(), entry["q_mean_imag"].float()),
                                    entry["q_abs_mean"].float())
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ConfigError(f"method 'triattention': stats_path={path!r} is not a TriAttention statistics file "
                          f"({type(exc).__name__}: {exc}); {HOW_TO_CALIBRATE}") from None
    if not heads:
        raise ConfigError(f"method 'triattention': stats_path={path!r} samples no heads; {HOW_TO_CALIBRATE}")
    return heads, stats, metadata


@dataclass
class TriAttention(Method):
    """TriAttention in its authors' experiment mode (``per_head_pruning``): during decoding, once the cache holds
    ``budget + divide_length`` entries, every layer is cut back to ``budget`` entries per KV head, the same kept set
    for every layer; the prompt's entries are pinned.

    Score (``trig_scores``, per sampled query head ``(layer, head)`` of the statistics file, on its KV head's keys
    with RoPE inverted at each entry's absolute position): the expected attention logit of the calibrated query
    distribution at future distances ``round_start - position + {1, 2, 4, ..., offset_max_length}``, averaged over
    those offsets (``score_aggregation``). ``round_start`` is the number of tokens seen. Each sampled head's scores
    over the decode entries are z-normalised (``normalize_scores``), uniform noise ``U(0, 1e-6)`` from a generator
    seeded with ``pruning_seed`` is added (tie-break; reseeded for every generation, as the code's
    ``reset_compression_state``), and for each KV head the score is the mean over layers of the max over that
    layer's sampled query heads of the group (``_select_per_head_independent``); the top ``budget - prompt`` decode
    entries of each KV head are kept (``topk``), in every layer.

    Shapes: keys ``(1, Hkv, n, D)`` per layer, scores ``(S, n - prompt)`` with ``S`` the sampled heads, the kept set
    ``(Hkv, budget)``.

    When (``triattention_forward``): after a decode forward (every layer appended), when the cache's length (prompt
    included: ``count_prompt_tokens``) reaches ``budget + divide_length`` (``use_slack_trigger``); with
    ``use_slack_trigger=false`` when it reaches ``budget`` and the count of tokens seen is a multiple of
    ``divide_length``. The prompt is never compressed (``allow_prefill_compression=false``): its entries are kept and
    only decode entries compete for ``budget - prompt``; a prompt of at least ``budget`` tokens leaves the cache at
    its first ``budget`` entries (the code's ``compute_keep_indices`` then returns ``arange(budget)``).

    Defaults, by source (WeianMao/triattention at c3744ee): ``divide_length=128`` (``scripts/cli.py:308``,
    ``scripts/worker.py:291``, ``TriAttentionConfig`` ``triattention.py:50``), ``use_slack_trigger=true``
    (``scripts/cli.py:306`` ``slack_budget_trigger``, ``scripts/worker.py:410``; the dataclass's own default,
    ``triattention.py:51``, is false), ``count_prompt_tokens=true`` (``scripts/cli.py:304``,
    ``scripts/worker.py:394``; dataclass ``triattention.py:48``: false), ``allow_prefill_compression=false``
    (``scripts/worker.py:418``, ``triattention.py:49``; ``configs/extra_config/triattention_per_head_pruning.yaml``
    leaves it; only Qwen3's budget-512 script uses ``..._allow_prefill.yaml``), ``normalize_scores=true``
    (``scripts/cli.py:307``, ``scripts/worker.py:342``; dataclass ``triattention.py:47``: false),
    ``score_aggregation="mean"`` (``scripts/cli.py:312``, ``scripts/worker.py:335``, ``triattention.py:44``),
    ``offset_max_length=65536`` (``scripts/cli.py:311`` ``triattention_frequency_window``, ``scripts/worker.py:329``,
    ``triattention.py:43``), ``pruning_seed=0`` (``scripts/cli.py:313``, ``scripts/worker.py:348``), per-head pruning
    (``configs/extra_config/triattention_per_head_pruning.yaml:1``, ``scripts/cli.py:303``, ``scripts/worker.py:354``;
    the only mode here), ``disable_mlr=false`` / ``disable_trig=false`` (``scripts/worker.py:424,430``: ablations).
    Budgets of the experiments: ``configs/shared/budgets.yaml`` 512-4096, ``configs/shared/defaults.yaml:1`` 2048
    (``scripts/experiments/*/budget*/run_triattention_per_head.sh`` pass ``--budget``).

    Statistics (``stats_path``): a ``.pt`` in the authors' format, calibrated on the model being run (the authors'
    ``triattention/calibration/for_aime2{4,5}_experiment/*.pt`` for their 8B models;
    ``tests/fixtures/triattention/smollm2-135m.pt`` for SmolLM2-135M, from ``scripts/calibrate.py`` on one essay).
    The authors' files are named ``authors:for_aime2{4,5}_experiment/{qwen3_8b,ds_qwen7b,ds_llama8b}``
    (``kvbench.assets.github.TRIATTENTION_STATS``: pinned commit and sha256): a job with one plans without the file
    (its key is ``<file name>#sha256:<16 hex>`` of the pinned sha256, the key a local copy of the same bytes and name
    gives) and fetches it before the model loads (``fetch_assets``).
    A missing file, or statistics for another model (layers, query heads, head_dim, RoPE style), is refused in one
    line.

    Where kvbench differs from the code: batch 1 only (the code scores ``key_states[0]`` and keeps one set for every
    row); the code's global (union) and per-layer-per-head modes are not implemented; RoPE with an attention scaling
    other than 1 (YaRN) is refused (the code's ``freq_scale_sq`` would scale every score alike); kvbench stores
    entries in position order, the method keeps the code's stored order (prompt, then each KV head's ``topk`` order,
    then the appended entries) to score in it, so the noise meets the same entries as in the code.
    """

    name: ClassVar[str] = "triattention"
    #: where it acts (the methods table): ``finish_prefill`` only starts a generation's bookkeeping
    acts_as: ClassVar[str] = "after every decode forward, over all layers (once the cache holds budget + divide_length)"
    compression: ClassVar[str] = "none"  # compresses only once decoding filled budget + divide_length entries
    supports_batching: ClassVar[bool] = False
    decode_state_outside_cache: ClassVar[bool] = True  # the code's stored order and the noise generator
    supports_continued_forward: ClassVar[bool] = True
    stats_path: str | None = None
    divide_length: int = 128
    use_slack_trigger: bool = True
    count_prompt_tokens: bool = True
    allow_prefill_compression: bool = False
    normalize_scores: bool = True
    score_aggregation: str = "mean"
    offset_max_length: int = 65536
    pruning_seed: int = 0
    disable_mlr: bool = False
    disable_trig: bool = False

    def __post_init__(self) -> None:
        check_positive(self.name, divide_length=self.divide_length, offset_max_length=self.offset_max_length)
        check_choice(self.name, "score_aggregation", self.score_aggregation, AGGREGATIONS)
        for key in ("use_slack_trigger", "count_prompt_tokens", "allow_prefill_compression", "normalize_scores",
                    "disable_mlr", "disable_trig"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"method {self.name!r}: {key}={getattr(self, key)!r} must be true or false")
        if not isinstance(self.pruning_seed, int) or isinstance(self.pruning_seed, bool):
            raise ConfigError(f"method {self.name!r}: pruning_seed={self.pruning_seed!r} must be an integer")
        self._stats = None  # (sampled heads, statistics, metadata), loaded once
        self._kv_budget: int | None = None  # the budget's tokens (validate): not capped at the prompt's length
        self._device_stats: dict = {}
        self._reset(0, 0)

    # ---- configuration ------------------------------------------------------------------------------------------
    def validate(self, budget: Budget) -> None:
        super().validate(budget)
        if budget.kind == "ratio":
            raise ConfigError(f"method {self.name!r}: budget={budget.label()} is a ratio of the prompt; TriAttention's "
                              "budget is the entries a KV head keeps while decoding (the authors' kv_budget); valid: "
                              "tokens as an integer >= 1 (e.g. 2048), or full")
        self._kv_budget = None if budget.is_full else int(budget.value)
        if self.stats_path is None:
            raise ConfigError(f"method {self.name!r}: stats_path=null; it needs calibrated query statistics of the "
                              f"model (method.stats_path=<file.pt>); {HOW_TO_CALIBRATE}")
        if named_stats(str(self.stats_path)) is None:  # a named file is known by its pinned sha256: plans without it
            self.stats()

    def fetch_assets(self) -> None:
        """Before any model loads: resolve a named statistics file (cache, else a checked download; offline and not
        cached: one line naming the asset, where to put it and the fetch command) and load it."""
        self.stats()

    def stats(self):
        if self._stats is None:
            named = named_stats(str(self.stats_path))
            self._stats = load_stats(str(fetch_file(named) if named is not None else self.stats_path))
        return self._stats

    def describe(self) -> dict:
        """The statistics file is named by its file name and content hash, not its path (POD's block map): a job's key
        does not depend on where the file lives, and another calibration is another job."""
        described = super().describe()
        named = named_stats(str(self.stats_path)) if self.stats_path is not None else None
        if named is not None:  # the same key as a local file of the same name and bytes
            described["stats_path"] = f"{named.file_name}#sha256:{named.sha256[:16]}"
        elif self.stats_path is not None and Path(self.stats_path).is_file():
            import hashlib

            digest = hashlib.sha256(Path(self.stats_path).read_bytes()).hexdigest()[:16]
            described["stats_path"] = f"{Path(self.stats_path).name}#sha256:{digest}"
        return described

    def check_layers(self, num_layers: int) -> None:
        heads, _, _ = self.stats()
        layers = max(layer for layer, _ in heads) + 1
        if layers != num_layers:
            raise ConfigError(f"method {self.name!r}: stats_path={self.stats_path!r} holds statistics of a model with "
                              f"{layers} layers, kvbench compresses {num_layers} layers of this one (all but sliding-"
                              f"window layers); {HOW_TO_CALIBRATE}")

    def check_model(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Refuse statistics of another model (query heads, head_dim, RoPE style), in one line."""
        heads, stats, meta = self.stats()
        found_heads = max(head for _, head in heads) + 1
        found_dim = int(meta.get("head_dim", 2 * next(iter(stats.values()))[0].numel()))
        problem = None
        if found_heads != num_heads:
            problem = f"{found_heads} query heads, this model has {num_heads}"
        elif found_dim != head_dim or any(q.numel() * 2 != head_dim for q, _ in stats.values()):
            problem = f"head_dim {found_dim}, this model has {head_dim}"
        elif str(meta.get("rope_style", "half")) != "half":
            problem = f"rope_style {meta.get('rope_style')!r}, this model's RoPE is half-split"
        elif num_heads % num_kv_heads:
            problem = f"{num_heads} query heads over {num_kv_heads} KV heads"
        if problem:
            raise ConfigError(f"method {self.name!r}: stats_path={self.stats_path!r} holds statistics of a model with "
                              f"{problem}; {HOW_TO_CALIBRATE}")

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """Nothing is evicted at prefill or at the first decode step (the cache must first reach ``budget +
        divide_length``): no check at those points; the resident curve shows the bound."""
        return "none"

    # ---- per generation -------------------------------------------------------------------------------------------
    def _reset(self, prompt_len: int, budget: int) -> None:
        self._prefix = prompt_len
        self._budget = budget
        self._order: torch.Tensor | None = None  # (Hkv, m) positions in the code's stored order at the last compression
        self._order_seen = 0
        self._generator: torch.Generator | None = None
        self.compressions = 0

    def finish_prefill(self, layers: list[KVLayer], ctx: PrefillContext) -> None:
        """A new generation (the code's ``reset_compression_state``): the prompt's length, the budget, the generator
        reseeded. Nothing is compressed."""
        lens, caps = ctx.host_ints()
        if len(lens) != 1:
            raise NotAvailableError(f"method {self.name!r} keeps one set for a batch of one (the authors' code scores "
                                    "row 0 only); use batch_size=1")
        layer = layers[0]
        self.check_model(ctx.num_heads, layer.values.shape[1], layer.values.shape[-1])
        if ctx.rope_inv_freq is None:
            raise NotAvailableError(f"method {self.name!r} inverts RoPE at each key's position: this model's RoPE "
                                    "(attention scaling other than 1, or none) is not supported")
        self._num_heads = ctx.num_heads
        self._inv_freq = ctx.rope_inv_freq
        self._reset(layer.seen, self._kv_budget if self._kv_budget is not None else caps[0])

    def start(self, prompt_len: int, budget: int, num_heads: int, inv_freq: torch.Tensor) -> None:
        """What ``finish_prefill`` sets, for a driver without a session (the parity test)."""
        self._num_heads, self._inv_freq = num_heads, inv_freq
        self._reset(prompt_len, budget)

    def _noise(self, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(int(self.pruning_seed))
        return torch.rand(shape, device=device, generator=self._generator) * NOISE

    # ---- the decode-time compression --------------------------------------------------------------------------------
    def should_compress(self, entries: int, seen: int) -> bool:
        """``triattention_forward``'s trigger after a decode forward: ``entries`` in the cache, ``seen`` tokens."""
        size = entries if self.count_prompt_tokens else max(0, entries - self._prefix)
        if self.use_slack_trigger:
            return size >= self._budget + self.divide_length
        return size >= self._budget and seen % self.divide_length == 0

    def after_decode_forward(self, layers: list[KVLayer], ctx: DecodeContext) -> None:
        layer = layers[0]
        if self.should_compress(layer.num_entries, layer.seen):
            self.compress(layers)

    def after_decode_forward_due(self, entries: int, seen: int) -> bool:
        """The trigger on host counts: the captured decode appends between these forwards and compresses at each."""
        return self.should_compress(entries, seen)

    def code_order(self, layer: KVLayer) -> torch.Tensor:
        """``(Hkv, n)`` the positions of the cache in the code's stored order: the order at the last compression, then
        the entries appended since (position order before any)."""
        if self._order is None:
            return layer.positions[0]
        appended = torch.arange(self._order_seen, layer.seen, device=self._order.device)
        return torch.cat([self._order, appended.expand(self._order.shape[0], -1)], dim=-1)

    def keep_positions(self, layers: list[KVLayer], scores_out: list | None = None) -> torch.Tensor:
        """The positions each KV head keeps ``(Hkv, k)`` in the code's stored order after the compression
        (``compute_keep_indices`` with ``per_head_pruning``). ``scores_out`` collects each layer's raw scores
        ``(S_l, n - prompt)`` (the parity test)."""
        layer0 = layers[0]
        order = self.code_order(layer0)  # (Hkv, n)
        hkv, n = order.shape
        budget = self._budget
        prefix = 0 if self.allow_prefill_compression else self._prefix
        if n <= budget:
            return order
        start = min(prefix, n)
        if n - start == 0 or budget - start <= 0:  # the prompt fills the budget: its first `budget` entries
            return order[:, : min(budget, n)]
        keep = min(budget - start, n - start)
        heads, stats, _ = self.stats()
        group = self._num_heads // hkv
        rows, owners = [], []
        for idx, layer in enumerate(layers):
            sampled = [(lay, h) for lay, h in heads if lay == idx]
            if not sampled:
                continue
            decode = order[:, start:]
            slots = torch.searchsorted(layer.positions[0], order)[:, start:]  # (Hkv, d): the code's order
            kv = torch.tensor([min(hkv - 1, h // max(1, group)) for _, h in sampled], device=order.device)
            keys = layer.keys[0].gather(1, slots.unsqueeze(-1).expand(-1, -1, layer.keys.shape[-1]))[kv]
            q_mean, q_abs = self._head_stats(sampled, stats, order.device)
            scores = trig_scores(q_mean, q_abs, keys, decode[kv], layer0.seen, self._inv_freq.to(order.device),
                                 geometric_offsets(self.offset_max_length, order.device), self.score_aggregation,
                                 self.disable_mlr, self.disable_trig)
            if scores_out is not None:
                scores_out.append(scores)
            rows.append(scores)
            owners += sampled
        matrix = torch.cat(rows, dim=0)
        if self.normalize_scores:
            mean = matrix.mean(dim=1, keepdim=True)
            std = matrix.std(dim=1, unbiased=False, keepdim=True).clamp_min(1e-6)
            matrix = (matrix - mean) / std
        matrix = matrix + self._noise(tuple(matrix.shape), matrix.device)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (lay, h) in enumerate(owners):
            groups.setdefault((lay, h // max(1, group)), []).append(i)
        layer_ids = sorted({lay for lay, _ in owners})
        kept = []
        for kv in range(hkv):
            per_layer = [matrix[groups[(lay, kv)]].max(dim=0).values for lay in layer_ids if (lay, kv) in groups]
            aggregated = torch.stack(per_layer).mean(0) if per_layer else matrix.mean(0)
            kept.append(aggregated.topk(keep, largest=True).indices + start)
        index = torch.cat([torch.arange(start, device=order.device).expand(hkv, -1), torch.stack(kept)], dim=-1)
        return order.gather(1, index)

    def _head_stats(self, sampled, stats, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(sampled), str(device))
        if key not in self._device_stats:
            self._device_stats[key] = (torch.stack([stats[s][0] for s in sampled]).to(device),
                                       torch.stack([stats[s][1] for s in sampled]).to(device))
        return self._device_stats[key]

    def compress(self, layers: list[KVLayer], scores_out: list | None = None) -> torch.Tensor:
        """Cut every layer to the kept positions (``keep_positions``), the same per KV head in every layer; returns
        them in the code's stored order."""
        positions = self.keep_positions(layers, scores_out)
        for layer in layers:
            slots = torch.searchsorted(layer.positions[0], positions.sort(dim=-1).values)
            layer.gather(slots.unsqueeze(0))
        self._order, self._order_seen = positions, layers[0].seen
        self.compressions += 1
        return positions
