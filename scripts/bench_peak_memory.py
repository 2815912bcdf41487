"""Prefill peak memory of one method in a fresh process (issue #7: the cpu_targets 8k peaks were taken this way).

    for m in fullkv snapkv pyramidkv dynamickv streamingllm h2o d2o kvmerger cam; do
        python scripts/bench_peak_memory.py $m; done

A fresh process per method keeps one cell's freed heap from hiding the next cell's peak (measure.PeakMemory also
trims the heap before its block). SmolLM2, 8192 tokens, budget 128; prints one JSON line.
"""
import json
import sys

from omegaconf import OmegaConf

from kvbench.bench.measure import measure_cell
from kvbench.bench.run import method_config
from kvbench.budget import Budget
from kvbench.config import CONF_DIR, register_resolvers
from kvbench.methods import build_method
from kvbench.models import load_model

register_resolvers()
name = sys.argv[1]
loaded = load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"))
b = Budget.parse(None if name == "fullkv" else 128)
r = measure_cell(loaded, build_method(method_config(name, None), b), b, 8192, 1, ["memory"])
print(json.dumps({"method": name, "prefill_peak_bytes": r.prefill_peak_bytes}))
