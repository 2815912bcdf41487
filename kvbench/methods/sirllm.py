"""SirLLM: start tokens + a recent window + key tokens of high token entropy, with a memory decay.

Yao, Li & Zhao, "SirLLM: Streaming Infinite Retentive LLM" (ACL 2024, arXiv:2405.12528), code Zoeyyao27/SirLLM
(``sir_llm/kv_cache.py`` ``evict_for_space_token_entropy``, ``sir_llm/eval_utils.py`` ``_cal_selfinfo``).
reference/methods.md B14; D2O (paper 000) Table 18.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.errors import ConfigError
from kvbench.methods.base import Method, check_choice, keep_top
from kvbench.methods.cache_ops import position_rank, top_k_mask

if TYPE_CHECKING:  # the engine imports transformers; validating a config must not
    from kvbench.engine.cache import KVLayer
    from kvbench.engine.logits import TokenLogits

ENTROPIES = ("paper", "official_code")


def split_capacity(capacity: torch.Tensor, start_size: int, recent_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(recent R, key tokens E) for capacities ``capacity``: ``R = round(recent_ratio (C - start_size))``,
    ``E = C - start_size - R``."""
    rest = (capacity - start_size).clamp(min=0)
    recent = torch.round(rest * recent_ratio).long()
    return recent, rest - recent


