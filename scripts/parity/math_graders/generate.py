"""Regenerate tests/fixtures/math/tricky_answers.jsonl: the verdicts of the reference graders on tricky answers.

For every case of ``cases.jsonl`` (a prediction, the dataset's reference answer, the verdict a careful human gives
and why the case is tricky) this records:

- ``math_verify``: math-verify's verdict, computed here by calling math-verify directly (``parse("$answer$",
  [LatexExtractionConfig()])`` for the reference, ``parse(prediction, [LatexExtractionConfig(boxed_match_priority=0),
  ExprExtractionConfig()])`` for the prediction, then ``verify``), not through kvbench, so that
  tests/test_task_math.py checks kvbench's wiring of it against an independent call;
- ``rkv``, ``kvpress_math500``, ``kvpress_aime25``: the R-KV / TriAttention grader and kvpress's two string matches,
  run unchanged from their repositories in a side environment (``reference_verdicts.py``).

Usage (from the repository root, kvbench's environment; the side environment and the reference checkouts as below):

    python scripts/parity/math_graders/generate.py \
        --side-python /work/side/rkv-eval-env/bin/python \
        --rkv-eval /work/side/rkv-eval-src/evaluation \
        --kvpress-benchmarks /work/side/kvpress-eval-src/evaluation/benchmarks

Side environment (python3.11 venv): ``sympy==1.12 antlr4-python3-runtime==4.11.1 regex word2number pandas`` and
``pip install --no-deps -e <R-KV>/evaluation/latex2sympy``. Checkouts: ``git archive d15c976 evaluation`` of
Zefan-Cai/R-KV, ``git archive 8bb29b9 evaluation/benchmarks/{math500,aime25}/calculate_metrics.py`` of NVIDIA/kvpress.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
OUT = ROOT / "tests" / "fixtures" / "math" / "tricky_answers.jsonl"
RKV_COMMIT = "d15c9767e67c2bd9807128fecc35223fa2484a69"
KVPRESS_COMMIT = "8bb29b9c3078452a86d692f29123fa6c793e2b05"


def math_verify_verdict(prediction: str, answer: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse(f"${answer}$", [LatexExtractionConfig()])
    predicted = parse(prediction, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()])
    return bool(gold and predicted and verify(gold, predicted))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side-python", required=True)
    parser.add_argument("--rkv-eval", required=True)
    parser.add_argument("--kvpress-benchmarks", required=True)
    args = parser.parse_args()

    cases_text = (HERE / "cases.jsonl").read_text(encoding="utf-8")
    cases = [json.loads(line) for line in cases_text.splitlines() if line.strip()]
    run = subprocess.run(
        [args.side_python, str(HERE / "reference_verdicts.py"), "--rkv-eval", args.rkv_eval,
         "--kvpress-benchmarks", args.kvpress_benchmarks],
        input=cases_text, capture_output=True, text=True, check=True, timeout=600,
    )
    side = {row["id"]: row for row in map(json.loads, filter(str.strip, run.stdout.splitlines()))}
    if set(side) != {c["id"] for c in cases}:
        raise SystemExit(f"the side run answered {sorted(side)}, not every case")
    side_versions = subprocess.run(
        [args.side_python, "-c", "import sympy, antlr4, sys; print(sympy.__version__, sys.version.split()[0])"],
        capture_output=True, text=True, check=True).stdout.split()

    rows = [{"_provenance": {
        "math_verify": metadata.version("math-verify"),
        "latex2sympy2_extended": metadata.version("latex2sympy2_extended"),
        "rkv": f"Zefan-Cai/R-KV {RKV_COMMIT} evaluation/parser.py run_execute + grader.py math_equal_process "
               f"(sympy {side_versions[0]}, python {side_versions[1]})",
        "kvpress": f"NVIDIA/kvpress {KVPRESS_COMMIT} evaluation/benchmarks/{{math500,aime25}}/calculate_metrics.py "
                   "score_aime",
        "generator": "scripts/parity/math_graders/generate.py",
    }}]
    for case in cases:
        verdicts = side[case["id"]]
        rows.append({
            **case,
            "math_verify": math_verify_verdict(case["prediction"], case["answer"]),
            "rkv": verdicts["rkv"],
            "rkv_extracted": verdicts["rkv_extracted"],
            "kvpress_math500": verdicts["kvpress_math500"],
            "kvpress_aime25": verdicts["kvpress_aime25"],
        })
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows) - 1} cases to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
