#!/usr/bin/env bash
# Run the README's commands as a new user would: a fresh clone, a fresh venv, the install command, the default
# job (first N samples) and the test command. Everything goes to a temporary directory, printed at the end.
#   scripts/fresh_clone_check.sh [N_SAMPLES=3] [extra pytest args, e.g. -m "not slow"]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
n="${1:-3}"
shift || true
work="$(mktemp -d -t kvbench-fresh-XXXX)"
git clone -q "$repo" "$work/kvbench"
cd "$work/kvbench"
python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export KVBENCH_CACHE_DIR="$work/cache" KVBENCH_RESULTS_DIR="$work/results"

start=$(date +%s)
pip install -q -e ".[dev]"
echo "install: $(( $(date +%s) - start )) s"

start=$(date +%s)
python -m kvbench.run limit="$n"
echo "default job ($n samples, first run: fetch + convert SmolLM2): $(( $(date +%s) - start )) s"

start=$(date +%s)
python -m pytest -q -n 2 --dist worksteal "$@"
echo "tests: $(( $(date +%s) - start )) s"
echo "everything is in $work"
