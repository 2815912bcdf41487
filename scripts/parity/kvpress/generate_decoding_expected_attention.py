"""Golden fixture from kvpress's DecodingPress around ExpectedAttentionPress: the entries a layer keeps at every
compression during decode.

Runs in the kvpress side environment (kvpress 0.5.5, transformers 5.2.0), never in kvbench's; kvpress is imported from
that environment, nothing of it is copied here.

    OMP_NUM_THREADS=1 /work/side/kvpress-env/bin/python scripts/parity/kvpress/generate_decoding_expected_attention.py

As ``generate_decoding.py`` (the same cases of ``cases.py``, ``DECODING_SHAPES``, where the buffer holds more queries
than the press's sinks), with two differences Expected Attention needs: the stand-in attention module has a real
rotary embedding (transformers' ``LlamaRotaryEmbedding``, base ``DECODING_EXPECTED_ATTENTION["rope_theta"]``), which
``ExpectedAttentionPress.apply_avg_rope`` calls (its ``q_proj`` stays the identity, so the hidden states handed over are
the case's queries before RoPE: kvbench's side rotates them to their positions first), and the values carry their
position in channel 0 times ``position_scale`` (read back divided by it), since this press reads value norms. A case is
kept only when the float64 run keeps what the float32 run keeps; otherwise the next seed is used and the skipped seed
written down.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402  (scripts/parity/kvpress/cases.py, shared with the tests)

EA = C.DECODING_EXPECTED_ATTENTION


def kvpress_steps(case: dict, dtype) -> list[dict]:
    import torch
    from kvpress import DecodingPress, ExpectedAttentionPress
    from torch import nn
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    arrays = C.decoding_inputs(case)
    hq, hkv, d, n = case["q_heads"], case["kv_heads"], case["head_dim"], case["n"]
    keys = torch.from_numpy(arrays["keys"]).to(dtype)
    values = torch.from_numpy(arrays["values"]).to(dtype)
    queries = torch.from_numpy(arrays["queries"]).to(dtype)
    config = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                         rope_theta=EA["rope_theta"], max_position_embeddings=4096)

    class Attention(nn.Module):  # what ExpectedAttentionPress reads of a Llama attention module
        def __init__(self):
            super().__init__()
            self.config = config
            self.head_dim = d
            self.layer_idx = 0
            self.q_proj = nn.Identity()
            self.rotary_emb = LlamaRotaryEmbedding(config).to(dtype)

    module = Attention()
    cache = DynamicCache()
    cache.update(keys[:, :, :n].clone(), values[:, :, :n].clone(), 0)
    press = DecodingPress(base_press=ExpectedAttentionPress(n_sink=EA["n_sink"]),
                          compression_interval=case["interval"], target_size=case["target_size"],
                          hidden_states_buffer_size=case["query_buffer"])
    scale = case["position_scale"]
    out = []
    for t in range(case["steps"]):
        pos = n + t
        cache.update(keys[:, :, pos : pos + 1], values[:, :, pos : pos + 1], 0)
        hidden = queries[:, :, t : t + 1].transpose(1, 2).reshape(1, 1, hq * d)
        cos, sin = module.rotary_emb(hidden, torch.tensor([[pos]]))
        kwargs = {"hidden_states": hidden, "past_key_values": cache, "cache_position": torch.tensor([pos]),
                  "position_embeddings": (cos, sin), "position_ids": torch.tensor([[pos]])}
        press.forward_hook(module, [], kwargs, (None, None))
        if press.layer_step_counts[0] == 0:  # it compressed at this step
            held = cache.layers[0].values[0, :, :, 0].double() / scale  # (Hkv, entries): positions
            out.append({"step": t + 1, "kept": [sorted(round(float(p)) for p in held[h].tolist())
                                                for h in range(hkv)]})
    return out


def main() -> None:
    from importlib.metadata import version

    import torch
    import transformers

    cases, skipped = [], []
    for index in range(len(C.DECODING_SHAPES)):
        if not C.decoding_applies(C.decoding_case(index, 0), "expected_attention"):
            continue
        seed = 700 + 10 * index
        while True:
            case = {**C.decoding_case(index, seed), "position_scale": EA["position_scale"]}
            steps = kvpress_steps(case, torch.float32)
            if [s["kept"] for s in steps] == [s["kept"] for s in kvpress_steps(case, torch.float64)]:
                break
            skipped.append(seed)
            seed += 1000
        arrays = C.decoding_inputs(case)
        case.update({"press": "expected_attention", "compressions": steps,
                     "inputs_sha256": C.digest_arrays(arrays["keys"], arrays["values"], arrays["queries"])})
        cases.append(case)
    fixture = {
        "reference": f"kvpress {version('kvpress')} DecodingPress.forward_hook around "
                     f"ExpectedAttentionPress(n_sink={EA['n_sink']}) (defaults otherwise), LlamaRotaryEmbedding "
                     f"base {EA['rope_theta']}",
        "environment": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "generator": "scripts/parity/kvpress/generate_decoding_expected_attention.py",
        "skipped_seeds": skipped,
        "cases": cases,
    }
    path = REPO / "tests" / "fixtures" / "parity" / "kvpress_decoding_expected_attention.json"
    path.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    print(f"wrote {path}: {len(cases)} cases, {[len(c['compressions']) for c in cases]} compressions, "
          f"skipped seeds {skipped}")


if __name__ == "__main__":
    main()
