"""Stand-in modules the parity generators put into an official model (``scripts/parity/<method>/generate.py``): a
projection that returns seeded rows, a block that returns zeros, an LM head of zeros, a rotary embedding of cos 1 /
sin 0 (post-RoPE inputs stay as they are), the margin retry of the cases, and the fixture's fields and writer.
Plain torch, no transformers import at module level: every side environment (transformers 4.36 to 4.51) imports it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


class Inject(nn.Module):
    """A projection returning the next rows of a seeded ``(T, heads * D)`` tensor, one forward after the other
    (``weight``: an empty tensor of the rows' dtype, for code that reads ``q_proj.weight.dtype``)."""

    def __init__(self, rows: torch.Tensor):
        super().__init__()
        self.rows, self.at = rows, 0
        self.weight = torch.empty(0, dtype=rows.dtype)

    def forward(self, hidden):
        q = hidden.shape[1]
        out = self.rows[self.at : self.at + q].unsqueeze(0)
        self.at += q
        return out


class Zero(nn.Module):
    """An MLP, norm or output projection whose output never matters (every layer's q/k/v is injected)."""

    def forward(self, hidden, *args, **kwargs):
        return torch.zeros_like(hidden)


class ZeroHead(nn.Module):
    """An LM head of zeros over ``vocab`` tokens."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, hidden):
        return torch.zeros(*hidden.shape[:-1], self.vocab)


class IdentityRope(nn.Module):
    """``rotary_emb(x, position_ids)`` of transformers 4.38 and later: cos 1 and sin 0, ``(B, q, D)``."""

    def __init__(self, d: int):
        super().__init__()
        self.d = d

    def forward(self, x, position_ids):
        shape = (*position_ids.shape, self.d)
        return torch.ones(shape, dtype=x.dtype), torch.zeros(shape, dtype=x.dtype)


def write_fixture(path: str | Path, fixture: dict) -> None:
    """The fixture as one line of compact JSON, and what was written."""
    path = Path(path)
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {len(fixture['cases'])} cases, {path.stat().st_size} bytes")


def run_with_margin(run_case, cases: list[tuple], fits) -> tuple[list[dict], list[int]]:
    """Each case through the official code (``run_case(case)``); a case whose output does not clear the fixture's
    margin (``fits(out)`` false: a decision too close to a tie to be pinned across float orders) is run again with
    its seed + 1000 until one does. Returns the outputs and the seeds skipped."""
    outs, skipped = [], []
    for case in cases:
        out = run_case(case)
        while not fits(out):
            skipped.append(case[1])
            case = (case[0], case[1] + 1000, *case[2:])
            out = run_case(case)
        outs.append(out)
    return outs, skipped


def golden_fixture(what: str, official: dict, tolerance: dict, skipped: list[int], cases: list[dict],
                   **described) -> dict:
    """A golden fixture's fields in their order: ``what``, ``official`` (repository, commit, date, files), what else
    the generator describes (``settings``, ``stubbed``), the side environment's versions, the tolerance, the skipped
    seeds and the cases."""
    import platform

    import numpy as np
    import transformers

    environment = {"python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "numpy": np.__version__}
    return {"what": what, "official": official, **described, "environment": environment, "tolerance": tolerance,
            "skipped_seeds": skipped, "cases": cases}


def generator_args(doc: str, official: str, out: Path):
    """``--official`` (the checkout of the authors' code, ``official`` says which) and ``--out`` (default ``out``)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--official", required=True, help=f"checkout of {official}")
    parser.add_argument("--out", default=str(out))
    return parser.parse_args()


def tiny_llama_config(hq: int, hkv: int, d: int, layers: int, vocab: int = 8, max_positions: int = 1024):
    """The generators' tiny eager Llama: every layer's q/k/v injected, MLP 4 wide (replaced by :class:`Zero`)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hq * d, intermediate_size=4, num_hidden_layers=layers,
                       num_attention_heads=hq, num_key_value_heads=hkv, max_position_embeddings=max_positions,
                       attn_implementation="eager")


def tiny_llama(cfg):
    """The model of :func:`tiny_llama_config`'s config, weights from seed 0, in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()
