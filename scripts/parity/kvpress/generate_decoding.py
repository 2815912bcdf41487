"""Golden fixture from kvpress's DecodingPress: the entries a layer keeps at every compression during decode.

Runs in the kvpress side environment (kvpress 0.5.5, transformers 5.2.0), never in kvbench's; kvpress is imported from
that environment, nothing of it is copied here.

    /work/side/kvpress-env/bin/python scripts/parity/kvpress/generate_decoding.py

For each case of ``cases.py`` (``DECODING_SHAPES``) and each press of ``DECODING_PRESSES`` the generator fills one
cache layer with the case's prompt keys/values (no prefill compression), then runs the case's decode steps: each step
appends the step's key/value to the layer, as the model's attention does, and calls
``DecodingPress(base_press, compression_interval, target_size, hidden_states_buffer_size).forward_hook`` with the
step's query as the hidden states, through a stand-in attention module whose ``q_proj`` is the identity and RoPE the
identity (cos 1, sin 0): kvpress's scorers see exactly the case's queries. After every step at which the press
compressed (its step count back at 0) the kept positions per KV head are read back from the values' channel 0 (the
generator writes each entry's position there). A case is kept only when the float64 run keeps what the float32 run
keeps (no near-tie at a boundary); otherwise the next seed is used and the skipped seed written down.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402  (scripts/parity/kvpress/cases.py, shared with the tests)


def make_press(name: str):
    from kvpress import KeyDiffPress, KnormPress, SnapKVPress, TOVAPress

    if name == "knorm":
        return KnormPress()
    if name == "keydiff":
        return KeyDiffPress()
    if name == "tova":
        return TOVAPress()
    if name == "snapkv":
        window, kernel = C.DECODING_SNAPKV
        return SnapKVPress(window_size=window, kernel_size=kernel)
    raise ValueError(name)


def kvpress_steps(case: dict, name: str, dtype) -> list[dict]:
    import torch
    from kvpress import DecodingPress
    from torch import nn
    from transformers import DynamicCache

    arrays = C.decoding_inputs(case)
    hq, hkv, d, n = case["q_heads"], case["kv_heads"], case["head_dim"], case["n"]
    keys = torch.from_numpy(arrays["keys"]).to(dtype)
    values = torch.from_numpy(arrays["values"]).to(dtype)
    queries = torch.from_numpy(arrays["queries"]).to(dtype)

    class Attention(nn.Module):  # what the scorers read of a Llama attention module
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"num_attention_heads": hq, "num_key_value_heads": hkv})()
            self.head_dim = d
            self.layer_idx = 0
            self.q_proj = nn.Identity()

    module = Attention()
    cache = DynamicCache()
    cache.update(keys[:, :, :n].clone(), values[:, :, :n].clone(), 0)
    press = DecodingPress(base_press=make_press(name), compression_interval=case["interval"],
                          target_size=case["target_size"], hidden_states_buffer_size=case["query_buffer"])
    out = []
    for t in range(case["steps"]):
        pos = n + t
        cache.update(keys[:, :, pos : pos + 1], values[:, :, pos : pos + 1], 0)
        hidden = queries[:, :, t : t + 1].transpose(1, 2).reshape(1, 1, hq * d)
        cos, sin = torch.ones(1, 1, d, dtype=dtype), torch.zeros(1, 1, d, dtype=dtype)
        kwargs = {"hidden_states": hidden, "past_key_values": cache, "cache_position": torch.tensor([pos]),
                  "position_embeddings": (cos, sin), "position_ids": torch.tensor([[pos]])}
        press.forward_hook(module, [], kwargs, (None, None))
        if press.layer_step_counts[0] == 0:  # it compressed at this step
            held = cache.layers[0].values[0, :, :, 0]  # (Hkv, entries): positions, in kvpress's stored order
            out.append({"step": t + 1, "kept": [sorted(int(p) for p in held[h].tolist()) for h in range(hkv)],
                        "order": [[int(p) for p in held[h].tolist()] for h in range(hkv)]})
    return out


def main() -> None:
    from importlib.metadata import version

    import torch
    import transformers

    cases, skipped = [], []
    for index in range(len(C.DECODING_SHAPES)):
        for name in C.DECODING_PRESSES:
            if not C.decoding_applies(C.decoding_case(index, 0), name):
                continue  # kvpress's SnapKVPress asserts more queries than its window (kvbench refuses it at plan)
            seed = 300 + 10 * index
            while True:
                case = C.decoding_case(index, seed)
                steps = kvpress_steps(case, name, torch.float32)
                if [s["kept"] for s in steps] == [s["kept"] for s in kvpress_steps(case, name, torch.float64)]:
                    break
                skipped.append([name, seed])
                seed += 1000
            arrays = C.decoding_inputs(case)
            case.update({"press": name, "compressions": steps,
                         "inputs_sha256": C.digest_arrays(arrays["keys"], arrays["values"], arrays["queries"])})
            cases.append(case)
    window, kernel = C.DECODING_SNAPKV
    fixture = {
        "reference": f"kvpress {version('kvpress')} DecodingPress.forward_hook around KnormPress, KeyDiffPress, "
                     f"TOVAPress, SnapKVPress(window_size={window}, kernel_size={kernel})",
        "environment": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "generator": "scripts/parity/kvpress/generate_decoding.py",
        "skipped_seeds": skipped,
        "cases": cases,
    }
    path = REPO / "tests" / "fixtures" / "parity" / "kvpress_decoding.json"
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {len(cases)} cases, skipped seeds {skipped}")


if __name__ == "__main__":
    main()
