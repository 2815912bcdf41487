"""Expected Attention: keep the tokens future queries are expected to attend to, from the prompt queries' statistics.

Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution"
(arXiv:2510.00636); kvpress ``ExpectedAttentionPress`` (the reference this follows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.rope import rotate_keys
from kvbench.errors import NotAvailableError
from kvbench.methods.base import PrefillContext, check_positive
from kvbench.methods.scorer import ScorerMethod

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer


def averaged_rope(inv_freq: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """The mean ``(D, D)`` of the RoPE rotation matrices of positions ``start .. start + count - 1`` (rotate-half
    layout: ``R x = cos * x + sin * rotate_half(x)``), float32 as transformers computes cos and sin."""
    pos = torch.arange(start, start + count, device=inv_freq.device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None]
    emb = torch.cat([freqs, freqs], dim=-1)  # (count, D)
    d = emb.shape[-1]
    half = torch.eye(d // 2, device=inv_freq.device)
    p = torch.zeros(d, d, device=inv_freq.device)
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = half, -half  # rotate_half as a matrix
    eye = torch.eye(d, device=inv_freq.device)
    return (emb.cos()[:, :, None] * eye + emb.sin()[:, :, None] * p).mean(0)


def expected_scores(pre_queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, inv_freq: torch.Tensor,
                    scaling: float, n_future: int, n_sink: int, use_covariance: bool, use_vnorm: bool,
                    epsilon: float) -> torch.Tensor:
    """One row's scores ``(Hkv, n)``: pre-RoPE queries ``(Hq, m, D)`` (the prompt's, ``m = n``, or a decode buffer's),
    post-RoPE keys and values ``(Hkv, n, D)``.

    The queries after the ``n_sink`` first have mean ``mu`` and (population) covariance ``S`` per head; both are
    carried to positions ``m .. m + n_future - 1`` by the averaged RoPE ``R`` (``R mu``, ``R S R^T``). A key's expected
    logit under a Gaussian query is ``s mu.k + s^2/2 k^T S k`` (s the softmax scale; kvpress writes ``1/sqrt(d)`` and
    ``1/(2d)``, the same for a default scale); softmax over the non-sink keys, mean over the KV group, times
    ``||v||`` (``+ epsilon`` first). The sinks get ``+inf`` (kvpress: the maximum + 1)."""
    hq, n, d = pre_queries.shape
    hkv = keys.shape[0]
    q = pre_queries[:, n_sink:].float()
    mu = q.mean(1)  # (Hq, D)
    rot = averaged_rope(inv_freq, n, n_future).to(q.device)
    mu = mu @ rot.T
    k = keys[:, n_sink:].float().repeat_interleave(hq // hkv, dim=0)  # (Hq, m, D)
    logits = torch.einsum("hd,hmd->hm", mu, k) * scaling
    if use_covariance:
        centered = q - q.mean(1, keepdim=True)
        cov = torch.einsum("hsi,hsj->hij", centered, centered) / q.shape[1]
        cov = rot @ cov @ rot.T
        logits = logits + torch.einsum("hmi,hij,hmj->hm", k, cov, k) * (scaling * scaling / 2)
    probs = torch.softmax(logits, dim=-1).view(hkv, hq // hkv, -1).mean(1)  # (Hkv, m)
    if use_vnorm:
        probs = (probs + epsilon) * values[:, n_sink:].float().norm(dim=-1)
    sinks = torch.full((hkv, min(n_sink, keys.shape[1])), float("inf"), device=probs.device)
    return torch.cat([sinks, probs], dim=-1)


@dataclass
class ExpectedAttention(ScorerMethod):
    """Per layer and KV head, keep the ``budget`` tokens with the highest expected attention from the
    next ``n_future_positions`` queries (``expected_scores``), the ``n_sink`` first tokens always kept.

    During decode (``decode_compression``, kvpress ``DecodingPress(ExpectedAttentionPress())``) the statistics are the
    buffered decode queries' (the first ``n_sink`` of the buffer dropped, as kvpress drops its first hidden states) and
    the future positions are, as in kvpress, ``q_len .. q_len + n_future_positions - 1`` with ``q_len`` the number of
    buffered queries (the buffer's length, not the cache's position: kvpress's reading, reproduced as it is); the
    sinks are the cache's first ``n_sink`` entries. The buffer must hold more than ``n_sink`` queries (refused in one
    line otherwise: kvpress would average an empty set).

    Defaults are kvpress's: 512 future positions, 4 sinks, covariance and value norms on, epsilon 0. The
    statistics need the prompt queries before RoPE: kvbench un-rotates the post-RoPE queries the engine hands over
    at their own positions (exact up to float rounding), so the method needs the model's RoPE frequencies (a
    position-independent RoPE with attention scaling 1; otherwise it refuses in one line).
    """

    name: ClassVar[str] = "expected_attention"
    compression: ClassVar[str] = "prefill"
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self.name, n_future_positions=self.n_future_positions)
        if self.n_sink < 0 or self.epsilon < 0:
            from kvbench.errors import ConfigError

            raise ConfigError(f"method 'expected_attention': n_sink={self.n_sink} and epsilon={self.epsilon} must be "
                              ">= 0")

    def check_decode_queries(self, spec) -> None:
        if spec is not None and spec.min_queries() <= self.n_sink:
            from kvbench.errors import ConfigError

            raise ConfigError(f"method 'expected_attention': decode_compression scores with min(interval="
                              f"{spec.interval}, query_buffer+1={spec.query_buffer + 1}) = {spec.min_queries()} "
                              f"buffered queries, not more than n_sink={self.n_sink} (kvpress drops the first n_sink "
                              "of them: no statistics would be left); raise interval and query_buffer above "
                              f"{self.n_sink}")

    def min_budget_tokens(self) -> int:
        return self.n_sink + 1

    def min_budget_reason(self) -> str:
        return f"the {self.n_sink} sink tokens are part of the budget"

    def score(self, layer: KVLayer, ctx: PrefillContext) -> torch.Tensor:
        if ctx.rope_inv_freq is None:
            raise NotAvailableError("method 'expected_attention' needs the model's RoPE frequencies to recover the "
                                    "queries before RoPE; this model's rotary embedding is not position-independent "
                                    "with attention scaling 1")
        inv_freq = ctx.rope_inv_freq.to(ctx.queries.device)
        b, hq, n, d = ctx.queries.shape
        if 2 * inv_freq.numel() != d:
            raise NotAvailableError(f"method 'expected_attention': the model rotates {2 * inv_freq.numel()} of {d} "
                                    "query dimensions (partial RoPE); the averaged rotation assumes a full one")
        # the queries are the newest n entries' (the whole prompt at prefill; the buffered decode steps at a
        # compression during decode, whose keys the layer appended last): each sits at its own key's position
        entries = layer.keys.shape[2]
        positions = layer.positions[:, :1, entries - n:].expand(b, hq, n)
        pre = rotate_keys(ctx.queries.float(), -positions.float(), inv_freq)
        scores = torch.full(layer.keys.shape[:3], float("-inf"), device=layer.keys.device)
        for row in range(b):  # statistics over the row's own tokens, padding excluded
            where = ctx.row_tokens(row)  # (left padding: a slice of host ints, so indexing reads nothing back)
            if isinstance(where, slice):  # the row's tokens are entries [where.start, entries): of the last n, these
                queried = slice(max(0, n - (entries - (where.start or 0))), n)
            else:
                queried = ctx.key_valid[row, entries - n:]
            length = ctx.host_ints()[0][row]
            if length <= self.n_sink:
                scores[row][:, where] = float("inf")
                continue
            scores[row][:, where] = expected_scores(
                pre[row][:, queried], layer.keys[row][:, where], layer.values[row][:, where], inv_freq, ctx.scaling,
                self.n_future_positions, self.n_sink, self.use_covariance, self.use_vnorm, self.epsilon)
        return scores
