"""InfLLM: a local window plus retrieved blocks of distant context, attended at a fixed position distance.

Xiao et al., "InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient Context Memory" (2024),
as run by OmniKV (`antgroup/OmniKV`, `baselines/infllm`, `context_manager.py`). reference/methods.md B9, A3.6 item 5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.budget import Budget
from kvbench.errors import ConfigError, NotAvailableError
from kvbench.methods.base import DecodeContext, Method, PrefillContext, check_positive
from kvbench.methods.cache_ops import top_k_mask

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer

#: OmniKV's LongBench "~30 %" config (llama3-8b-inf-30-longbench.yaml): n_init 128, topk 16 x block 32, n_local 1024
_SPLIT = (128, 16 * 32, 1024)


def split_budget(tokens: int, block_size: int) -> tuple[int, int, int]:
    """``(n_init, topk, n_local)`` whose attended tokens ``n_init + topk * block_size + n_local`` equal ``tokens``,
    in the proportions of OmniKV's LongBench config (128 : 512 : 1024), at least one init token and one block."""
    total = sum(_SPLIT)
    n_init = max(1, round(tokens * _SPLIT[0] / total))
    topk = max(1, round(tokens * _SPLIT[1] / total / block_size))
    n_local = tokens - n_init - topk * block_size
    if n_local < 1:
        raise ConfigError(f"method 'infllm': {tokens} tokens leave no local window with block_size={block_size} "
                          f"(need at least {2 * block_size})")
    return n_init, topk, n_local


