"""RULER frequent words extraction (``scripts/data/synthetic/freq_words_extraction.py``): the ``fwe`` task.

A coded text of random 6-letter words whose counts follow a zeta law: word ``k`` of the shuffled vocabulary appears
``int(num_words * k**-alpha / zeta(alpha))`` times; word 1 is replaced by ``'...'`` (noise), so the answer is
vocabulary words 2-4, the three most frequent real words (string_match_all). The vocabulary has
``(max_seq_length - tokens_to_generate) // 50`` words; the number of words is grown (then shrunk) in steps of
``max_len // 32`` until the prompt fills the budget.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.errors import ConfigError
from kvbench.tasks.ruler.common import GENERATORS, Prompting

CODED_WORDLEN = 6


def zeta(alpha: float) -> float:
    """Riemann zeta, as ``scipy.special.zeta`` (the official import)."""
    from scipy.special import zeta as scipy_zeta

    return float(scipy_zeta(alpha))


@dataclass
class FreqWordsGenerator:
    """``freq_words_extraction`` (``synthetic.yaml``: alpha 2.0; coded_wordlen 6, vocab_size -1 = automatic)."""

    alpha: float = 2.0
    coded_wordlen: int = CODED_WORDLEN
    vocab_size: int = -1

    def _vocab(self, size: int, rng: random.Random, seed: int) -> list[str]:
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen)) for _ in range(size)]
        while len(set(vocab)) < size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen)))
        vocab = sorted(set(vocab))
        random.Random(seed).shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise
        return vocab

    def _text(self, vocab: list[str], num_words: int, template: str, seed: int) -> tuple[str, list[str]]:
        ranks = np.arange(1, len(vocab) + 1)
        counts = num_words * (ranks**-self.alpha) / zeta(self.alpha)
        words = [w for w, n in zip(vocab, counts.astype(int)) for _ in range(n)]
        random.Random(seed).shuffle(words)
        return template.format(context=" ".join(words), query=""), vocab[1:4]

    def draw(self, max_len: int, vocab_size: int, template: str, prompting: Prompting, rng: random.Random,
             seed: int, num_words: int = -1) -> tuple[str, list[str], int]:
        """``generate_input_output``: a fresh vocabulary, then the most words whose prompt fits ``max_len``."""
        vocab = self._vocab(vocab_size, rng, seed)
        step = max_len // 32

        def count(text: str) -> int:
            return prompting.count_prompt(text, "freq_words_extraction")

        if num_words > 0:
            text, answer = self._text(vocab, num_words, template, seed)
            while count(text) > max_len:
                num_words -= step
                text, answer = self._text(vocab, num_words, template, seed)
        else:
            num_words = max_len // self.coded_wordlen
            text, answer = self._text(vocab, num_words, template, seed)
            while count(text) < max_len:
                num_words += step
                text, answer = self._text(vocab, num_words, template, seed)
            num_words -= step
        text, answer = self._text(vocab, num_words, template, seed)
        return text, answer, num_words

    def samples(self, num_samples: int, max_seq_length: int, prompting: Prompting, seed: int,
                task: str = "fwe") -> list[dict[str, Any]]:
        """``sys_kwext``: find the word count once, then draw each sample with a new vocabulary."""
        rng = random.Random(seed)
        template = prompting.full_template("freq_words_extraction")
        new_tokens = GENERATORS["freq_words_extraction"]["tokens_to_generate"]
        max_len = max_seq_length - new_tokens
        vocab_size = max_len // 50 if self.vocab_size == -1 else self.vocab_size
        if vocab_size < 4 or max_len // 32 < 1:
            raise ConfigError(f"task 'ruler': {task} needs a context length >= 250 tokens, got {max_seq_length}")
        _, _, num_words = self.draw(max_len, vocab_size, template, prompting, rng, seed)
        rows = []
        for index in range(num_samples):
            text, answer, _ = self.draw(max_len, vocab_size, template, prompting, rng, seed, num_words=num_words)
            length = prompting.count_prompt(text, "freq_words_extraction") + new_tokens
            prompt, prefix = prompting.split(text, "freq_words_extraction")
            rows.append({"index": index, "input": prompt, "outputs": answer, "length": length,
                         "answer_prefix": prefix})
        return rows


__all__ = ["FreqWordsGenerator", "zeta"]
