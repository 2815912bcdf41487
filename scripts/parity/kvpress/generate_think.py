"""Golden fixture from kvpress's ThinKPress: the key channels it keeps per (row, KV head) on seeded inputs.

Runs in the kvpress side environment (kvpress 0.5.5, its own transformers), never in kvbench's; kvpress is imported
from that environment, nothing of it is copied here.

    /work/venv-kvpress/bin/python scripts/parity/kvpress/generate_think.py

For each case of ``cases.py`` the generator calls ``ThinKPress(key_channel_compression_ratio, window_size).compress``
on the case's keys, with a stand-in attention module whose ``q_proj`` is the identity (the hidden states it is given
are the case's queries laid out ``(B, n, Hq * D)``) and RoPE the identity (cos 1, sin 0): kvpress recomputes the
window's queries itself and sees exactly the case's post-RoPE queries. The pruned channels are read back as the
channels kvpress set to 0 in every entry. A case is kept only when the float64 run keeps what the float32 run keeps
(no near-tie at the boundary); otherwise the next seed is used and the skipped seed written down.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402  (scripts/parity/kvpress/cases.py, shared with the tests)


def kvpress_kept(case: dict, dtype) -> list:
    import torch
    from kvpress import ThinKPress
    from torch import nn

    q, k = C.think_inputs(case)
    b, hq, hkv, d, n = case["batch"], case["q_heads"], case["kv_heads"], case["head_dim"], case["n"]
    queries = torch.from_numpy(q).to(dtype)
    keys = torch.from_numpy(k).to(dtype)

    class Attention(nn.Module):  # what ThinKPress reads of a Llama attention module
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"num_attention_heads": hq, "num_key_value_heads": hkv})()
            self.head_dim = d
            self.q_proj = nn.Identity()

    hidden = queries.transpose(1, 2).reshape(b, n, hq * d)
    cos, sin = torch.ones(b, n, d, dtype=dtype), torch.zeros(b, n, d, dtype=dtype)
    press = ThinKPress(key_channel_compression_ratio=case["ratio"], window_size=case["window"])
    kwargs = {"hidden_states": hidden, "position_embeddings": (cos, sin)}
    out, _ = press.compress(Attention(), hidden, keys.clone(), keys.clone(), None, kwargs)
    zero = (out == 0).all(dim=2)  # (B, H, D): pruned channels
    return [[[c for c in range(d) if not bool(zero[r, h, c])] for h in range(hkv)] for r in range(b)]


def main() -> None:
    from importlib.metadata import version

    import torch
    import transformers

    cases, skipped = [], []
    for index in range(len(C.THINK_SHAPES)):
        seed = 100 + index
        while True:
            case = C.think_case(index, seed)
            kept = kvpress_kept(case, torch.float32)
            if kept == kvpress_kept(case, torch.float64):
                break
            skipped.append(seed)
            seed += 1000
        case["kept"] = kept
        case["inputs_sha256"] = C.digest_arrays(*C.think_inputs(case))
        cases.append(case)
    fixture = {
        "reference": f"kvpress {version('kvpress')} ThinKPress.compress",
        "environment": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "generator": "scripts/parity/kvpress/generate_think.py",
        "skipped_seeds": skipped,
        "cases": cases,
    }
    path = REPO / "tests" / "fixtures" / "parity" / "kvpress_think.json"
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {len(cases)} cases, skipped seeds {skipped}")


if __name__ == "__main__":
    main()
