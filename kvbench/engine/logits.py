"""The model's own predictions, for methods that score tokens by them (``Method.needs_logits``: SirLLM's token
entropy). Part of the method contract: it imports no session, so methods can name it without reaching the engine's
machinery."""

from __future__ import annotations

import torch


class TokenLogits:
    """The model's log-probabilities of chosen tokens at each position of one forward, for ``observe_logits``.

    hidden: ``(B, q, H)`` final hidden states of the forward; head: the model's output embedding (logits =
    ``head(hidden)``); previous: ``(B, V)`` log-softmax of the previous forward's last position, None after a prompt.
    The head is applied ``chunk`` positions at a time, so nothing ``(B, q, V)`` is held at once for long prompts
    (a forward of at most ``chunk`` tokens, a decode step, is computed once and reused).
    """

    def __init__(self, hidden: torch.Tensor, head, previous: torch.Tensor | None, chunk: int = 256):
        self.hidden, self.head, self.previous, self.chunk = hidden, head, previous, chunk
        self._short: torch.Tensor | None = None

    def _log_softmax(self, start: int) -> torch.Tensor:
        if self.hidden.shape[1] <= self.chunk and self._short is not None:
            return self._short
        out = torch.log_softmax(self.head(self.hidden[:, start : start + self.chunk]).float(), dim=-1)
        if self.hidden.shape[1] <= self.chunk:
            self._short = out
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """``log softmax(logits[:, i])[ids[:, i]]`` for the first q' <= q positions: ``ids`` ``(B, q')`` -> ``(B, q')``
        float32 (a shifted ``ids`` scores each position's next token)."""
        out = []
        for start in range(0, self.hidden.shape[1], self.chunk):
            logp = self._log_softmax(start)
            out.append(torch.gather(logp, -1, ids[:, start : start + self.chunk].unsqueeze(-1)).squeeze(-1))
        return torch.cat(out, dim=1)

    def last(self) -> torch.Tensor:
        """Log-softmax at the forward's last position ``(B, V)`` (the prediction of the next input token)."""
        if self.hidden.shape[1] <= self.chunk:
            return self._log_softmax(0)[:, -1]
        return torch.log_softmax(self.head(self.hidden[:, -1]).float(), dim=-1)
