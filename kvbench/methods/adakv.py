"""AdaKV: head-wise budgets, the top scores of a layer across all its heads, with a per-head safeguard.

Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference"
(arXiv:2407.11550), code FFY0/AdaKV; kvpress ``AdaKVPress``. Wraps any method with ``prefill_scores``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import PrefillContext, check_choice, host_ints, keep_entries
from kvbench.methods.scorer_wrapper import ScorerWrapper

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: ``ragged`` (default): evicted entries leave memory and each head holds only what it keeps, flat
#: (``KVLayer.to_ragged``): resident bytes are the kept entries'; ``padded``: evicted entries leave memory, but the
#: layer is one ``(B, H, n, D)`` tensor as long as its longest head, and the other heads' empty slots are allocated
#: (counted in resident bytes); ``kvpress_mask``: kvpress's reading, nothing leaves memory, evicted entries are masked
#: out of attention (resident bytes stay those of the whole prompt)
LAYOUTS = ("ragged", "padded", "kvpress_mask")
#: ``official_code`` (default): the authors' code; ``kvpress``: kvpress ``AdaKVPress``'s safeguard (``adakv_keep``)
#: (FFY0/AdaKV ``AdaptiveSnapKVCluster.update_kv``, ``adakv_keep_official``; tests/test_parity_adakv_official.py)
ALLOCATIONS = ("kvpress", "official_code")


def adakv_keep(scores: torch.Tensor, capacity: int, alpha: float) -> torch.Tensor:
    """One row's kept entries ``(H, n)`` bool from scores ``(H, n)``: ``H * capacity`` entries of the layer, the top
    scores across all heads, after each head's top ``n_safe = int(capacity * alpha)`` (at least 1 when alpha > 0)
    were made unbeatable (kvpress ``AdaKVPress``: the safeguard)."""
    h, n = scores.shape
    n_safe = int(capacity * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe)
    scores = scores.clone()
    if n_safe:
        safe = scores.topk(min(n_safe, n), dim=-1).indices
        scores.scatter_(-1, safe, torch.where(torch.gather(scores, -1, safe) > float("-inf"), float("inf"),
                                              float("-inf")))
    top = scores.reshape(-1).topk(min(h * capacity, h * n)).indices
    kept = torch.zeros(h * n, dtype=torch.bool, device=scores.device)
    kept[top] = True
    return kept.view(h, n) & (scores > float("-inf"))


def adakv_keep_official(scores: torch.Tensor, capacity: int, alpha: float, must_keep: int | None = None
                        ) -> torch.Tensor:
    """One row's kept entries ``(H, n)`` bool from scores ``(H, n)``, allocated as the authors'
    ``AdaptiveSnapKVCluster.update_kv`` (FFY0/AdaKV efe4e2e, ``adaptive_snapkv/monkeypatch/snapkv_utils.py``).

    The scorer's ``+inf`` entries (SnapKV's window: the same number ``w`` in every head) stay outside the
    allocation; with ``B = capacity - w`` and the other entries in position order, nothing is evicted when ``B``
    exceeds them; otherwise each head's share ``c_h`` is how many of the layer's top ``H * B`` scores are its own
    (``topk`` over each head's scores sorted descending, flattened), its budget ``round(c_h * (1 - alpha) +
    int(B * alpha))`` (``torch.round`` of float32: half to even; the budgets need not sum to ``H * B``), and it keeps
    the first ``budget`` of its sorted scores. The same torch ops on the same shapes as the code, so equal scores
    break alike. ``must_keep``: the number of ``+inf`` entries per head where the scorer knows it (else read).
    """
    h, n = scores.shape
    forced = scores == float("inf")
    if must_keep is not None:  # the scorer knows it (``Method.must_keep_count``): no read
        w, same = must_keep, True
    else:
        per_head = forced.sum(-1)
        w, same = (int(x) for x in torch.stack([per_head[0], (per_head == per_head[0]).all()]).tolist())  # one read
    if not same:
        raise NotAvailableError("method 'adakv': allocation=official_code needs the same number of must-keep entries "
                                "in every head (SnapKV's window)")
    base = capacity - w
    if base > n - w:
        return torch.ones(h, n, dtype=torch.bool, device=scores.device)
    # each head's free entries in position order (the code's boolean index), as a stable sort: no read for its shape
    free_pos = torch.sort(forced.to(torch.int8), dim=-1, stable=True).indices[:, : n - w]
    free = scores.gather(-1, free_pos).view(1, h, n - w)
    floor = int(base * alpha)
    sorted_scores, sorted_idx = free.sort(dim=-1, descending=True)
    share = torch.topk(sorted_scores.reshape(1, (n - w) * h), k=h * base, dim=-1).indices // (n - w)
    counts = torch.zeros((1, h), device=scores.device, dtype=share.dtype)
    counts.scatter_add_(-1, share, torch.ones_like(share, dtype=counts.dtype))
    budgets = torch.round(counts * (1 - alpha) + floor).int()[0]
    # each head keeps the first budgets[head] of its sorted free entries (the code's per-head loop, on the device)
    chosen = torch.arange(n - w, device=scores.device).view(1, -1) < budgets.view(-1, 1)
    return forced.scatter(-1, free_pos.gather(-1, sorted_idx[0]), chosen)


@dataclass
class AdaKV(ScorerWrapper):
    """Prefill-only: per layer, ``heads x budget`` entries chosen over the scorer's scores of all heads together
    (heads get different budgets), every head keeping at least its top ``alpha_safeguard x budget`` (the paper's
    safeguard, alpha 0.2 as AdaKV and kvpress). The scorer's must-keep entries (+inf: SnapKV's window, sinks) stay.

    Memory (``layout="ragged"``, default): evicted entries leave memory and every head holds only the entries it
    keeps, flat per head (as AdaKV's own code flattens heads for FlashAttention's varlen kernel): resident bytes are
    the kept entries' (``heads x budget`` per layer and row, plus the decoded tokens), and attention reads a padded
    copy built per layer per step and dropped after it (``KVLayer.attention_view``). ``layout="padded"``: the cache is
    a ``(B, H, n, D)`` tensor as long as its longest head, the other heads' empty slots allocated and counted in
    resident bytes (the layout engine.compile needs). ``sample_stats`` records, per layer, the entries kept and the
    entries allocated (equal under ``ragged``). ``layout="kvpress_mask"``: kvpress's reading (nothing freed, evicted
    entries masked out of attention); never the default.

    ``allocation="official_code"`` (default): the authors' code (``adakv_keep_official``: the scorer's must-keep
    entries outside the allocation, ``alpha`` of the rest uniform and ``1 - alpha`` by each head's share of the layer's
    top scores, rounded; tests/test_parity_adakv_official.py pins it on the code's own outputs).
    ``allocation="kvpress"``: the safeguard as kvpress ``AdaKVPress`` applies it (``adakv_keep``: each head's top
    ``int(alpha * budget)`` scores made unbeatable, counted together with the scorer's +inf entries, then the top
    ``heads x budget`` of the layer); the per-head budgets differ from the code's on most inputs, and with a 32-token
    window and ``alpha * budget <= 32`` nothing beyond the window is protected (tests/test_parity_kvpress.py pins it).
    Results stored before the option ran ``kvpress`` (their key has no ``allocation``: ``key_omitted``).
    """

    name: ClassVar[str] = "adakv"
    capacities_from_content: ClassVar[bool] = True
    alpha_safeguard: float = 0.2
    layout: str = "ragged"
    allocation: str = "official_code"
    #: results stored before the option ran kvpress's allocation and have no ``allocation`` in their key
    key_omitted: ClassVar[dict[str, object]] = {"allocation": "kvpress"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha_safeguard <= 1:
            raise ConfigError(f"method 'adakv': alpha_safeguard={self.alpha_safeguard} must be in [0, 1]")
        check_choice("adakv", "layout", self.layout, LAYOUTS)
        check_choice("adakv", "allocation", self.allocation, ALLOCATIONS)
        if self.decode_compression_spec() is not None and self.layout != "padded":
            raise ConfigError(f"method 'adakv': decode_compression evicts from caches of one (B, H, n, D) tensor; "
                              f"layout={self.layout!r} cannot (ragged heads are flat, kvpress_mask frees nothing); use "
                              "layout=padded")
        #: layer -> (kept entries per row: a device tensor, read once per sample by ``sample_stats``; allocated
        #: entries per row, host ints, or None where they are the kept ones)
        self._stats: dict[int, tuple[torch.Tensor, list[int] | None]] = {}
        self._read: list | None = None  # the kept counts read, per row and layer (reset at every prefill)

    def expected_compression(self, budget, prompt_len: int, num_layers: int) -> str:
        kind = super().expected_compression(budget, prompt_len, num_layers)
        return "attention" if kind != "none" and self.layout == "kvpress_mask" else kind

    def ragged_cache(self) -> bool:
        return self.layout == "ragged"

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        if ctx.fits():
            return
        scores = self.scorer_scores(layer, ctx)
        kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        for row, cap in enumerate(host_ints(layer, ctx.capacity)):  # each row on its own tokens, as it would be alone
            where = ctx.row_tokens(row)  # (left padding: a slice, no read)
            if self.allocation == "official_code":
                kept[row][:, where] = adakv_keep_official(scores[row][:, where], cap, self.alpha_safeguard,
                                                          self.scorer_must_keep(ctx, row))
            else:
                kept[row][:, where] = adakv_keep(scores[row][:, where], cap, self.alpha_safeguard)
        if layer.valid is not None:
            kept = kept & layer.valid
        if self.layout == "kvpress_mask":
            layer.set_valid(kept)
        elif self.layout == "ragged":
            layer.to_ragged(kept)
        else:
            keep_entries(layer, kept)
        allocated = None if self.layout == "ragged" else [layer.num_entries * kept.shape[1]] * kept.shape[0]
        self._stats[ctx.layer_idx] = (kept.sum(dim=(1, 2)), allocated)  # no read per layer (sample_stats reads)
        self._read = None

    def sample_stats(self, row: int) -> dict:
        layers = sorted(self._stats)
        if self._read is None:  # every layer's counts in one read per sample
            self._read = torch.stack([self._stats[i][0] for i in layers], 1).tolist() if layers else []
        kept = [int(x) for x in self._read[row]] if layers else []
        allocated = [kept[j] if self._stats[i][1] is None else self._stats[i][1][row] for j, i in enumerate(layers)]
        return {"adakv_kept_entries": kept, "adakv_allocated_entries": allocated}
