"""LM-Infinite: Λ-shaped attention (start tokens + a local window) with a distance ceiling.

Han et al., "LM-Infinite: Zero-Shot Extreme Length Generalization for Large Language Models" (NAACL 2024,
arXiv:2308.16137), code Glaciohound/LM-Infinite (``models/llama.py``, ``models/lambda_attention.py``).
reference/methods.md B11; POD (paper 004) compares against it at 16 + 4080.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.errors import NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_positive, keep_top, real_rank

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


def lambda_attention(q, q_pos, glob, local, window, inv_freq, scaling):
    """One block of Λ-shaped attention with the distance ceiling, GQA-native.

    q ``(B, Hkv, g, c, D)`` post-RoPE at positions ``q_pos`` ``(B, c)``; ``glob`` and ``local`` are key sets
    ``(keys, values, positions, ok)`` of shapes ``(B, Hkv, T, D)`` x2, ``(B, Hkv, T)`` x2, keys post-RoPE at their
    positions; ``window`` ``(B,)`` = n_local. A local key at distance ``0 <= i - j < n_local`` is attended with its
    true rotation (``q_i · k_j``, both post-RoPE); a global key further away is attended at distance exactly
    ``n_local``: the query is re-rotated to position ``n_local`` and the key to position 0 (the official
    ``limit_distance = local_branch``). Every other pair is masked. Returns the output ``(B, Hkv, g, c, D)``.
    """
    from kvbench.engine.rope import rotate_keys

    b, hkv, g, c, d = q.shape
    lim = window.view(b, 1, 1, 1)

    def dist(pos):  # (B, Hkv, c, T)
        return q_pos.view(b, 1, c, 1) - pos.unsqueeze(2)

    gk, gv, gpos, gok = glob
    lk, lv, lpos, lok = local
    q_delta = (window.view(b, 1, 1) - q_pos.view(b, 1, c)).expand(b, hkv * g, c).float()
    q_stat = rotate_keys(q.reshape(b, hkv * g, c, d), q_delta, inv_freq).view(b, hkv, g, c, d)
    stat = torch.einsum("bhgqd,bhkd->bhgqk", q_stat, rotate_keys(gk, -gpos.float(), inv_freq)).float()
    stat = stat.masked_fill(~(gok.unsqueeze(2) & (dist(gpos) >= lim)).unsqueeze(2), float("-inf"))
    rot = torch.einsum("bhgqd,bhkd->bhgqk", q, lk).float()
    dl = dist(lpos)
    rot = rot.masked_fill(~(lok.unsqueeze(2) & (dl >= 0) & (dl < lim)).unsqueeze(2), float("-inf"))
    probs = torch.softmax(torch.cat([stat, rot], dim=-1) * scaling, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0).to(lv.dtype)  # padded queries see no key at all
    n_glob = gk.shape[2]
    return (torch.einsum("bhgqk,bhkd->bhgqd", probs[..., :n_glob], gv)
            + torch.einsum("bhgqk,bhkd->bhgqd", probs[..., n_glob:], lv))


def static_attention(slots, policy) -> torch.Tensor:
    """LM-Infinite's decode attention in the captured step (``StaticPolicy.attention``): :func:`lambda_attention` of
    the step's query over the slots, as ``LMInfinite.attend`` over the cache. The globals are the slots at the
    sequence's first ``params[0]`` positions (a row's real tokens start at 0; they are never evicted), the query's
    position is the newest slot's (the step's own, just written), ``n_local`` is the row's capacity minus the globals
    plus one. Returns ``(B, Hq, 1, D)``."""
    keys, values, positions, valid, query = slots.keys, slots.values, slots.positions, slots.valid, slots.query
    b, hq, q, d = query.shape
    hkv = keys.shape[1]
    window = (slots.capacity.view(b) - policy.params[0] + 1).clamp(min=1)
    q_pos = positions.masked_fill(~valid, -1).amax(-1)[:, :1]  # (B, 1)
    entries = (keys, values, positions)
    globals_ = valid & (positions < policy.params[0])
    out = lambda_attention(query.view(b, hkv, hq // hkv, q, d), q_pos, (*entries, globals_), (*entries, valid), window,
                           slots.rope_inv_freq.to(query.device), slots.scaling)
    return out.reshape(b, hq, q, d)


#: logits of one pass of the blocked prompt attention, in bytes (float32): its kernels do not grow with the prompt
#: until the prompt's logits exceed this
PASS_BYTES = 1 << 30


def _fold(x: torch.Tensor, at: int, m0: int, m: int) -> torch.Tensor:
    """The blocks ``[m0, m0 + m)`` of dim ``at`` folded into the batch (dim 0): ``(B m, ...)``."""
    return x.narrow(at, m0, m).movedim(at, 1).flatten(0, 1)


def _each(x: torch.Tensor, m: int) -> torch.Tensor:
    """One copy of a per-row tensor ``(B, ...)`` per block: ``(B m, ...)``."""
    return x.unsqueeze(1).expand(x.shape[0], m, *x.shape[1:]).flatten(0, 1)


def _blocked(qg, pos, layer, valid, glob, window, inv_freq, scaling, span, rows) -> torch.Tensor:
    """The prompt's Λ attention (:func:`lambda_attention`) with every block of ``rows`` queries in one batched call
    (``PrefillContext.few_kernels``, a GPU's form): block ``m`` sees the keys ``[m rows - span, (m + 1) rows)`` (an
    ``unfold`` of the keys, padded at both ends with invalid entries), the blocks folded into the batch. Passes of
    at most ``PASS_BYTES`` of logits. Returns ``(B, n, Hq, D)``."""
    b, hkv, g, n, d = qg.shape
    nb, width = -(-n // rows), span + rows
    tail = nb * rows - n
    pad = torch.nn.functional.pad

    def blocks(x: torch.Tensor, dim: int) -> torch.Tensor:  # (..., n + span + tail, ...) -> (..., nb, width, ...)
        return x.unfold(dim, width, rows).movedim(-1, dim + 1)

    keys = blocks(pad(layer.keys, (0, 0, span, tail)), 2)  # (B, Hkv, nb, width, D)
    values = blocks(pad(layer.values, (0, 0, span, tail)), 2)
    kpos = blocks(pad(layer.positions, (span, tail)), 2)  # (B, Hkv, nb, width)
    kok = blocks(pad(valid, (span, tail), value=False), 1).unsqueeze(1).expand(b, hkv, nb, width)
    qb = pad(qg, (0, 0, 0, tail)).view(b, hkv, g, nb, rows, d)
    qpos = pad(pos, (0, tail)).view(b, nb, rows)
    step = max(1, PASS_BYTES // (b * hkv * g * rows * (width + glob[0].shape[2]) * 4))
    outs = []
    for m0 in range(0, nb, step):
        m = min(nb, m0 + step) - m0
        out = lambda_attention(_fold(qb, 3, m0, m), _fold(qpos, 1, m0, m), tuple(_each(x, m) for x in glob),
                               tuple(_fold(x, at, m0, m) for x, at in ((keys, 2), (values, 2), (kpos, 2), (kok, 2))),
                               _each(window, m), inv_freq, scaling)  # (B m, Hkv, g, rows, D)
        outs.append(out.unflatten(0, (b, m)))
    out = torch.cat(outs, dim=1).permute(0, 2, 3, 1, 4, 5).reshape(b, hkv * g, nb * rows, d)[:, :, :n]
    return out.transpose(1, 2).contiguous()


@dataclass
class LMInfinite(Method):
    """Λ-shaped attention in prefill and decode, and a cache that keeps only what the Λ mask can still reach.

    Each query attends to the ``n_global`` first tokens of its sequence and to the ``n_local`` most recent tokens
    including itself (the official ``local_branch``: distances ``0 .. n_local - 1``), nothing in between. Inside the
    window keys keep their RoPE distance; a global token further away is seen at distance ``n_local`` (the official
    ``limit_distance = local_branch``: "relative distances larger than n_local are clamped", methods.md B11). Keys in
    the cache are post-RoPE at their original positions, so the ceiling re-rotates the query to position
    ``n_local`` and the global key to position 0 (``engine.session.rotate_keys``; needs ``ctx.rope_inv_freq``).

    Budget: the cache holds ``budget = n_global + n_local - 1`` entries per layer between steps (the ``n_global``
    first tokens and the ``n_local - 1`` newest); a step's query attends to them and to itself, ``n_global +
    n_local`` keys. Middle tokens are evicted for real: they are never attended again. ``n_global = 10`` is the
    official README's drop-in ``convert_llama_model(model, 4096, 10)`` (its scripts use 100 and call 10–100 alike;
    POD uses 16). Prompt attention is computed in query chunks of ``chunk`` rows (keys: the globals and the rows'
    window), never as an n x n matrix; with ``PrefillContext.few_kernels`` (on CUDA) all chunks in one batched call.
    """

    name: ClassVar[str] = "lminfinite"
    own_attention: ClassVar[bool] = True
    compression: ClassVar[str] = "prefill"
    n_global: int = 10
    chunk: int = 512

    def __post_init__(self) -> None:
        check_positive(self.name, n_global=self.n_global, chunk=self.chunk)

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured step: :func:`static_attention` (the Λ attention with the distance ceiling over the slots),
        then the oldest entry after the ``n_global`` first positions leaves (the cache is StreamingLLM's: the
        globals and the ``n_local - 1`` newest)."""
        from kvbench.engine.static import StaticPolicy, evict_oldest

        return StaticPolicy(evict=evict_oldest, attention=static_attention, params=(self.n_global,))

    def min_budget_tokens(self) -> int:
        return self.n_global + 1

    def min_budget_reason(self) -> str:
        return f"n_global={self.n_global} start tokens + at least one local token before the query"

    def _window(self, capacity: torch.Tensor) -> torch.Tensor:
        """n_local per row: the cache's ``capacity`` minus the globals, plus the query itself (at least 1)."""
        return (capacity - self.n_global + 1).clamp(min=1)

    def _inv_freq(self, ctx) -> torch.Tensor:
        if ctx.rope_inv_freq is None:
            raise NotAvailableError(
                "lminfinite needs a rotary (RoPE) model whose keys can be re-rotated (rope_type default, linear or "
                "llama3): this model exposes no such rotary embedding, so the distance ceiling cannot be applied"
            )
        return ctx.rope_inv_freq

    @staticmethod
    def _check_positions(layer: KVLayer) -> None:
        if layer.rope_pos is not None:
            raise NotAvailableError(
                "lminfinite sets its own relative positions (the distance ceiling); use position_mode=original"
            )

    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        inv_freq = self._inv_freq(ctx).to(ctx.queries.device)
        self._check_positions(layer)
        window = self._window(ctx.capacity)
        lens, caps = ctx.host_ints()
        windows = [max(1, c - self.n_global + 1) for c in caps]  # _window on the host
        if all(x <= w for x, w in zip(lens, windows)):
            return None  # every distance is inside the window: plain causal attention, the backend's exact path
        b, hq, n, d = ctx.queries.shape
        hkv = ctx.num_kv_heads
        pos = layer.positions[:, 0]  # (B, n) the positions keys and queries were rotated at
        pad = (n - ctx.prompt_lens).view(b, 1)
        valid = ctx.key_valid if ctx.key_valid is not None else torch.ones(b, n, dtype=torch.bool, device=pos.device)
        g_idx = (pad + torch.arange(self.n_global, device=pos.device)).clamp(max=n - 1)  # first real tokens (B, G)
        g_ok = torch.gather(valid, 1, g_idx) & (pad + torch.arange(self.n_global, device=pos.device) < n)
        qg = ctx.queries.view(b, hkv, hq // hkv, n, d)
        idx4 = g_idx.view(b, 1, -1, 1).expand(b, hkv, -1, d)
        expand = (b, hkv, self.n_global)
        glob = (torch.gather(layer.keys, 2, idx4), torch.gather(layer.values, 2, idx4),
                torch.gather(pos, 1, g_idx).unsqueeze(1).expand(expand), g_ok.unsqueeze(1).expand(expand))
        span = max(windows) - 1
        rows = max(64, min(self.chunk, span + 1))  # about one window of queries: few masked keys per row
        if ctx.few_kernels:
            return _blocked(qg, pos, layer, valid, glob, window, inv_freq, ctx.scaling, span, rows).to(
                layer.values.dtype)
        outs = []
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            lo = max(0, start - span)
            local = (layer.keys[:, :, lo:stop], layer.values[:, :, lo:stop], layer.positions[:, :, lo:stop],
                     valid[:, lo:stop].unsqueeze(1).expand(b, hkv, stop - lo))
            outs.append(lambda_attention(qg[:, :, :, start:stop], pos[:, start:stop], glob, local, window, inv_freq,
                                         ctx.scaling))
        out = torch.cat(outs, dim=3).reshape(b, hq, n, d)
        return out.transpose(1, 2).contiguous().to(layer.values.dtype)

    def _keep_scores(self, layer: KVLayer, window: torch.Tensor) -> torch.Tensor:
        """+inf for the globals and the entries the next query's window reaches, -inf for the rest."""
        rank = real_rank(layer)
        latest = layer.positions.amax(-1, keepdim=True)
        reach = layer.positions >= latest + 2 - window.view(-1, 1, 1)
        keep = (rank >= 0) & ((rank < self.n_global) | reach)
        return torch.where(keep, float("inf"), float("-inf"))

    def prefill(self, layer: KVLayer, ctx: PrefillContext) -> None:
        keep_top(layer, self._keep_scores(layer, self._window(ctx.capacity)), ctx.capacity)

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        inv_freq = self._inv_freq(ctx).to(ctx.query.device)
        self._check_positions(layer)
        b, hq, q, d = ctx.query.shape
        hkv = layer.keys.shape[1]
        rank = real_rank(layer)
        entries = (layer.keys, layer.values, layer.positions)
        glob = (*entries, (rank >= 0) & (rank < self.n_global))  # every entry: only the globals pass beyond the window
        out = lambda_attention(ctx.query.view(b, hkv, hq // hkv, q, d), layer.positions[:, 0, -q:], glob,
                               (*entries, rank >= 0), self._window(ctx.capacity), inv_freq, ctx.scaling or d**-0.5)
        return out.reshape(b, hq, q, d).transpose(1, 2).contiguous()

    def decode(self, layer: KVLayer, ctx: DecodeContext) -> None:
        keep_top(layer, self._keep_scores(layer, self._window(ctx.capacity)), ctx.capacity)
