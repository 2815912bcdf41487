"""RULER variable tracking (``scripts/data/synthetic/variable_tracking.py``): the ``vt`` task.

A chain ``VAR X0 = <5-digit value>``, ``VAR X1 = VAR X0 ``, ... (``num_hops`` hops, 5 random uppercase letters per
name) is scattered over noise lines; the question asks for every variable that ends up holding the value. A
one-shot example (3-letter names, value 12345, generated once at 500 tokens and re-randomised per sample) precedes
the task text. The answer is all ``num_hops + 1`` names (string_match_all).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbench.tasks.ruler.common import GENERATORS, Prompting, binary_search, fit_sample
from kvbench.tasks.ruler.niah import NOISE

ICL_MAX_SEQ_LENGTH = 500  # main(): the example is sized for 500 tokens
ICL_VALUE = "12345"


@dataclass
class VariableTrackingGenerator:
    """``variable_tracking`` with the noise haystack (``synthetic.yaml``: num_chains 1, num_hops 4)."""

    num_chains: int = 1
    num_hops: int = 4
    type_haystack: str = "noise"

    def _chains(self, rng: random.Random, np_rng: np.random.RandomState, icl: bool) -> tuple[list, list]:
        letters = 3 if icl else 5
        hops = min(10, self.num_hops) if icl else self.num_hops
        count = (hops + 1) * self.num_chains
        names = ["".join(rng.choices(string.ascii_uppercase, k=letters)).upper() for _ in range(count)]
        while len(set(names)) < count:
            names.append("".join(rng.choices(string.ascii_uppercase, k=letters)).upper())
        variables, chains = [], []
        for start in range(0, len(names), hops + 1):
            chain_vars = names[start : start + hops + 1]
            variables.append(chain_vars)
            value = ICL_VALUE if icl else str(np_rng.randint(10000, 99999))
            chain = [f"VAR {chain_vars[0]} = {value}"]
            chain += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(hops)]
            chains.append(chain)
        return variables, chains

    def draw(self, num_noises: int, template: str, rng: random.Random, np_rng: np.random.RandomState,
             icl: bool) -> tuple[str, list[str]]:
        """``generate_input_output`` with the noise haystack."""
        if self.type_haystack != "noise":
            raise ValueError(f"vt: only the official noise haystack is implemented, got {self.type_haystack!r}")
        variables, chains = self._chains(rng, np_rng, icl)
        value = chains[0][0].split("=")[-1].strip()
        lines = [NOISE] * num_noises
        for chain in chains:
            positions = sorted(rng.sample(range(len(lines)), len(chain)))
            for offset, (position, element) in enumerate(zip(positions, chain)):
                lines.insert(position + offset, element)
        context = "\n".join(lines).replace(". \n", ".\n")
        return template.format(context=context, query=value, num_v=self.num_hops + 1), variables[0]

    def _randomize_icl(self, example: str, rng: random.Random, np_rng: np.random.RandomState) -> str:
        """``randomize_icl``: new letters for the example's variable names and a new value for 12345."""
        for name in example.strip().split()[-self.num_hops - 1 :]:
            example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))).upper())
        return example.replace(ICL_VALUE, str(np_rng.randint(10000, 99999)))

    def _run(self, num_samples: int, max_seq_length: int, real_max: int, prompting: Prompting, template: str,
             rng: random.Random, np_rng: np.random.RandomState, icl_example: dict | None, task: str) -> list[dict]:
        """``sys_vartrack_w_noise_random`` (add_fewshot=True): first for the example (icl_example None), then
        for the samples."""
        icl = icl_example is None
        new_tokens = GENERATORS["variable_tracking"]["tokens_to_generate"] if not icl else 0
        if icl:
            incremental = 5
            count = prompting.count
        else:
            incremental = 5 if real_max < 4096 else 10
            count = lambda text: prompting.count_prompt(text, "variable_tracking")  # noqa: E731
        example, example_tokens = "", 0
        if not icl:
            example = icl_example["input"] + " " + " ".join(icl_example["outputs"]) + "\n"
            example_tokens = prompting.count(example)

        def total(size: int) -> int:
            text, _ = self.draw(size, template, rng, np_rng, icl)
            return count(text) + example_tokens + new_tokens

        per_unit = (total(incremental) - example_tokens - new_tokens) / incremental
        upper = max(int((max_seq_length / per_unit) * 3), incremental * 2)
        size = binary_search(total, incremental, upper, max_seq_length) or incremental
        head = GENERATORS["variable_tracking"]["template"][:20]

        def draw(units: int) -> tuple[tuple[str, list[str], int], int]:
            text, answer = self.draw(units, template, rng, np_rng, icl)
            if not icl:  # the example goes between the model template and the task text
                cutoff = text.index(head)
                text = text[:cutoff] + self._randomize_icl(example, rng, np_rng) + "\n" + text[cutoff:]
            length = count(text) + new_tokens
            return (text, answer, length), length

        rows = []
        for index in range(num_samples):
            text, answer, length = fit_sample(draw, size, incremental, max_seq_length, task)
            rows.append({"index": index, "input": text, "outputs": answer, "length": length})
        return rows

    def samples(self, num_samples: int, max_seq_length: int, prompting: Prompting, seed: int,
                task: str = "vt") -> list[dict[str, Any]]:
        rng, np_rng = random.Random(seed), np.random.RandomState(seed)
        bare = GENERATORS["variable_tracking"]["template"] + GENERATORS["variable_tracking"]["answer_prefix"]
        example = self._run(1, ICL_MAX_SEQ_LENGTH, max_seq_length, prompting, bare, rng, np_rng, None, task)[0]
        rows = self._run(num_samples, max_seq_length, max_seq_length, prompting,
                         prompting.full_template("variable_tracking"), rng, np_rng, example, task)
        for row in rows:
            row["input"], row["answer_prefix"] = prompting.split(row["input"], "variable_tracking")
        return rows


__all__ = ["VariableTrackingGenerator"]
