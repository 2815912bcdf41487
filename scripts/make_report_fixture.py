"""Regenerate ``tests/fixtures/results/``: a small real result store for the report's tests and notebook.

    KVBENCH_CACHE_DIR=... python scripts/make_report_fixture.py [--out tests/fixtures/results]

Runs tiny-random jobs (the random 4-layer test model: the scores are meaningless, the files are real): the needle
task on a 2-length x 3-depth grid for FullKV and the layer-adaptive and uniform methods at two budgets, LongBench
from ``tests/fixtures/longbench`` (three datasets) and OmniKV's layer-similarity JSON. The machine-specific paths in
each ``config.yaml``'s ``resolved`` section are replaced by ``<root>`` / ``<results>`` (they are not part of the
hashed key). Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDLE = ["task=needle", "task.context_lengths=[400,600]", "task.n_depths=3", "task.max_new_tokens=4"]
LONGBENCH = ["task=longbench", f"task.data_dir={ROOT / 'tests' / 'fixtures' / 'longbench'}",
             "task.datasets=[hotpotqa,trec,lcc]"]
JOBS = [
    ["method=fullkv", *NEEDLE],
    *[[f"method={m}", f"budget={b}", *NEEDLE] for m in ("snapkv", "h2o", "dynamickv") for b in (64, 128)],
    ["method=pyramidkv", "budget=64", *NEEDLE],
    *[["method=d2o", f"budget={b}", *NEEDLE] for b in (0.2, 0.5)],
    ["method=kvmerger", "budget=0.5", *NEEDLE],
    ["method=fullkv", *LONGBENCH],
    ["method=snapkv", "budget=64", *LONGBENCH],
    ["method=dynamickv", "budget=64", *LONGBENCH],
]


def sanitize(results: Path) -> None:
    """Replace this machine's paths in the resolved configs (not hashed) so the fixture does not depend on it."""
    for config in results.glob("runs/*/*/*/*/*/config.yaml"):
        text = config.read_text()
        text = text.replace(str(results), "<results>").replace(str(ROOT), "<root>")
        config.write_text(text)
    for lock in results.glob("runs/*/*/*/*/*/.lock"):
        lock.unlink()


def main(argv: list[str] | None = None) -> None:
    from hydra import compose, initialize_config_dir

    from kvbench.analysis.layer_similarity import measure
    from kvbench.config import CONF_DIR
    from kvbench.jobs import run_job
    from kvbench.models import load_model, spec_from_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "results")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        for job in JOBS:
            cfg = compose("config", overrides=["model=tiny-random", "print_table=false",
                                               f"paths.results_dir={out}", *job])
            run_job(cfg)
            print(" ".join(job[:2]), flush=True)
        cfg = compose("config", overrides=["model=tiny-random"])
    from omegaconf import OmegaConf

    loaded = load_model(spec_from_config(OmegaConf.to_container(cfg.model, resolve=True)))
    data = measure(loaded.model, loaded.tokenizer, "tiny-random", top_k=32, samples=2, tokens=256, q=4)
    (out / "analysis").mkdir(parents=True, exist_ok=True)
    (out / "analysis" / "omnikv_similarity_tiny-random.json").write_text(json.dumps(data, indent=1) + "\n")
    shutil.rmtree(out / "logs", ignore_errors=True)
    sanitize(out)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
