"""Golden fixture from the authors' TriAttention code (WeianMao/triattention c3744ee), for
tests/test_parity_triattention_official.py.

Runs in a side environment (Python 3.11, torch 2.13.0 CPU, transformers 4.57.1; ``OMP_NUM_THREADS=1``), never in
kvbench's: see scripts/parity/README.md. ``triattention/methods/triattention.py`` and ``pruning_utils.py`` (with
``triattention/common/stats_utils.py``) are imported from the checkout given on the command line and run unchanged:
``apply_triattention_patch`` wraps a stand-in model whose ``forward`` returns a legacy ``(key, value)`` cache tuple
holding the seeded post-RoPE keys of ``inputs.py`` (the prompt at the first call, then one position per call, at the
``position_ids`` the patch passes), so the code's own ``triattention_forward`` runs the trigger, the scoring, the
per-head selection and the per-head position bookkeeping. The stand-in's config (``config.json`` in a temporary
directory, what ``AutoConfig`` reads) is a Llama config of the case's shape with the default RoPE (theta 10000).

Recorded per case, at every compression (a forward after which the cache is shorter): the decode step, the tokens
seen (``absolute_position``), each KV head's kept positions in the code's stored order (``cache_positions_per_head``,
or ``cache_positions`` when the code kept one set), checked against the cache's rows, and every layer's scores
``(sampled heads, decode entries)`` as ``_compute_layer_head_scores`` returned them (before normalisation and noise).

    OMP_NUM_THREADS=1 python scripts/parity/triattention/generate.py --official /path/to/triattention \
        --out tests/fixtures/parity/triattention_official.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inputs import CASES, THETA, case_keys, case_stats, fields  # noqa: E402

COMMIT = "c3744ee6"
FILES = ["triattention/methods/triattention.py", "triattention/methods/pruning_utils.py",
         "triattention/common/stats_utils.py"]


class StandIn(torch.nn.Module):
    """A model whose forward returns the seeded keys as a legacy cache (values: the same tensors)."""

    def __init__(self, keys: list[torch.Tensor]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.keys = keys

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        n = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(n).unsqueeze(0)
        pos = position_ids[0]
        cache = []
        for layer, keys in enumerate(self.keys):
            new = keys[:, pos].unsqueeze(0)
            if past_key_values:
                k = torch.cat([past_key_values[layer][0], new], dim=2)
            else:
                k = new
            cache.append((k, k.clone()))
        return CausalLMOutputWithPast(logits=torch.zeros(1, n, 2), past_key_values=tuple(cache))


def run_case(official: Path, name: str, case: dict) -> dict:
    from triattention.methods import triattention as tri

    keys = case_keys(case)
    args = fields(case)
    with tempfile.TemporaryDirectory() as tmp:
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": case["layers"],
                  "num_attention_heads": case["heads"], "num_key_value_heads": case["kv_heads"],
                  "hidden_size": case["heads"] * case["head_dim"], "head_dim": case["head_dim"],
                  "intermediate_size": 8, "vocab_size": 2, "rope_theta": THETA, "max_position_embeddings": 4096}
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        stats_path = Path(tmp) / "stats.pt"
        torch.save(case_stats(case), stats_path)
        model = StandIn(keys)
        tri.apply_triattention_patch(
            model, stats_path=stats_path, model_path=Path(tmp), kv_budget=case["budget"],
            offset_max_length=args["offset_max_length"], score_aggregation=args["score_aggregation"],
            pruning_seed=args["pruning_seed"], metadata_expectations={}, normalize_scores=args["normalize_scores"],
            count_prompt_tokens=args["count_prompt_tokens"],
            allow_prefill_compression=args["allow_prefill_compression"], divide_length=args["divide_length"],
            use_slack_trigger=args["use_slack_trigger"], per_head_pruning=True, disable_trig=args["disable_trig"],
        )
        comp = model._triattention_compressor
        captured: list[torch.Tensor] = []
        original = comp._compute_layer_head_scores

        def record(*a, **kw):
            out = original(*a, **kw)
            if out is not None:
                captured.append(out.detach().clone())
            return out

        comp._compute_layer_head_scores = record
        out = model(input_ids=torch.zeros(1, case["prompt"], dtype=torch.long), past_key_values=None)
        cache = out.past_key_values
        compressions = []
        for step in range(case["steps"]):
            before = cache[0][0].shape[2] + 1
            captured.clear()
            out = model(input_ids=torch.zeros(1, 1, dtype=torch.long), past_key_values=cache)
            cache = out.past_key_values
            if cache[0][0].shape[2] >= before:
                assert not captured
                continue
            if comp.cache_positions_per_head is not None:
                kept = [list(map(int, p)) for p in comp.cache_positions_per_head]
            else:
                kept = [list(map(int, comp.cache_positions)) for _ in range(case["kv_heads"])]
            for layer, (k, _) in enumerate(cache):  # the cache holds exactly those positions, in that order
                for h in range(case["kv_heads"]):
                    assert torch.equal(k[0, h], keys[layer][h, kept[h]]), (name, step, layer, h)
            compressions.append({
                "step": step, "seen": int(comp.absolute_position), "entries": int(cache[0][0].shape[2]),
                "kept": kept, "scores": [[[float(f"{v:.7g}") for v in row] for row in s.tolist()] for s in captured],
            })
    print(f"{name}: {len(compressions)} compressions at steps {[c['step'] for c in compressions]}", file=sys.stderr)
    return {"case": case, "fields": args, "compressions": compressions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--official", type=Path, required=True, help="a checkout of WeianMao/triattention")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(args.official))
    import transformers

    if torch.__version__.split("+")[0] != "2.13.0" or transformers.__version__ != "4.57.1":
        sys.exit(f"the fixture is pinned to torch 2.13.0 and transformers 4.57.1 (got {torch.__version__}, "
                 f"{transformers.__version__}): see scripts/parity/README.md")

    torch.manual_seed(0)
    cases = {name: run_case(args.official, name, case) for name, case in CASES.items()}
    payload = {
        "official": {"repo": "WeianMao/triattention", "commit": COMMIT, "files": FILES,
                     "entry": "apply_triattention_patch(per_head_pruning=True) -> triattention_forward"},
        "env": {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__},
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