def keep_mask(entropy: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, capacity: torch.Tensor,
              start_size: int, recent_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What SirLLM keeps whatever its recency, ``(B, H, C)`` each: the valid entries that are among the first
    ``start_size`` by position or the top-E entropies (ties to the older token), and each entry's rank by position
    (``cache_ops.position_rank``); ``capacity`` broadcasts as ``(B, 1, 1)``. One rule for the host-driven step
    (``SirLLM.keep_scores``) and the captured one (``static_decode``), whose slots are not in position order."""
    order, rank = position_rank(positions, valid)
    _, top_e = split_capacity(capacity, start_size, recent_ratio)
    by_position = torch.gather(entropy.masked_fill(~valid, float("-inf")), -1, order)
    top = torch.zeros_like(valid).scatter_(-1, order, top_k_mask(by_position, top_e, stable=True))
    return valid & ((rank < start_size) | top), rank


def static_decode(slots, probs, policy) -> None:
    """``SirLLM.observe_logits`` of a decode step over a static layer's slots, run inside the step (after its
    attention, which saw the step's entry as the host-driven path's does): the step's entry (the newest position)
    gets its token's surprisal ``-log p`` under the previous prediction (``slots.token_logp``), each (row, head) above
    its capacity frees the entry ``SirLLM.keep_scores`` ranks lowest (not a start token, not among the top-E
    entropies, ties to the older token, the oldest of the rest), and every entropy decays."""
    from kvbench.engine.static import evict_one

    start_size, recent_ratio, decay_ratio = policy.params
    valid, positions = slots.valid, slots.positions
    entropy = slots.state["sirllm_entropy"]
    newest = positions.masked_fill(~valid, -1).amax(-1, keepdim=True)
    entropy.copy_(torch.where(valid & (positions == newest), -slots.token_logp.view(-1, 1, 1), entropy))
    keep, rank = keep_mask(entropy, positions, valid, slots.capacity, start_size, recent_ratio)
    key = torch.where(keep, float("inf"), rank.float()).masked_fill(~valid, float("inf"))
    evict_one(valid, key, slots.capacity)
    entropy.mul_(decay_ratio)


@dataclass
class SirLLM(Method):
    """Keep, per layer (the same tokens in every layer and head), the first ``start_size`` tokens, the
    ``E = C - start_size - R`` tokens with the highest token entropy, and the most recent tokens up to the budget C,
    with ``R = round(recent_ratio·(C - start_size))``. Token entropy is the token's surprisal under the model,
    ``H(x_i) = -log p(x_i | x_<i)``; after every round's eviction all kept entropies are multiplied by
    ``decay_ratio`` (older memories fade).

    Rounds in kvbench: SirLLM evicts before each dialogue round (a user turn and its answer, scored in one forward)
    and decays. kvbench has one turn: the prompt's forward is round 1 and every decode step is a round of one token.
    After each forward (``observe_logits``, before the next one) the new tokens get their entropies, the cache is cut
    back to C (start ∪ top-E entropy over all entries, official ``_top_n_indices``: ties to the older token ∪ the
    newest, official fill loop) and every kept entropy is multiplied by ``decay_ratio``. So the cache holds C entries
    between forwards (official: C − incoming before a round, C during it), and the top-E is taken after the round's
    tokens arrived (official: E − incoming before). The first token of a round that no earlier prediction scored (the
    prompt's first real token) gets the round's maximum, as the official code does.

    Defaults: ``start_size=4`` and ``decay_ratio=1.0`` (the official CLI; its README uses 0.7 for DailyDialog and 0.9
    for Rock-Paper-Scissors), ``recent_ratio=0.5`` (the official runs set recent_size=0 because a round's own tokens
    always stay; kvbench's decode rounds need a window: ``recent_ratio=0`` gives the official split). SirLLM also
    re-positions tokens inside the cache (StreamingLLM's pos-shift): ``position_mode=compact``.

    ``entropy="official_code"``: the official ``_cal_selfinfo`` gathers ``-log p`` of each token under the
    prediction made *at its own position* (the next-token distribution), then shifts by one (first = round max):
    ``H(x_i) = -log p_{i-1}(x_{i-1})``. ``paper`` (default) is the definition above.
    """

    name: ClassVar[str] = "sirllm"
    compression: ClassVar[str] = "prefill"
    needs_logits: ClassVar[bool] = True
    start_size: int = 4
    recent_ratio: float = 0.5
    decay_ratio: float = 1.0
    entropy: str = "paper"

    def __post_init__(self) -> None:
        check_choice(self.name, "entropy", self.entropy, ENTROPIES)
        if self.start_size < 0:
            raise ConfigError(f"method 'sirllm': start_size={self.start_size} must be >= 0")
        if not 0 <= self.recent_ratio <= 1:
            raise ConfigError(f"method 'sirllm': recent_ratio={self.recent_ratio} must be in [0, 1]")
        if not 0 < self.decay_ratio <= 1:
            raise ConfigError(f"method 'sirllm': decay_ratio={self.decay_ratio} must be in (0, 1]")

    def static_policy(self, capacity: int, layer_idx: int = 0):
        """The captured step (``static_decode``) for ``entropy=paper``: a decode token's surprisal comes from the
        previous step's prediction, which the captured step hands its next step (``StaticPolicy.token_logp``)."""
        if self.entropy != "paper":
            return None
        from kvbench.engine.static import StaticPolicy

        return StaticPolicy(evict=static_decode, state=("sirllm_entropy",), token_logp=True,
                            params=(self.start_size, self.recent_ratio, self.decay_ratio))

    def static_refusal(self) -> str:
        return ("entropy=official_code scores a decode token by the step's own prediction, which exists only after "
                "the model's last layer, where the captured step has already evicted")

    def min_budget_tokens(self) -> int:
        return self.start_size + 1

    def min_budget_reason(self) -> str:
        return f"start_size={self.start_size} start tokens + at least one more"

    def split(self, capacity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(recent R, key tokens E) per row for budgets ``capacity`` ``(B,)``."""
        return split_capacity(capacity, self.start_size, self.recent_ratio)

    def token_entropy(self, input_ids: torch.Tensor, logits: TokenLogits, valid: torch.Tensor) -> torch.Tensor:
        """Entropies ``(B, q)`` of the forward's tokens; ``valid`` ``(B, q)`` False at left padding (entropy 0)."""
        nan = torch.full_like(input_ids[:, :1], float("nan"), dtype=torch.float32)
        scored = torch.cat([torch.zeros_like(valid[:, :1]), valid[:, :-1]], dim=1)  # the previous token is real
        if self.entropy == "paper":  # position i - 1 predicts x_i
            ent = nan.expand_as(input_ids).clone()
            if input_ids.shape[1] > 1:
                ent[:, 1:] = -logits.gather(input_ids[:, 1:].contiguous())[:, : input_ids.shape[1] - 1]
            if logits.previous is not None:  # a decode step: the previous forward predicted this token
                ent[:, 0] = -torch.gather(logits.previous, -1, input_ids[:, :1]).squeeze(-1)
                scored[:, 0] = True
            pool = ent.masked_fill(~(scored & valid), float("-inf"))
        else:  # official _cal_selfinfo: -log p_i(x_i) at the token's own position, shifted by one
            same = -logits.gather(input_ids)
            ent = torch.cat([nan, same[:, :-1]], dim=1)
            pool = same.masked_fill(~valid, float("-inf"))
        round_max = pool.amax(1, keepdim=True)  # the official value of a round's first token
        ent = torch.where(scored, ent, round_max)
        return ent.masked_fill(~valid, 0.0)

    def keep_scores(self, layer: KVLayer, capacity: torch.Tensor) -> torch.Tensor:
        """+inf for start tokens and the top-E entropies, the recency rank for the others (the newest fill the rest),
        -inf for invalid entries: ``keep_top(layer, scores, capacity)`` then keeps exactly SirLLM's set."""
        valid = layer.valid if layer.valid is not None else torch.ones_like(layer.positions, dtype=torch.bool)
        keep, rank = keep_mask(layer.state["sirllm_entropy"], layer.positions, valid, capacity.view(-1, 1, 1),
                               self.start_size, self.recent_ratio)
        return torch.where(keep, float("inf"), rank.float()).masked_fill(~valid, float("-inf"))

    def observe_logits(self, layers: list[KVLayer], input_ids: torch.Tensor, logits: TokenLogits) -> None:
        q = input_ids.shape[1]
        whole = next((layer for layer in layers if layer.num_entries >= q), None)  # holds every token of the forward
        valid = (whole.valid[:, 0, -q:] if whole is not None and whole.valid is not None
                 else torch.ones_like(input_ids, dtype=torch.bool))
        ent = self.token_entropy(input_ids, logits, valid)
        for layer in layers:
            b, h, t = layer.positions.shape
            k = min(q, t)  # a sliding-window layer holds only the last tokens of a long forward
            state = layer.state.get("sirllm_entropy")
            if state is None or state.shape[-1] != t:
                state = torch.zeros(b, h, t, device=ent.device)
            state = state.clone()
            state[..., t - k :] = ent[:, q - k :].unsqueeze(1)
            layer.state["sirllm_entropy"] = state
            keep_top(layer, self.keep_scores(layer, layer.capacity), layer.capacity)
            layer.state["sirllm_entropy"] = layer.state["sirllm_entropy"] * self.decay_ratio
