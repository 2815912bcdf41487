"""RULER needle in a haystack (``scripts/data/synthetic/niah.py``): the eight ``niah_*`` tasks.

Needles ``"One of the special magic {type_needle_v} for {key} is: {value}."`` hide in one of three haystacks:
``noise`` (one repeated sentence per line), ``essay`` (Paul Graham essays, needles at sentence boundaries drawn from
40 depths) or ``needle`` (every line another random needle). Keys/values are ``words`` (adjective-noun over the
wonderwords lists), 7-digit ``numbers`` or ``uuids`` (version-4 UUIDs from ``getrandbits(128)``). ``num_needle_q``
keys are asked; the answers are all values of the asked keys (string_match_all).
"""

from __future__ import annotations

import bisect
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from kvbench.tasks.ruler.common import GENERATORS, Prompting, binary_search, fit_sample
from kvbench.tasks.ruler.resources import essay_words, sent_tokenize, wonderwords_list

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
# niah.py singularises the template when one value is asked, with plain str.replace in this order.
SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


class AdjectiveNounWords(Sequence):
    """``sorted(set(f"{adj}-{noun}" for adj in adjectives for noun in nouns))`` (6,171,620 strings for wonderwords
    3.0.1) without building it: RULER only indexes it (``random.choice``), and building it costs ~30 s and 1 GB.

    For one adjective the strings ``adj-noun`` sort like the nouns. Blocks of two adjectives can only interleave (or
    share strings) when one key ``adj + "-"`` is a prefix of the other ("high-" and "high-pitched-"); otherwise
    every string of one block sorts before every string of the other. So the list is a sequence of blocks ordered
    by key: single adjectives (sorted nouns) and, for each prefix-related group, the group's strings sorted and
    de-duplicated explicitly.
    """

    def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]):
        self.nouns = sorted(set(nouns))
        keys = sorted(adj + "-" for adj in set(adjectives))
        self.blocks: list[str | list[str]] = []  # an adjective key (prefix for every noun) or an explicit group
        start = 0
        while start < len(keys):
            end = start + 1
            while end < len(keys) and keys[end].startswith(keys[start]):
                end += 1
            if end - start == 1:
                self.blocks.append(keys[start])
            else:
                self.blocks.append(sorted({key + noun for key in keys[start:end] for noun in self.nouns}))
            start = end
        self.offsets = [0]
        for block in self.blocks:
            self.offsets.append(self.offsets[-1] + (len(self.nouns) if isinstance(block, str) else len(block)))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        block_index = bisect.bisect_right(self.offsets, index) - 1
        block, offset = self.blocks[block_index], index - self.offsets[block_index]
        return block + self.nouns[offset] if isinstance(block, str) else block[offset]


@cache
def key_words(wonderwords: str) -> AdjectiveNounWords:
    """niah.py's ``words`` for the given wonderwords version."""
    return AdjectiveNounWords(wonderwords_list("adjectivelist.txt", wonderwords),
                              wonderwords_list("nounlist.txt", wonderwords))


