"""RULER common words extraction (``scripts/data/synthetic/common_words_extraction.py``): the ``cwe`` task.

A numbered list ``"1. w 2. w ..."`` repeats ``num_cw`` common words ``freq_cw`` times and every other word
``freq_ucw`` times, shuffled; the answer is the common words (string_match_all). One solved example (40 words,
10x / 3x) precedes the list. Below a 4096-token target the example has 20 words at 3x / 1x and the list uses
6x / 1x. Words come from the wonderwords nouns + adjectives + verbs (sorted set, shuffled once with the seed); when
a list needs more words than that, RULER samples from its ``json/english_words.json`` instead (only reached near
128K tokens; kvbench then reads that file from ``task.data_dir``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import DataError
from kvbench.tasks.ruler.common import GENERATORS, Prompting, binary_search, fit_sample
from kvbench.tasks.ruler.resources import read_json, wonderwords_list

ENGLISH_WORDS_FILE = "english_words.json"  # RULER scripts/data/synthetic/json/english_words.json (a {key: word} map)
ESTIMATE_WORDS = 4096  # sys_word_pair_random sizes its search with a 4096-word probe


@dataclass
class CommonWordsGenerator:
    """``common_words_extraction`` (``synthetic.yaml``: freq_cw 30, freq_ucw 3, num_cw 10; one example)."""

    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    num_fewshot: int = 1
    wonderwords: str = "3.0.1"
    data_dir: str | None = None

    def _words(self, seed: int) -> list[str]:
        pool = [w for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
                for w in wonderwords_list(name, self.wonderwords)]
        words = sorted(set(pool))
        random.Random(seed).shuffle(words)
        return words

    def _english_words(self) -> list[str]:
        path = Path(self.data_dir).expanduser() / ENGLISH_WORDS_FILE if self.data_dir else None
        if path is None or not path.is_file():
            raise DataError(
                f"task 'ruler': cwe at this length needs more words than wonderwords has; put RULER's "
                f"{ENGLISH_WORDS_FILE} (scripts/data/synthetic/json/) into task.data_dir (now {self.data_dir!r})"
            )
        return list(read_json(path, "ruler").values())

    def _example(self, words: list[str], num_words: int, common: int, uncommon: int, rng: random.Random,
                 seed: int) -> tuple[str, list[str]]:
        """``get_example``: the numbered list and its common words."""
        pool = words if num_words <= len(words) else self._english_words()
        chosen = rng.sample(pool, num_words)
        common_words, rest = chosen[: self.num_cw], chosen[self.num_cw :]
        listed = common_words * int(common) + rest * int(uncommon)
        random.Random(seed).shuffle(listed)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed)), common_words

    def draw(self, num_words: int, template: str, words: list[str], max_seq_length: int, rng: random.Random,
             seed: int) -> tuple[str, list[str]]:
        """``generate_input_output``: the solved example(s), a newline, then the task."""
        shots = []
        for _ in range(self.num_fewshot):
            if max_seq_length < 4096:
                shots.append(self._example(words, 20, 3, 1, rng, seed))
            else:
                shots.append(self._example(words, 40, 10, 3, rng, seed))
        if max_seq_length < 4096:
            context, answer = self._example(words, num_words, 6, 1, rng, seed)
        else:
            context, answer = self._example(words, num_words, self.freq_cw, self.freq_ucw, rng, seed)
        solved = [template.format(num_cw=self.num_cw, context=shot, query="") + " "
                  + " ".join(f"{i + 1}. {word}" for i, word in enumerate(shot_answer)) for shot, shot_answer in shots]
        return "\n".join(solved) + "\n" + template.format(num_cw=self.num_cw, context=context, query=""), answer

    def samples(self, num_samples: int, max_seq_length: int, prompting: Prompting, seed: int,
                task: str = "cwe") -> list[dict[str, Any]]:
        """``sys_word_pair_random``: size the list by binary search, then draw the samples."""
        rng = random.Random(seed)
        words = self._words(seed)
        template = prompting.full_template("common_words_extraction")
        new_tokens = GENERATORS["common_words_extraction"]["tokens_to_generate"]
        incremental = 10

        def total(size: int) -> int:
            text, _ = self.draw(size, template, words, max_seq_length, rng, seed)
            return prompting.count_prompt(text, "common_words_extraction") + new_tokens

        per_word = (total(ESTIMATE_WORDS) - new_tokens) / ESTIMATE_WORDS
        upper = max(int(max_seq_length // per_word) * 2, incremental * 2)
        size = binary_search(total, incremental, upper, max_seq_length) or incremental

        def draw(units: int) -> tuple[tuple[str, list[str], int], int]:
            text, answer = self.draw(units, template, words, max_seq_length, rng, seed)
            length = prompting.count_prompt(text, "common_words_extraction") + new_tokens
            return (text, answer, length), length

        rows = []
        for index in range(num_samples):
            text, answer, length = fit_sample(draw, size, incremental, max_seq_length, task)
            prompt, prefix = prompting.split(text, "common_words_extraction")
            rows.append({"index": index, "input": prompt, "outputs": answer, "length": length,
                         "answer_prefix": prefix})
        return rows


__all__ = ["CommonWordsGenerator"]
