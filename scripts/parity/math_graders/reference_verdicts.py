"""Verdicts of the reference evaluations' own graders on the tricky-answer cases (run in a side environment).

Runs the graders unchanged, imported from their repositories' files (never copied here):

- R-KV (Zefan-Cai/R-KV d15c976, ``evaluation/``): ``parser.run_execute(None, output, "cot", data_name)`` (the answer
  extraction ``eval_math.py`` applies; ``extract_answer`` + ``strip_string``), ``parser.parse_ground_truth`` and
  ``grader.math_equal_process`` (what ``evaluate.py`` maps over the predictions). TriAttention's
  ``triattention/evaluation/`` is the same code (only import paths and the ``math500`` data name differ).
- kvpress (NVIDIA/kvpress 8bb29b9, ``evaluation/benchmarks/{math500,aime25}/calculate_metrics.py``): ``score_aime``
  of each (math500: the first ``boxed{``, aime25: the last, both cut at the first ``}``, then string equality).

Usage (side environment with sympy 1.12, antlr4-python3-runtime 4.11.1, regex, word2number and R-KV's bundled
latex2sympy installed; see generate.py):

    python reference_verdicts.py --rkv-eval <R-KV>/evaluation --kvpress-benchmarks <kvpress>/evaluation/benchmarks \
        < cases.jsonl > verdicts.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rkv-eval", required=True, help="R-KV's evaluation/ folder")
    parser.add_argument("--kvpress-benchmarks", required=True, help="kvpress's evaluation/benchmarks/ folder")
    args = parser.parse_args()

    sys.path.insert(0, args.rkv_eval)  # their modules import each other by bare name (utils, trajectory, grader)
    rkv_parser = load(f"{args.rkv_eval}/parser.py", "parser")
    rkv_grader = load(f"{args.rkv_eval}/grader.py", "grader")
    kvpress_math500 = load(f"{args.kvpress_benchmarks}/math500/calculate_metrics.py", "kvpress_math500")
    kvpress_aime25 = load(f"{args.kvpress_benchmarks}/aime25/calculate_metrics.py", "kvpress_aime25")

    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        data_name = "aime24" if case.get("dataset") == "aime24" else "math"
        example = {"answer": case["answer"], "solution": "\\boxed{" + case["answer"] + "}"}
        _, gt = rkv_parser.parse_ground_truth(example, data_name)
        prediction, _ = rkv_parser.run_execute(None, case["prediction"], "cot", data_name)
        rkv = bool(rkv_grader.math_equal_process((0, prediction, gt)))
        print(json.dumps({
            "id": case["id"],
            "rkv_data_name": data_name,
            "rkv_extracted": prediction,
            "rkv_reference": gt,
            "rkv": rkv,
            "kvpress_math500": bool(kvpress_math500.score_aime(case["prediction"], case["answer"])),
            "kvpress_aime25": bool(kvpress_aime25.score_aime(case["prediction"], case["answer"])),
        }, ensure_ascii=False))


if __name__ == "__main__":
    main()
