"""R-KV: keep the tokens the last queries attend to that are least redundant with the other keys (reasoning traces).

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (arXiv:2505.24133), code
Zefan-Cai/R-KV at d15c976 (``rkv/compression/r1_kv.py`` ``R1KV.update_kv``, ``rkv/utils.py``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.scores import pool1d
from kvbench.errors import ConfigError
from kvbench.methods.base import PrefillContext, check_choice, check_positive
from kvbench.methods.scorer import ScorerMethod

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: ``cal_similarity``'s ``retain_direction`` as ``run_math.py`` offers it (``choices=["last", "first"]``): which of a
#: key's similar keys keeps it (its entry in the similarity matrix is zeroed); the ``*_percent`` readings of
#: ``rkv/utils.py`` are not reachable from the authors' script
RETAIN = ("last", "first")
#: the order the scoring sees the cache in: ``code``, the authors' stored order (each compression stores the kept
#: entries in ``topk`` order, scores descending, then the window and the entries appended after it); ``position``
CACHE_ORDER = ("code", "position")
#: elements of one block of the similarity matrix (rows chunked so that a long prompt never holds ``n x n`` at once;
#: about 9 bytes each: the float32 similarity, its threshold mask and the int32 indices)
BLOCK_ELEMENTS = 1 << 24
#: the same with ``PrefillContext.few_kernels`` (a GPU's form: one pass up to a 4k prompt on 8 KV heads, ~1.2 GB)
PASS_ELEMENTS = 1 << 27


def rkv_attention(queries: torch.Tensor, keys: torch.Tensor, window: int, kernel: int, scaling: float,
                  key_valid: torch.Tensor | None) -> torch.Tensor:
    """R-KV's importance ``(B, Hkv, n - w)`` (``R1KV.update_kv`` with ``compute_attention_scores``): the logits of the
    last ``w`` queries (of the prompt's, or of a buffer of the last queries while decoding: the code's
    ``query_cache``) over the ``n`` keys, the max over each KV group's query heads (``pooling="max"``, before any
    softmax), a softmax over the ``n - w`` older keys alone (the window's keys are left out, so no causal mask is
    needed), the mean over the ``w`` queries, then max-pooling over positions (kernel ``kernel``, padding
    ``kernel // 2``). Padding keys get probability 0 and -inf before the pooling (as the pooling's own edge)."""
    b, hq, m, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    q = queries[:, :, m - window :].float().view(b, hkv, hq // hkv, window, d)
    logits = (q @ keys.float().unsqueeze(2).transpose(-1, -2)).amax(2) * scaling  # (B, Hkv, w, n)
    past = logits[..., : n - window]
    valid = None if key_valid is None else key_valid[:, None, None, : n - window]
    if valid is not None:
        past = past.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(past, dim=-1)
    if valid is not None:
        probs = probs.nan_to_num(0.0)  # a row whose window reaches back over all its keys
    attn = probs.mean(-2)  # (B, Hkv, n - w)
    if valid is not None:
        attn = attn.masked_fill(~valid[:, :, 0], float("-inf"))
    return pool1d(attn, kernel, "max")


def rkv_redundancy(keys: torch.Tensor, threshold: float, retain: str, key_valid: torch.Tensor | None,
                   few_kernels: bool = False) -> torch.Tensor:
    """R-KV's redundancy ``(B, Hkv, n)`` (``rkv/utils.py`` ``cal_similarity``), per row on its own keys: the cosine
    similarity of every pair of keys (norms + 1e-8), the diagonal 0; in each row ``i`` the entry of the last (``retain
    ="last"``; ``"first"``: the smallest index of the code's ``where(similar, index, 0)``) key more similar than
    ``threshold`` is zeroed (the key kept for that pair), index 0 when there is none, as the code's ``max`` over
    ``where(sim > threshold, arange, 0)`` gives; then the mean over the rows ``i`` of each column and a softmax over
    the keys. Computed in blocks of rows (the column sums; ``BLOCK_ELEMENTS``, ``PASS_ELEMENTS`` with ``few_kernels``),
    in float32; padding ``-inf``."""
    b, h, n, _ = keys.shape
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    pad = torch.zeros(b, dtype=torch.long, device=keys.device)
    valid_cols = None
    if key_valid is not None:
        pad = (~key_valid).sum(-1)  # left padding: the row's own index 0 is position pad
        valid_cols = key_valid[:, None, None, :]  # (B, 1, 1, n)
    local = torch.arange(n, device=keys.device, dtype=torch.int32).view(1, 1, 1, n) - pad.view(b, 1, 1, 1).int()
    zero = torch.zeros((), dtype=torch.int32, device=keys.device)
    sums = torch.zeros(b, h, n, device=keys.device)
    block = max(1, (PASS_ELEMENTS if few_kernels else BLOCK_ELEMENTS) // max(1, b * h * n))
    for start in range(0, n, block):
        stop = min(n, start + block)
        sim = k[:, :, start:stop] @ k.transpose(-1, -2)  # (B, H, c, n)
        rows = torch.arange(start, stop, device=keys.device)
        sim[:, :, rows - start, rows] = 0.0
        similar = sim > threshold
        if valid_cols is not None:
            similar = similar & valid_cols
        if retain == "last":
            index = torch.where(similar, local, zero).amax(-1)  # local: the row's own index of each position
        else:  # the code's min over where(similar, index, 0): 0 unless every other key is similar
            index = torch.where(similar, local, zero)
            if valid_cols is not None:
                index = index.masked_fill(~valid_cols, n)
            index = index.amin(-1)
        retained = index.long() + pad.view(b, 1, 1)  # (B, H, c), a position
        sim.scatter_(-1, retained.unsqueeze(-1), 0.0)
        if valid_cols is not None:
            row_valid = key_valid[:, None, start:stop, None]  # padded rows add nothing
            sim = sim.masked_fill(~row_valid, 0.0)
        sums += sim.sum(-2)
    count = torch.full((b, 1, 1), float(n), device=keys.device)
    if key_valid is not None:
        count = key_valid.sum(-1).float().view(b, 1, 1)
    mean = sums / count
    if key_valid is not None:
        mean = mean.masked_fill(~key_valid[:, None], float("-inf"))
    return torch.softmax(mean, dim=-1)


@dataclass
class RKV(ScorerMethod):
    """R-KV's selection, per layer and KV head: ``score = mix_lambda * importance - (1 - mix_lambda) * redundancy``
    over the entries older than the last ``window``; those ``window`` newest entries are always kept, and the top
    ``budget - window`` of the others by score (``R1KV.update_kv``: ``topk(budget - window_size)`` of the past, then
    the window appended; ``ScorerMethod``'s ``keep_top(..., window=)``). No sink tokens: ``first_tokens=4`` is passed
    by ``run_math.py`` but ``R1KV`` ignores it.

    Shapes: queries ``(B, Hq, n, D)``, keys ``(B, Hkv, n, D)``; importance ``(B, Hkv, n - w)`` (``rkv_attention``:
    GQA by the max of the group's logits before the softmax, ``compute_attention_scores(pooling="max")``),
    redundancy ``(B, Hkv, n)`` (``rkv_redundancy``, of the KV heads' keys) sliced to ``n - w``; scores ``(B, Hkv, n)``
    with the window ``+inf`` and padding ``-inf``. The importance and the redundancy are computed in float32 (the
    code: the softmax in float32, the similarity in the cache's dtype).

    Defaults, by source (Zefan-Cai/R-KV at d15c976): ``window=8`` (``rkv/compression/r1_kv.py:12``, the README's
    alpha, ``README.md:174``; ``run_math.py:138`` defaults ``--window_size`` to None, which ``R1KV``'s ``budget -
    window_size`` assertion cannot take, so the class default is the one that runs), ``kernel=7`` (``r1_kv.py:13``),
    ``mix_lambda=0.07`` (``r1_kv.py:14`` and ``run_math.py:140``, what the script runs; the README's table,
    ``README.md:175``, says 0.1), ``threshold=0.5`` (``rkv/utils.py:44``, never passed), ``retain_direction="last"``
    (``r1_kv.py:16``, ``run_math.py:144``); ``retain_ratio`` (``run_math.py:141``: 0.2) is used only by the
    ``*_percent`` directions and is not a field. Budget: ``scripts/run.sh:10`` ``--kv_budget 128``.

    When it compresses: the prompt, at the end of prefill, when it holds at least ``budget`` entries (``update_kv``
    leaves a shorter cache whole; at exactly ``budget`` it keeps everything); then during decoding every
    ``divide_length=128`` tokens (``run_math.py:154``, ``divide_method="step_length"``: when the count of tokens
    seen, prompt included, is a multiple of 128; ``rkv/modeling.py`` ``CausalLM_forward``), the whole cache back to
    ``budget``, scored by a buffer of the last ``window`` queries (``modeling.py``'s ``query_cache``). kvbench runs
    that schedule through ``method.decode_compression`` (issue #40; interval 128, query buffer 8); without it R-KV
    compresses the prompt only (the entries generated after it are appended).

    The cache's order (``cache_order``): the code stores the kept entries in ``topk`` order (scores descending), the
    window and the entries generated since after them, so at its next compression the max-pooling pools neighbours in
    that order and ``retain_direction`` takes the last similar key in it. ``cache_order="code"`` (default) scores the
    cache in that order (this layer's ranking of its last compression, kept by the method; kvbench stores entries in
    position order), which matters from the second compression on, i.e. while decoding; ``"position"`` scores in
    position order (``scripts/parity/rkv/cache_order.py``: the code's decode schedule on seeded inputs, 300-token
    prompt, budget 128, 640 steps, differs from it at every decode-time compression and head, by 16 to 52 of its 128
    entries; 19 of 50 sets, by at most 5 entries, with ``kernel=1``). A left-padded batch is scored in position
    order. A prompt of exactly ``budget`` tokens is not reordered (the code ranks it, keeping everything).
    ``cal_similarity`` reads ``key_states[0]``, the first row of a batch, for every row; kvbench scores
    each row on its own keys, which is the code at its scripts' batch of 1.
    """

    name: ClassVar[str] = "rkv"
    compression: ClassVar[str] = "prefill"
    window: int = 8
    kernel: int = 7
    mix_lambda: float = 0.07
    threshold: float = 0.5
    retain_direction: str = "last"
    cache_order: str = "code"

    def __post_init__(self) -> None:
        check_positive(self.name, window=self.window, kernel=self.kernel)
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ConfigError(f"method {self.name!r}: mix_lambda={self.mix_lambda!r} must be in [0, 1]")
        check_choice(self.name, "retain_direction", self.retain_direction, RETAIN)
        check_choice(self.name, "cache_order", self.cache_order, CACHE_ORDER)
        super().__post_init__()
        #: per layer index: (the layer, its ``seen`` then, the positions its last scoring ranked ``(B, H, n - w)``,
        #: scores descending): the code's stored order at the next compression (not a field: not a hyperparameter)
        self._ranked: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def observation_window(self) -> int:
        return self.window

    def score(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        """The mixed score ``(B, Hkv, n)`` in stored order: the window ``+inf``, padding ``-inf`` (the class
        docstring), computed over the cache in the code's order (``cache_order``)."""
        w, n = self.window, layer.keys.shape[2]  # the cache's entries (ctx.n counts the queries)
        order = self._code_order(layer, ctx)
        keys = layer.keys if order is None else layer.keys.gather(2, order[..., None].expand_as(layer.keys))
        attn = rkv_attention(ctx.queries, keys, w, self.kernel, ctx.scaling, ctx.key_valid)
        redundancy = rkv_redundancy(keys, self.threshold, self.retain_direction, ctx.key_valid,
                                    ctx.few_kernels)[..., : n - w]
        scores = attn * self.mix_lambda - redundancy * (1 - self.mix_lambda)
        if self.cache_order == "code" and ctx.key_valid is None and layer.valid is None:
            positions = layer.positions if order is None else layer.positions.gather(2, order)
            ranked = positions[..., : n - w].gather(-1, torch.argsort(scores, dim=-1, descending=True, stable=True))
            self._ranked[ctx.layer_idx] = (weakref.ref(layer), layer.seen, ranked)
        window_scores = torch.full((*scores.shape[:2], w), float("inf"), device=scores.device)
        scores = torch.cat([scores, window_scores], dim=-1)
        if order is not None:
            scores = torch.empty_like(scores).scatter_(-1, order, scores)
        if ctx.key_valid is not None:
            scores = scores.masked_fill(~ctx.key_valid[:, None], float("-inf"))
        return scores

    def _code_order(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        """The permutation ``(B, H, n)`` of the stored entries (position order) into the code's order: the entries
        this layer's last scoring ranked, in that ranking, then the others (its window, the entries appended since)
        in position order; None (position order) for ``cache_order="position"``, a padded cache, or no ranking of
        this layer's cache. A cache that holds every position from 0 (a prompt, or nothing evicted yet) is in the
        code's order as stored (decided on the device: no host read)."""
        if self.cache_order != "code" or ctx.key_valid is not None or layer.valid is not None:
            return None
        record = self._ranked.get(ctx.layer_idx)
        if record is None or record[0]() is not layer:
            return None
        _, seen, ranked = record
        positions = layer.positions
        b, h, n = positions.shape
        if ranked.shape[:2] != (b, h):
            return None
        size = max(seen, layer.seen) + 1
        rank = torch.full((b, h, size), size + n, dtype=torch.long, device=positions.device)
        rank.scatter_(-1, ranked, torch.arange(ranked.shape[-1], device=positions.device).expand_as(ranked))
        key = torch.where(rank.gather(-1, positions) < size + n, rank.gather(-1, positions), size + positions)
        fresh = (positions == torch.arange(n, device=positions.device)).all()
        key = torch.where(fresh, positions, key)
        return torch.argsort(key, dim=-1, stable=True)
