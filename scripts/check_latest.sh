#!/usr/bin/env bash
# The newest release of every dependency, beyond pyproject's upper bounds, against the tests that guard what kvbench
# reads from transformers and torch (pytest -m compat: engine, method contract, end-to-end compression on SmolLM2).
# CI already resolves the newest releases *within* the declared ranges on every run; this script looks past them,
# so that a rename in the next transformers or torch is found the day it ships, before the bound is raised.
#   scripts/check_latest.sh [extra pytest args]
# Everything goes to a temporary directory (printed at the end). It honours the machine's pip configuration: where
# pip is capped (a constraints file), the cap applies; PIP_CONSTRAINT= (empty) lifts a cap set through PIP_CONSTRAINT,
# PIP_CONFIG_FILE=/dev/null one set in pip's configuration file (not PIP_CONSTRAINT=: 2026-11-27, torch<=2.14.1 from
# /etc/xdg/pip/pip.conf still applied). torch 2.14.1 was the newest tested this way (pytest -m compat); 2.15.0 with
# the whole suite, after the cap was lifted (see pyproject).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d -t kvbench-latest-XXXX)"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
export KVBENCH_CACHE_DIR="$work/cache" KVBENCH_RESULTS_DIR="$work/results"

# the dependency names of pyproject.toml, without their version ranges
names=$(python3 - "$repo/pyproject.toml" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
print(" ".join(re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in re.findall(r'"([^"]+)"', block)))
EOF
)
pip install -q --upgrade $names "pytest>=8"
pip install -q --no-deps -e "$repo"
python -c "import torch, transformers; print(f'newest: torch {torch.__version__}, transformers {transformers.__version__}')"
pip check || true  # beyond the declared bounds pip reports kvbench's own requirements as unmet: expected here
cd "$repo"
python -m pytest -q -p no:cacheprovider -m compat "$@"
echo "everything is in $work"