def _sizes(slots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n_init``, ``topk``, ``n_local`` of the current sample, ``(B, 1, 1)`` each: device values, not constants of
    the graph (a ratio budget sizes them per prompt; the job's samples replay one graph)."""
    sizes = slots.row_state["infllm_sizes"]  # (B, 3)
    b = sizes.shape[0]
    return sizes[:, 0].view(b, 1, 1), sizes[:, 1].view(b, 1, 1), sizes[:, 2].view(b, 1, 1)


def _fixed_query(slots, n_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's query at the memory's fixed angle ``n_local - 1`` ``(B, Hq, 1, D)`` float32, and its position
    ``(B, 1, 1)`` (the newest slot's: the step's own entry, just written)."""
    from kvbench.engine.rope import rotate_keys

    b, hq = slots.query.shape[:2]
    p = slots.positions.masked_fill(~slots.valid, -1).amax(-1)[:, :1].view(b, 1, 1)
    delta = (n_local - 1 - p).float().expand(b, hq, 1)
    return rotate_keys(slots.query.float(), delta, slots.rope_inv_freq.to(slots.query.device)), p


def static_attend(slots, policy) -> torch.Tensor:
    """The entries InfLLM's decode step attends (``StaticPolicy.attend``), ``(B, Hkv, C)``: the init tokens, the
    tokens of the ``topk`` memory blocks whose representative keys score highest against the query at the fixed angle
    (summed over heads; every block while there are at most ``topk``), and the tokens from the first not in a block
    on (the local window among them). The slots hold every entry at its position's index (nothing is evicted)."""
    block = policy.params[0]
    n_init, topk, n_local = _sizes(slots)
    reprs, blocks, start = (slots.row_state[k] for k in ("infllm_repr", "infllm_blocks", "infllm_start"))
    b, _, m, _ = reprs.shape
    q_fixed, _ = _fixed_query(slots, n_local)
    scores = torch.einsum("bhd,bhmd->bm", q_fixed[:, :, 0], reprs)
    exists = torch.arange(m, device=scores.device).view(1, m) < blocks.view(b, 1)
    # (B, M): the topk best, or every block while there are fewer
    chosen = top_k_mask(scores.masked_fill(~exists, float("-inf")), topk.view(b, 1)) & exists
    positions = slots.positions
    of_block = ((positions - n_init) // block).clamp(0, m - 1)
    in_chosen = torch.gather(chosen.view(b, 1, m).expand(b, positions.shape[1], m), -1, of_block)
    blocked = (positions >= n_init) & (positions < start)
    return slots.valid & ((positions < n_init) | (blocked & in_chosen) | (positions >= start))


def static_attention(slots, policy) -> torch.Tensor:
    """InfLLM's decode attention in the captured step (``StaticPolicy.attention``; ``slots.valid``: what
    :func:`static_attend` chose): the local window at the keys' own positions, every other attended entry at the fixed
    distance ``n_local`` (keys rotated back to position 0, the query to ``n_local - 1``), one softmax over both; the
    local attention each entry received joins its per-query-head score (``slots.state["infllm_score"]``
    ``(B, Hkv, C, g)``), and once the ``block_size`` entries from the first unblocked one on are ``n_local`` behind
    the query they form the next memory block: per query head the mean of the ``repr_topk`` highest-scored keys at
    position 0 (``InfLLM._form_blocks``). Returns ``(B, Hq, 1, D)``."""
    from kvbench.engine.rope import rotate_keys
    from kvbench.engine.static import put_slots

    block, repr_topk = policy.params
    _, _, n_local = _sizes(slots)
    keys, values, positions, attended, query = slots.keys, slots.values, slots.positions, slots.valid, slots.query
    reprs, blocks, start = (slots.row_state[k] for k in ("infllm_repr", "infllm_blocks", "infllm_start"))
    score = slots.state["infllm_score"]
    b, hq, _, d = query.shape
    hkv, c = keys.shape[1], keys.shape[2]
    g = hq // hkv
    inv_freq = slots.rope_inv_freq.to(query.device)
    q_fixed, p = _fixed_query(slots, n_local)
    k_mem = rotate_keys(keys.float(), (-positions).float(), inv_freq)
    dist = p - positions
    local = (dist >= 0) & (dist < n_local)
    distant = dist >= n_local
    qg, qf = query.float().view(b, hkv, g, 1, d), q_fixed.view(b, hkv, g, 1, d)
    logits_local = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys.float()) * slots.scaling
    logits_mem = torch.einsum("bhgqd,bhkd->bhgqk", qf, k_mem) * slots.scaling
    near, far = local.view(b, hkv, 1, 1, c), distant.view(b, hkv, 1, 1, c)
    logits = torch.where(near, logits_local, torch.where(far, logits_mem, float("-inf")))
    probs = torch.softmax(logits.masked_fill(~attended.view(b, hkv, 1, 1, c), float("-inf")), dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(values.dtype), values).reshape(b, hq, 1, d)
    # (entries before the first unblocked one gather scores too, which nothing reads: a block takes its own entries')
    score.add_((probs * near).sum(-2).transpose(-1, -2))  # (B, Hkv, C, g)
    # the next block, where its block_size entries are all n_local behind the query (at most one per step)
    due = p >= start + block + n_local - 1  # (B, 1, 1)
    inside = ((positions >= start) & (positions < start + block)).unsqueeze(-1)
    top = torch.topk(score.masked_fill(~inside, float("-inf")), repr_topk, dim=2).indices  # (B, Hkv, r, g)
    flat = top.transpose(-1, -2).reshape(b, hkv, g * repr_topk)
    chosen_keys = torch.gather(keys.float(), 2, flat.unsqueeze(-1).expand(b, hkv, g * repr_topk, d))
    at = torch.gather(positions, 2, flat)
    k_pre = rotate_keys(chosen_keys, (-at).float(), inv_freq).view(b, hkv, g, repr_topk, d).mean(3).view(b, hq, 1, d)
    index = blocks.view(b, 1, 1).clamp(max=reprs.shape[2] - 1).expand(b, hq, 1)
    current = torch.gather(reprs, 2, index.unsqueeze(-1).expand(b, hq, 1, d))
    put_slots(reprs, index, torch.where(due.view(b, 1, 1, 1), k_pre, current))
    blocks.add_(due.long())
    start.add_(due.long() * block)
    return out


@dataclass
class _Memory:
    """One layer's context memory: blocks ``[n_init + b * bs, n_init + (b+1) * bs)`` formed so far, their
    representative keys per query head, and the local-window attention each not-yet-blocked token has received."""

    repr: torch.Tensor  # (Hq, blocks, D) float32: mean of each block's repr_topk pre-RoPE keys per query head
    score: torch.Tensor  # (Hq, tokens from `start`) float32, accumulated local-window attention
    start: int  # first token not in init or a block

    @property
    def num_blocks(self) -> int:
        return self.repr.shape[1]


@dataclass
class InfLLM(Method):
    """Each query attends to (i) the ``n_local`` most recent tokens with their own positions and (ii) the context
    memory with every key at the fixed distance ``n_local - 1``: the first ``n_init`` tokens, the ``topk`` retrieved
    blocks and the tokens that left the local window but do not yet fill a block. Attention is one softmax over both.

    Blocks: once ``block_size`` tokens after the init tokens are at distance ``>= n_local`` from the newest token
    they form a block, represented per query head by the mean of its ``repr_topk`` keys that received the most
    local-window attention while in the window (``get_block_k``). Retrieval per chunk (one decode step, or an
    ``exc_block_size`` chunk of the prompt): block score ``Σ_h q̄_h · r_{h,b}`` with ``q̄`` the chunk's mean query at
    the fixed angle, one block set for all heads (``calc_block_topk``); every block while there are ``<= topk``.

    Prefill is InfLLM's own, chunked and sparse (``prefill_attend``): the prompt is processed in chunks of
    ``exc_block_size`` (clamped to ``n_local``; the code asserts ``exc_block_size <= n_local``), each query attending
    its local window plus the memory retrieved for its chunk; blocks form after each chunk. Each query's window is
    exactly its own last ``n_local`` tokens (the code's global-stage mask gives a chunk's early queries some
    in-window tokens a second time at the fixed distance; not reproduced).

    Positions: keys are cached post-RoPE at their own positions; memory keys are rotated back to position 0 and the
    query to angle ``n_local - 1`` (``rotate_keys`` with the model's RoPE frequencies; a model whose RoPE cannot be
    re-rotated is refused). Nothing is evicted: resident KV is FullKV. The GPU LRU cache of ``max_cached_block``
    blocks and the CPU offload of the others are memory placement only (no effect on outputs) and are not modelled.
    The captured decode step runs the same step over slots holding every entry (``static_attend``,
    ``static_attention``): it reads every slot's key, as the host-driven path's gather of the candidates does not.

    Budget: ``n_init``, ``n_local``, ``topk`` all set: used as given, the budget is unused. All null (default): the
    attended tokens ``n_init + topk * block_size + n_local`` are split in the proportions of OmniKV's LongBench
    config (128 : 16 x 32 : 1024): ``budget=C`` attends C tokens per step (plus < ``block_size`` unblocked tokens);
    a ratio is OmniKV's Mem% through A3.6 with ``max_cached_block = topk``:
    ``Mem = (n_init + n_local + topk * block_size) / n + repr_topk / block_size``. Batch size 1.
    """

    name: ClassVar[str] = "infllm"
    own_attention: ClassVar[bool] = True
    supports_continued_forward: ClassVar[bool] = False  # its own single-query decode attention/selection
    compression: ClassVar[str] = "attention"
    supports_batching: ClassVar[bool] = False
    block_size: int = 32
    n_init: int | None = None
    n_local: int | None = None
    topk: int | None = None
    repr_topk: int = 4
    exc_block_size: int = 512
    _budget: Budget | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_positive(self.name, block_size=self.block_size, repr_topk=self.repr_topk,
                       exc_block_size=self.exc_block_size)
        if self.repr_topk > self.block_size:
            raise ConfigError(f"method 'infllm': repr_topk={self.repr_topk} exceeds block_size={self.block_size}")
        given = [v is not None for v in (self.n_init, self.n_local, self.topk)]
        if any(given) and not all(given):
            raise ConfigError(f"method 'infllm': set all of n_init, n_local, topk (got n_init={self.n_init}, "
                              f"n_local={self.n_local}, topk={self.topk}) or none of them (derived from the budget)")
        if all(given):
            check_positive(self.name, n_local=self.n_local, topk=self.topk)
            if self.n_init < 0:
                raise ConfigError(f"method 'infllm': n_init={self.n_init} must be >= 0")
            if self.exc_block_size > self.n_local:
                raise ConfigError(f"method 'infllm': exc_block_size={self.exc_block_size} must be <= "
                                  f"n_local={self.n_local} (InfLLM asserts it: no memory token inside a chunk)")
        self._params: tuple[int, int, int] | None = None  # (n_init, topk, n_local) of the current sample
        self._memory: dict[int, _Memory] = {}

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured step: :func:`static_attend` (retrieval) and :func:`static_attention` (the two-distance
        attention, the window's scores, the next block), over slots that hold every entry (nothing is evicted)."""
        from kvbench.engine.static import StaticPolicy

        return StaticPolicy(attend=static_attend, attention=static_attention, state=("infllm_score",),
                            params=(self.block_size, self.repr_topk))

    def static_state(self, layer: KVLayer, layer_idx: int, slots: int):
        """The layer's memory: each unblocked entry's local-window score per query head ``(1, Hkv, n, g)``, the
        blocks' representative keys ``(1, Hq, M, D)`` (room for every block ``slots`` entries can form, at least
        ``topk``), the block count, the first unblocked position and the sample's ``n_init``, ``topk``,
        ``n_local``."""
        mem = self._memory[layer_idx]
        hq, _, d = mem.repr.shape
        hkv, n = layer.values.shape[1], layer.num_entries
        device = mem.repr.device
        score = torch.zeros(1, hkv, n, hq // hkv, device=device)
        tail = mem.score.shape[1]
        score[0, :, mem.start : mem.start + tail] = mem.score.view(hkv, hq // hkv, tail).transpose(1, 2)
        room = slots // self.block_size + 1  # (a shape of the graph: the slots', not the sample's sizes)
        reprs = torch.zeros(1, hq, room, d, device=device)
        reprs[0, :, : mem.num_blocks] = mem.repr
        count = torch.full((1, 1, 1), mem.num_blocks, dtype=torch.long, device=device)
        start = torch.full((1, 1, 1), mem.start, dtype=torch.long, device=device)
        sizes = torch.tensor([self._params], dtype=torch.long, device=device)
        return {"infllm_score": score}, {"infllm_repr": reprs, "infllm_blocks": count, "infllm_start": start,
                                         "infllm_sizes": sizes}

    @property
    def explicit(self) -> bool:
        return self.n_local is not None

    def min_budget_tokens(self) -> int:
        return 1 if self.explicit else 2 * self.block_size  # n_init, n_local, topk given: the budget is unused

    def min_budget_reason(self) -> str:
        return f"init tokens, one block of {self.block_size} and a local window"

    def validate(self, budget: Budget) -> None:
        if not self.explicit:
            super().validate(budget)
            if budget.kind == "ratio" and budget.value <= self.repr_topk / self.block_size:
                raise ConfigError(f"budget={budget.label()} is not above repr_topk / block_size = "
                                  f"{self.repr_topk / self.block_size:g}, the representative keys' share of Mem% "
                                  "(A3.6)")
        self._budget = budget

    def expected_compression(self, budget: Budget, prompt_len: int, num_layers: int) -> str:
        """Every block is retrieved while there are at most ``topk`` (and the unblocked tail is attended whole): a
        prompt attends to less than itself only beyond ``n_init + topk * block_size + n_local + block_size``."""
        if not self.explicit and (budget.is_full or budget.tokens_for(prompt_len) >= prompt_len):
            return "none"
        n_init, topk, n_local = self.resolve(prompt_len)
        return "attention" if prompt_len > n_init + (topk + 1) * self.block_size + n_local else "none"

    def budget_label(self, budget: Budget) -> str | None:
        if self.explicit:
            return f"init{self.n_init}+local{self.n_local}+top{self.topk}x{self.block_size}"
        return None

    def describe(self) -> dict:
        return {k: v for k, v in super().describe().items() if not k.startswith("_")}

    def resolve(self, prompt_len: int) -> tuple[int, int, int]:
        """``(n_init, topk, n_local)`` for a prompt of ``prompt_len`` tokens."""
        if self.explicit:
            return self.n_init, self.topk, self.n_local
        budget = self._budget
        if budget is None or budget.kind == "full":
            raise ConfigError("method 'infllm' needs a budget or explicit n_init, n_local, topk")
        if budget.kind == "tokens":
            tokens = int(budget.value)
        else:  # Mem% (A3.6) with max_cached_block = topk
            tokens = math.floor((budget.value - self.repr_topk / self.block_size) * prompt_len)
        return split_budget(tokens, self.block_size)

    # ---- one chunk of queries ------------------------------------------------------------------------------------
    def _step(self, mem: _Memory, keys, values, query, start: int, inv_freq, scaling: float) -> tuple:
        """Attention of the queries at positions ``start .. start+m-1`` (``query`` ``(1, Hq, m, D)`` post-RoPE) over
        the entries ``0 .. start+m-1`` of ``keys``/``values`` ``(1, Hkv, T, D)``; updates ``mem``. Returns the output
        ``(1, Hq, m, D)`` and the number of entries the last query attended."""
        from kvbench.engine.rope import rotate_keys

        n_init, topk, n_local = self._params
        bs = self.block_size
        _, hq, m, d = query.shape
        hkv = keys.shape[1]
        device = query.device
        stop = start + m
        qpos = torch.arange(start, stop, device=device)
        q_fixed = rotate_keys(query.float(), (n_local - 1 - qpos).float().expand(1, hq, m), inv_freq)
        # retrieval with the chunk's mean query at the fixed angle, summed over heads
        if mem.num_blocks <= topk:
            blocks = torch.arange(mem.num_blocks, device=device)
        else:
            scores = torch.einsum("hd,hbd->b", q_fixed[0].mean(1), mem.repr)
            blocks = torch.topk(scores, topk).indices.sort().values
        block_tokens = (n_init + blocks.unsqueeze(-1) * bs + torch.arange(bs, device=device)).flatten()
        cand = torch.cat([torch.arange(min(n_init, stop), device=device), block_tokens,
                          torch.arange(max(mem.start, n_init), stop, device=device)])
        kc, vc = keys[:, :, cand], values[:, :, cand]
        k_mem = rotate_keys(kc.float(), (-cand).float().expand(1, hkv, -1), inv_freq)
        dist = qpos.view(-1, 1) - cand.view(1, -1)
        local = (dist >= 0) & (dist < n_local)
        distant = dist >= n_local
        qg, qf = query.float().view(1, hkv, hq // hkv, m, d), q_fixed.view(1, hkv, hq // hkv, m, d)
        logits_local = torch.einsum("bhgqd,bhkd->bhgqk", qg, kc.float()) * scaling
        logits_mem = torch.einsum("bhgqd,bhkd->bhgqk", qf, k_mem) * scaling
        logits = torch.where(local, logits_local, torch.where(distant, logits_mem, float("-inf")))
        probs = torch.softmax(logits, dim=-1)
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs.to(vc.dtype), vc).reshape(1, hq, m, d)
        # local-window attention received by each not-yet-blocked token, per query head
        received = (probs * local).sum(-2).reshape(hq, -1)
        # the tokens not yet in blocks are cand's last segment, [mem.start, stop) (init tokens and memory blocks all
        # lie before mem.start): a slice, so that the host never waits for the device here
        tail = max(0, stop - mem.start)
        grown = tail - mem.score.shape[1]
        if grown > 0:
            mem.score = torch.cat([mem.score, mem.score.new_zeros(hq, grown)], dim=1)
        if tail:
            mem.score[:, :tail] += received[:, cand.numel() - tail :]
        self._form_blocks(mem, keys, stop, inv_freq)
        return out, cand.numel()  # every candidate precedes the last query: it attends them all

    def _form_blocks(self, mem: _Memory, keys, stop: int, inv_freq) -> None:
        """Blocks whose tokens are all at distance >= n_local from the newest token join the memory."""
        from kvbench.engine.rope import rotate_keys

        n_init, _, n_local = self._params
        bs = self.block_size
        hq = mem.score.shape[0]
        hkv = keys.shape[1]
        while mem.start >= n_init and stop >= mem.start + bs + n_local:
            top = torch.topk(mem.score[:, :bs], self.repr_topk, dim=-1).indices  # (Hq, r)
            pos = mem.start + top
            kv_head = torch.arange(hq, device=top.device) // (hq // hkv)
            k = keys[0, kv_head.unsqueeze(-1), pos].float()  # (Hq, r, D)
            k_pre = rotate_keys(k.unsqueeze(0), (-pos).float().unsqueeze(0), inv_freq)[0]
            mem.repr = torch.cat([mem.repr, k_pre.mean(1, keepdim=True)], dim=1)
            mem.score = mem.score[:, bs:]
            mem.start += bs

    # ---- engine hooks --------------------------------------------------------------------------------------------
    def prefill_attend(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor | None:
        if ctx.rope_inv_freq is None:
            raise NotAvailableError(
                "method 'infllm' places its memory at a fixed distance by re-rotating keys, which needs a RoPE that "
                "can be re-rotated (rope_type default, linear or llama3 with attention_scaling 1); this model's cannot"
            )
        if layer.valid is not None or ctx.queries.shape[0] != 1:
            raise NotAvailableError("method 'infllm' runs one sequence at a time (batch_size=1, no padding)")
        n = ctx.n
        if ctx.layer_idx == 0:
            self._params = self.resolve(ctx.host_ints()[0][0])
        n_init, _, n_local = self._params
        hq, d = ctx.queries.shape[1], ctx.queries.shape[-1]
        inv_freq = ctx.rope_inv_freq.to(ctx.queries.device)
        mem = _Memory(repr=torch.empty(hq, 0, d, device=ctx.queries.device),
                      score=torch.empty(hq, 0, device=ctx.queries.device), start=n_init)
        self._memory[ctx.layer_idx] = mem
        chunk = min(self.exc_block_size, n_local)
        outs = []
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            out, _ = self._step(mem, layer.keys, layer.values, ctx.queries[:, :, start:stop], start, inv_freq,
                                ctx.scaling)
            outs.append(out)
        return torch.cat(outs, dim=2).transpose(1, 2).to(layer.values.dtype).contiguous()

    def attend(self, layer: KVLayer, ctx: DecodeContext) -> torch.Tensor | None:
        mem = self._memory.get(ctx.layer_idx)
        if mem is None or self._params is None:  # no InfLLM prefill ran (full budget): the engine's attention
            return None
        q = ctx.query.shape[2]
        scaling = ctx.scaling or ctx.query.shape[-1] ** -0.5
        inv_freq = ctx.rope_inv_freq.to(ctx.query.device)
        out, ctx.attended = self._step(mem, layer.keys, layer.values, ctx.query, layer.num_entries - q, inv_freq,
                                       scaling)
        return out.transpose(1, 2).to(layer.values.dtype).contiguous()
