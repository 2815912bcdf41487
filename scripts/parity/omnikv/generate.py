"""Golden fixtures from the official OmniKV code: the prompt tokens its filter layer selects at each decode step.

Runs in a side environment with the official pins (transformers 4.41.2), next to a checkout of antgroup/OmniKV at
5c33cb5, never inside kvbench's environment; the official code is imported from the checkout, never copied here.

    python scripts/parity/omnikv/generate.py --official /work/side/omnikv-src

For every selector (``last``, ``softmax_before_last``, ``uniform``, ``exp``) and every case of ``cases.py`` it builds
the official decoder layer ``modeling.omnikv.OmniKVMulLayer`` (layer 0 is the filter layer, ``do_select_layers="0"``)
with the official cache ``OmniKVMultiStageCache`` as ``OmniKVMulLM.forward`` configures it, and runs one prefill
forward and ``steps`` decode forwards through the layer's own ``forward``: the window bookkeeping
(``hidden_state_window``, ``decode_step``, ``consider_len``, the reduced top-k and the appended window rows) and
``select_tokens_by_attn_universal`` are the official code's. Our generator only

* makes the layer's input the queries: ``input_layernorm`` is replaced by the identity and ``q_proj`` is the identity
  matrix, so the hidden states it feeds are the case's pre-RoPE queries (the official code rotates them itself);
* sets the cached prompt keys to the case's keys after the prefill forward (the layer computed its own from
  ``k_proj``; selection reads the cache);
* records the index set the layer hands to ``OmniKVMultiStageCache.set_idx_on_gpu`` at each decode step (the
  recorder then calls the official method; with one layer it moves nothing).

A case is kept only when the float64 run selects what the float32 run selects (no near-tie at the top-k boundary,
so an exact comparison is meaningful); otherwise the next seed is tried and the skipped seed is written down.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402  (scripts/parity/omnikv/cases.py, shared with the tests)

PINNED_COMMIT = "5c33cb5"
PINNED_TRANSFORMERS = "4.41.2"


def load_official(path: Path):
    """Import the official modules from the checkout (they log to ./debug_logs and read ``git rev-parse``)."""
    head = subprocess.check_output(["git", "-C", str(path), "rev-parse", "HEAD"], text=True).strip()
    os.chdir(path)
    (path / "debug_logs").mkdir(exist_ok=True)
    sys.path.insert(0, str(path))
    import modeling.omnikv as omnikv
    import modeling.spec_cache as spec_cache
    import modeling.token_model as token_model

    return head, omnikv, spec_cache, token_model


def official_selections(mods, selector: str, case: dict, arrays: dict, dtype) -> list[list[int]]:
    """The index set the official filter layer selects at each decode step of ``case``."""
    import torch
    from transformers.cache_utils import DynamicCache

    _, omnikv, spec_cache, token_model = mods
    hq, hkv, d, n = case["heads"], case["kv_heads"], case["head_dim"], case["n"]
    config = token_model.TokenConfig(
        vocab_size=16, hidden_size=hq * d, intermediate_size=8, num_hidden_layers=1, num_attention_heads=hq,
        num_key_value_heads=hkv, max_position_embeddings=4096, rope_theta=case["rope_theta"],
    )
    config._attn_implementation = "eager"
    # configs/example.json's keys, with this case's selector, window and absolute token budget
    config.set_config(do_select_layers="0", selector_cls=selector, window_size=case["window"],
                      num_of_selected_tokens=case["k"], dense_more=True, cache_cls="multi", num_wait_load_layers=1,
                      real_offload=False, rope_scaling_=None, sparse_in_prefill=False, max_len_can_hold=32_000,
                      attn_seg_sz=8000)
    torch.manual_seed(0)
    layer = omnikv.OmniKVMulLayer(config, 0)
    layer.input_layernorm = torch.nn.Identity()
    with torch.no_grad():
        layer.self_attn.q_proj.weight.copy_(torch.eye(hq * d))
    layer = layer.to(dtype).eval()
    # as OmniKVMulLM.forward builds it: full_attn_layers = range(0, first filter) + filters + [num_layers]
    cache = spec_cache.OmniKVMultiStageCache.from_dynamic_cache(
        DynamicCache(), full_attn_layers=[0, 1], num_hidden_layers=1, num_wait_load_layers=1, real_offload=False
    )
    recorded: list[list[int]] = []
    official_set = cache.set_idx_on_gpu

    def record(idx, sel_layer_idx):
        recorded.append([int(i) for i in idx.view(-1).tolist()])
        return official_set(idx, sel_layer_idx)

    cache.set_idx_on_gpu = record
    queries = torch.from_numpy(arrays["queries"]).to(dtype)  # (Hq, n + steps, D) pre-RoPE
    hidden = queries.permute(1, 0, 2).reshape(1, -1, hq * d)
    with torch.no_grad():
        cache.stage = "prefill"
        positions = torch.arange(n).view(1, -1)
        layer(hidden[:, :n], position_ids=positions, past_key_value=cache, use_cache=True,
              cache_position=positions[0])
        cache.key_cache[0] = torch.from_numpy(arrays["keys"]).to(dtype)[None]
        for step in range(case["steps"]):
            pos = torch.tensor([[n + step]])
            cache.stage = "decoding"
            layer(hidden[:, n + step : n + step + 1], position_ids=pos, past_key_value=cache, use_cache=True,
                  cache_position=pos[0])
            cache.key_cache[0][:, :, -1] = torch.from_numpy(arrays["new_keys"][:, step]).to(dtype)
    if len(recorded) != case["steps"]:
        raise RuntimeError(f"expected {case['steps']} selections, the official layer made {len(recorded)}")
    return recorded


def generate(mods, selector: str) -> dict:
    import torch

    out, skipped = [], []
    for index in range(C.CASES_PER_SELECTOR):
        seed = C.first_seed(selector, index)
        while True:
            case = C.case_spec(selector, index, seed)
            arrays = C.inputs(case)
            single = official_selections(mods, selector, case, arrays, torch.float32)
            double = official_selections(mods, selector, case, arrays, torch.float64)
            if single == double:
                break
            skipped.append(seed)
            seed += 1
        out.append({**case, "checksum": C.checksum(arrays), "selections": single})
    return {"cases": out, "skipped_seeds": skipped}


def write(path: Path, header: dict, cases: list[dict]) -> None:
    """Header fields indented, one case per line (small diffs when regenerated)."""
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()] + ['  "cases": [']
    lines += [f"    {json.dumps(c)}{',' if i < len(cases) - 1 else ''}" for i, c in enumerate(cases)]
    path.write_text("\n".join(lines + ["  ]", "}"]) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", required=True, type=Path, help="checkout of antgroup/OmniKV at 5c33cb5")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "parity")
    parser.add_argument("--selectors", nargs="*", default=list(C.SELECTORS), choices=C.SELECTORS)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    import numpy
    import torch
    import transformers

    if transformers.__version__ != PINNED_TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__}: the official code pins {PINNED_TRANSFORMERS}")
    mods = load_official(args.official.resolve())
    if not mods[0].startswith(PINNED_COMMIT):
        sys.exit(f"{args.official} is at {mods[0]}, not the pinned {PINNED_COMMIT}")
    out.mkdir(parents=True, exist_ok=True)
    for selector in args.selectors:
        result = generate(mods, selector)
        header = {
            "about": "prompt tokens the official OmniKV filter layer selects at each decode step (see "
                     "scripts/parity/README.md); inputs: scripts/parity/omnikv/cases.py inputs(case)",
            "official": {"repository": "antgroup/OmniKV", "commit": mods[0], "transformers": transformers.__version__,
                         "torch": torch.__version__, "numpy": numpy.__version__},
            "generator": "scripts/parity/omnikv/generate.py",
            "selector": selector,
            "skipped_seeds": result["skipped_seeds"],
        }
        path = out / f"omnikv_{selector}.json"
        write(path, header, result["cases"])
        steps = sum(len(c["selections"]) for c in result["cases"])
        print(f"{path}: {len(result['cases'])} cases, {steps} decode steps, skipped seeds {result['skipped_seeds']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
