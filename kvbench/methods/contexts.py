"""What a method sees at each point the engine calls it: one layer's prefill (``PrefillContext``) and one decode step
(``DecodeContext``). Plain data; part of the method contract (``methods.base``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillContext:
    """What a method sees for one layer at the end of prefill.

    queries: ``(B, Hq, n, D)`` post-RoPE queries of the prompt.
    key_valid: ``(B, n)`` False at left padding, or None.
    prompt_lens: ``(B,)`` real prompt length per row (n minus padding).
    capacity: ``(B,)`` tokens per layer the budget allows for each row (average over layers).
    """

    layer_idx: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    scaling: float
    queries: torch.Tensor
    key_valid: torch.Tensor | None
    prompt_lens: torch.Tensor
    capacity: torch.Tensor
    #: ``(D/2,)`` RoPE inverse frequencies when keys can be re-rotated (``engine.session.rotate_keys``), else None
    rope_inv_freq: torch.Tensor | None = None
    #: True when the model's prompt attention is plain causal softmax attention (no sliding window reaching into the
    #: prompt, no logit soft-capping), so a method may compute it itself (``attend_with_column_sums``)
    plain_causal: bool = False
    #: ``(B, Hq, n)`` column sums of the prompt attention, when ``prefill_attend`` computed them with the output
    column_sums: torch.Tensor | None = None
    #: prefer a fixed number of large kernels to loops over cache-sized chunks (a GPU's regime, where a prefill that
    #: launches thousands of small kernels per layer waits on the host; the session sets it on CUDA): the scoring
    #: passes that loop over query chunks on a CPU (column sums, CaM's Λ attention, KVMerger's merging sets) take
    #: their constant-kernel form, whose launches do not grow with the prompt (tests/test_prefill_kernels.py)
    few_kernels: bool = False
    #: ``(prompt_lens, capacity)`` as Python ints when the session knows them (it does: no device read per layer)
    host: tuple[list[int], list[int]] | None = None
    #: ``key_valid`` is left padding: each row's tokens are its last ``prompt_lens[row]`` (the session's prompt
    #: forward, checked once per prompt); False where it may be any mask (a decode-time compression's context)
    left_padded: bool = False

    @property
    def n(self) -> int:
        return self.queries.shape[-2]

    def row_tokens(self, row: int) -> slice | torch.Tensor:
        """Row ``row``'s tokens along the entry axis: every entry (no padding), a slice of its last tokens (left
        padding: host ints, so indexing with it reads nothing back), else its ``key_valid`` mask (indexing with a
        mask reads its count from the device)."""
        if self.key_valid is None:
            return slice(None)
        if self.left_padded:
            n = self.key_valid.shape[-1]
            return slice(n - self.host_ints()[0][row], n)
        return self.key_valid[row]

    def fits(self) -> bool:
        """Whether every row's prompt fits its budget (nothing to compress), decided on the host."""
        return all(x <= c for x, c in zip(*self.host_ints()))

    def host_ints(self) -> tuple[list[int], list[int]]:
        """``prompt_lens`` and ``capacity`` as Python ints, for decisions on the host: the session's copy, else one
        read of the device tensors."""
        if self.host is None:
            self.host = ([int(x) for x in self.prompt_lens.tolist()], [int(x) for x in self.capacity.tolist()])
        return self.host


@dataclass
class DecodeContext:
    """What a method sees for one layer after a decode step.

    query: ``(B, Hq, q, D)``; probs: ``(B, Hkv, g, q, entries)`` attention probabilities over the layer's entries
    (only when the method sets ``needs_decode_probs``; else None); capacity: as in PrefillContext; scaling: the
    model's softmax scale (None: ``D ** -0.5``).
    """

    layer_idx: int
    num_layers: int
    num_kv_heads: int
    query: torch.Tensor
    probs: torch.Tensor | None
    capacity: torch.Tensor
    scaling: float | None = None
    rope_inv_freq: torch.Tensor | None = None
    #: entries the step attended per (row, head), set by a method's ``attend`` when they are not the layer's own
    #: entries (OmniKV's context bank); None: the engine counts them
    attended: int | None = None