@dataclass
class NiahGenerator:
    """One ``niah`` configuration of ``synthetic.yaml`` (fields = its args, niah.py's defaults)."""

    type_haystack: str = "essay"
    type_needle_k: str = "words"
    type_needle_v: str = "numbers"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1
    wonderwords: str = "3.0.1"

    def __post_init__(self) -> None:
        self.num_needle_k = max(self.num_needle_k, self.num_needle_q)  # niah.py, after parsing args

    def _random(self, kind: str, rng: random.Random) -> str:
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return rng.choice(key_words(self.wonderwords))
        if kind == "uuids":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        raise ValueError(f"unknown needle type {kind!r}")

    def _context(self, num_haystack: int, needles: list[str], rng: random.Random) -> str:
        if self.type_haystack == "essay":
            words = essay_words()
            if num_haystack <= len(words):
                text = " ".join(words[:num_haystack])
            else:  # repeat the haystack as often as needed
                repeats = (num_haystack + len(words) - 1) // len(words)
                text = " ".join((list(words) * repeats)[:num_haystack])
            sentences = sent_tokenize(text.strip())
            positions = [0, *sorted(int(len(sentences) * (depth / 100)) for depth in rng.sample(DEPTHS, len(needles))),
                         len(sentences)]
            pieces = []
            for i in range(1, len(positions)):
                pieces.append(" ".join(sentences[positions[i - 1] : positions[i]]))
                if i - 1 < len(needles):
                    pieces.append(needles[i - 1])
            return " ".join(pieces)
        if self.type_haystack == "noise":
            lines = [NOISE] * num_haystack
        elif self.type_haystack == "needle":
            lines = [NEEDLE.format(type_needle_v=self.type_needle_v, key=self._random(self.type_needle_k, rng),
                                   value=self._random(self.type_needle_v, rng)) for _ in range(num_haystack)]
        else:
            raise ValueError(f"unknown haystack {self.type_haystack!r}")
        for index, needle in zip(sorted(rng.sample(range(num_haystack), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        return "\n".join(lines)

    def draw(self, num_haystack: int, template: str, rng: random.Random, seed: int) -> tuple[str, list[str]]:
        """``generate_input_output``: the formatted prompt (template included) and the answers."""
        keys, values, needles = [], [], []
        for _ in range(self.num_needle_k):
            keys.append(self._random(self.type_needle_k, rng))
            value = []
            for _ in range(self.num_needle_v):
                value.append(self._random(self.type_needle_v, rng))
                needles.append(NEEDLE.format(type_needle_v=self.type_needle_v, key=keys[-1], value=value[-1]))
            values.append(value)
        random.Random(seed).shuffle(needles)
        context = self._context(num_haystack, needles, rng)
        asked = rng.sample(range(self.num_needle_k), self.num_needle_q)
        queries = [keys[i] for i in asked]
        answers = [a for i in asked for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        type_needle_v = self.type_needle_v
        if self.num_needle_q * self.num_needle_v == 1:
            for old, new in SINGULAR:
                template = template.replace(old, new)
            type_needle_v = type_needle_v[:-1]
        return template.format(type_needle_v=type_needle_v, context=context, query=query), answers

    def samples(self, num_samples: int, max_seq_length: int, prompting: Prompting, seed: int,
                task: str = "niah") -> list[dict[str, Any]]:
        """``generate_samples``: size the haystack, then draw ``num_samples`` prompts (RULER's jsonl rows)."""
        rng = random.Random(seed)
        template = prompting.full_template("niah")
        new_tokens = GENERATORS["niah"]["tokens_to_generate"]
        incremental = 500 if self.type_haystack == "essay" else 25
        if self.type_haystack != "essay" and max_seq_length < 4096:
            incremental = 5

        def total(size: int) -> int:
            text, _ = self.draw(size, template, rng, seed)
            return prompting.count_prompt(text, "niah") + new_tokens

        per_unit = (total(incremental) - new_tokens) / incremental
        upper = max(int((max_seq_length / per_unit) * 3), incremental * 2)
        size = binary_search(total, incremental, upper, max_seq_length) or incremental

        def draw(units: int) -> tuple[tuple[str, list[str], int], int]:
            text, answers = self.draw(units, template, rng, seed)
            length = prompting.count_prompt(text, "niah") + new_tokens
            return (text, answers, length), length

        rows = []
        for index in range(num_samples):
            text, answers, length = fit_sample(draw, size, incremental, max_seq_length, task)
            prompt, prefix = prompting.split(text, "niah")
            rows.append({"index": index, "input": prompt, "outputs": answers, "length": length,
                         "answer_prefix": prefix})
        return rows


__all__ = ["AdjectiveNounWords", "DEPTHS", "NEEDLE", "NOISE", "NiahGenerator", "key_words"]
