#!/usr/bin/env bash
# A whole GPU check in one command on a node without a package index (issue #37):
#
#   python -m kvbench.assets bundle DIR        # where there is network, from a kvbench checkout with its deps installed
#   scripts/gpu_session.sh DIR                 # on the node (copy DIR there; DIR/src/scripts/gpu_session.sh is this)
#   scripts/gpu_session.sh DIR --device cpu    # a rehearsal on a CPU: tiny-random model, 256-token prompt, bench=smoke
#
# Beside a checkout (a bundle of ~130 MB does not fit a transfer capped at 64 MiB, as this project's lent GPUs are):
#
#   python -m kvbench.assets bundle .kvbundle --session       # 7 MB: the wheels the session imports, the tokenizer
#   KVBENCH_GIT_SHA=<commit> scripts/gpu_session.sh .kvbundle --tar OUT.tgz   # on the node, in the copied checkout
#
# (the checkout, about 35 MB, and .kvbundle travel; a copy without .git names its commit through KVBENCH_GIT_SHA, which
# environment.txt and every targets.json record; --tar packs the results folder into one file at any exit).
#
# Steps (the install, then the others in KVBENCH_SESSION_STEPS' order, below), each under its own `timeout`, every
# result under one output folder ($KVBENCH_SESSION_OUT, default ./kvbench-session-<UTC time>; printed at the start
# and at the end):
#   1. install  python -m kvbench.bundle install DIR: refuses in one line when the node's torch or transformers is
#               outside pyproject's range; otherwise installs, into DIR/site only (pip --no-index --no-deps --target),
#               the bundled pure-Python wheels the node's python lacks (hydra-core, omegaconf, antlr4-python3-runtime
#               on the 2026-11 image). The node's packages are never changed: DIR/site is put on PYTHONPATH.
#   2. check    scripts/gpu_check.py: every registered method, CUDA vs CPU in fp32, then bf16 in a left-padded batch
#               (smollm2-135m-random, 1,024 tokens; RoCo's sequential prefill on 192) -> gpu_check.json
#   3. bench    python -m kvbench.bench bench=gpu_targets model=llama3-8b-random model.dtype=bfloat16 (issue #36's
#               decode targets) -> results/bench/llama3-8b-random/gpu_targets/<device>/ (cells resume if run again)
#   4. prefill  python -m kvbench.bench bench=gpu_prefill model=llama3-8b-random model.dtype=bfloat16 (issue #37's
#               prefill bounds, every method paired with FullKV at 4k, and where each prefill's time goes)
#               -> results/bench/llama3-8b-random/gpu_prefill/<device>/
# Budget on one H100/H200: 8 minutes in all (KVBENCH_SESSION_SECONDS=480), install at most 120 s; --device cpu: 15
# minutes, the check 480 s. KVBENCH_SESSION_STEPS picks and orders the steps after the install: check, prefill,
# bench (every grid of the decode bench) and bench:N (its grid N alone); default bench:0,prefill,bench,check, most
# valuable first: gpu_targets' grid 0 (FullKV and SnapKV at batch 1 beside both transformers peers and the floor:
# issue #36's headline targets), the prefill bench (#37's bounds), the decode bench's other grids (batch 16; H2O,
# TOVA, D2O, StreamingLLM), resuming from grid 0's stored cells, then the check (a CUDA check is committed from an
# earlier lease). Each step gets what is left of the total but what the steps after it keep (the prefill bench 150
# s, any other 60 s), at least 60 s; the check at most 200 s. Each whole-step compile of an 8B model takes on the
# order of a minute (60-112 s for 32 layers of a small model with inductor on this project's 2-core CPU), so a
# decode bench may well be cut: its timeout sends SIGTERM, and the bench judges and writes every cell it stored
# (targets.md / .json say which target cells were not measured, each row its cell_seconds and
# decode_first_run_seconds: what the compiles cost) before it exits; the same command again, or
# KVBENCH_SESSION_STEPS=bench, resumes from the stored cells. A step that times out is recorded as such; later
# steps still run. KVBENCH_BENCH_ARGS adds decode-bench overrides.
# Exit status: 0 when every step passed, 2 when the install refused, 1 otherwise. summary.txt lists each step.
#
# Rehearsed on a CPU, 2026-11-27 (2 shared cores, python 3.11), offline, in a fresh venv holding what the GPU image
# holds besides kvbench's pure-Python dependencies: torch (2.13.0+cpu here), transformers 5.17.0 with its
# dependencies (numpy, pyyaml, regex, safetensors, tokenizers, huggingface-hub, ...), pandas, scipy, psutil,
# accelerate, gguf; no hydra-core, omegaconf, antlr4, submitit, nltk, datasets, pyarrow, wandb:
#   python -m kvbench.assets bundle /tmp/kvbundle                       # 30 s (9 s with a warm pip cache), 130 MB
#   python3 -m venv /tmp/image && /tmp/image/bin/pip install torch==2.13.0+cpu transformers==5.17.0 numpy pandas \
#       scipy psutil pyyaml safetensors accelerate gguf
#   env -i HOME=/tmp/home PATH=/tmp/image/bin:/usr/bin:/bin PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 \
#       KVBENCH_SESSION_OUT=/tmp/session bash /tmp/kvbundle/src/scripts/gpu_session.sh /tmp/kvbundle --device cpu
# -> 137 s wall (install 3 s: 16 wheels, hydra-core / omegaconf / antlr4 among them, datasets left out for lack of
# pyarrow; check 71 s: 29/29 methods pass, AdaKV 1,021 kept entries; bench=smoke 58 s), every step passed.
# Again 2026-11-28 at 2044749 with the GPU image's own versions, torch 2.11.0 (+cu130, run on the CPU) and transformers
# 5.17.0, the same way: 110 s wall (install 3 s; check 40 s: 31/31 methods pass; bench=smoke 55 s; the prefill step
# 9 s), every step passed.
# Again 2026-11-28 at 72cfadb, as a lent GPU receives it: a session bundle (7.1 MiB) in a copy of the checkout's
# tracked and untracked files without .git (44 MB in all), a venv holding the 2026-11 image's packages (torch
# 2.13.0+cpu, transformers 5.17.0, numpy, pandas, scipy, psutil, pyyaml, safetensors, accelerate, pyarrow, tqdm,
# matplotlib; no gguf, hydra-core, omegaconf, antlr4), offline:
#   (git ls-files -co --exclude-standard; find .kvbundle -type f) | tar cf - -T - | tar xf - -C /tmp/devtree
#   cd /tmp/devtree && env -i HOME=/tmp/home PATH=/tmp/image/bin:/usr/bin:/bin PIP_NO_INDEX=1 KVBENCH_GIT_SHA=<commit> \
#       KVBENCH_SESSION_OUT=/tmp/s bash scripts/gpu_session.sh .kvbundle --device cpu --tar /tmp/out/session.tgz
# -> 76 s wall (install 1 s: hydra-core, omegaconf, antlr4; check 13 s; bench=smoke 51 s; prefill 9 s), every step
# passed, one 147 kB session.tgz, the commit in environment.txt and targets.json; no process imported gguf.
# And in a venv of torch 2.13.0+cpu, transformers 5.17.0, numpy, pandas and scipy alone (with what pip brings for them;
# no psutil, accelerate, matplotlib): 85 s, every step passed; the install took hydra-core, omegaconf and antlr4 and
# said that accelerate was left out for lack of psutil; no figures (no matplotlib).
# Again 2026-11-28 at 32c730a with the default order, the same way: 116 s (install 1 s, bench:0 65 s, prefill 13 s,
# bench 10 s: grid 0's cells resumed, check 21 s: 31/31 methods), every step passed, a 148 kB session.tgz. And cut:
# KVBENCH_SESSION_STEPS=bench KVBENCH_SESSION_SECONDS=60 KVBENCH_BENCH_ARGS='bench.repeats=300': SIGTERM at 60 s,
# "4 of 6 cells not measured", targets.md with the 2 stored cells judged and the others "not measured", 63 s in all.
# Again 2026-11-29 at aee49f0 (torch 2.13.0+cpu, transformers 5.17.0; the session bundle rebuilt, 7.1 MiB): 76 s
# (install 1 s, bench:0 38 s, prefill 8 s, bench 6 s, check 21 s: 31/31 methods), every step passed, a 147 kB
# session.tgz. (This CPU rehearsal's bench is bench=smoke, decoded host-driven: the captured cells' comparison with
# the host-driven path, decode_eager_equal_tokens, runs in gpu_targets on the GPU and in tests/test_bench.py.)
# Again 2026-11-29 at 464af7e (the session bundle rebuilt, 7.1 MiB; each step's header now states the seconds elapsed
# at its start): 54 s (install 1 s, bench:0 31 s, prefill 6 s, bench 6 s, check 8 s: 31/31 methods), every step
# passed, a 147 kB session.tgz.
# Again 2026-11-29 at 63d45c3 in a venv with the lent GPUs' own torch 2.11.0+cu130 and transformers 5.17.0 (on this
# CPU; numpy, pandas, scipy, psutil, pyyaml, safetensors, hf-xet, no matplotlib): 47 s (install 1 s, bench:0 28 s,
# prefill 5 s, bench 5 s, check 7 s: 31/31 methods), every step passed, no Hydra plugin import error (f354b07), a
# 12 kB session.tgz (no figures without matplotlib). The profiler's "gpuGetDeviceCount failed with code 35" on a CUDA
# build without a GPU is torch's, harmless.
# Again 2026-11-29 at ea90ed1 the same way (torch 2.11.0, transformers 5.17.0; gpu_check's bf16 phase now judges each
# padded row's teacher-forced gap to the row alone): 66 s (install 0 s, bench:0 38 s, prefill 7 s, bench 6 s, check
# 11 s: 31/31 methods, every gap_vs_alone 0.0), every step passed, a 144 kB session.tgz.
# On this project's lent GPU (the device tool's `run`, from the checkout's root; .kvbundle is ignored, so it is named
# in carry; $OUT/session.tgz comes back):
#   carry [".kvbundle"], timeout_s 600, command:
#   KVBENCH_GIT_SHA=<commit> KVBENCH_SESSION_SECONDS=550 KVBENCH_SESSION_OUT=/tmp/kvs bash scripts/gpu_session.sh \
#       .kvbundle --tar $OUT/session.tgz
# (550 s of session in a 600 s call: the install, the tarball and the 15 s of a killed step's grace fit the rest; the
# machine's start takes minutes of the 15, so this one call is the session's whole GPU time).
# then, here: tar xzf <files_at>/session.tgz -C /tmp/kvs && cp -r /tmp/kvs/results/bench/llama3-8b-random/gpu_targets \
#   /tmp/kvs/results/bench/llama3-8b-random/gpu_prefill results/bench/llama3-8b-random/ && cp /tmp/kvs/gpu_check.json \
#   results/bench/gpu_check/smollm2-135m-random.json   (cells.jsonl, targets.md/json and the figures of each bench)
set -uo pipefail

usage() { echo "usage: $0 BUNDLE_DIR [--device cuda|cpu] [--tar FILE.tgz]" >&2; exit 2; }
[ $# -ge 1 ] || usage
bundle="$(cd "$1" 2>/dev/null && pwd)" || { echo "error: no bundle directory $1" >&2; exit 2; }
shift
device=cuda
tarball=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="${2:-}"; shift 2 ;;
        --device=*) device="${1#--device=}"; shift ;;
        --tar) tarball="${2:-}"; [ -n "$tarball" ] || usage; shift 2 ;;
        --tar=*) tarball="${1#--tar=}"; shift ;;
        *) usage ;;
    esac
done
case "$device" in cuda|cpu) ;; *) echo "error: --device ${device:-(empty)}; valid: cuda, cpu" >&2; exit 2 ;; esac
steps="${KVBENCH_SESSION_STEPS:-bench:0,prefill,bench,check}"
for name in ${steps//,/ }; do
    case "$name" in check|bench|bench:[0-9]|prefill) ;; *)
        echo "error: KVBENCH_SESSION_STEPS names ${name}; valid: check, bench, bench:N (grid N alone), prefill (comma-separated, in order)" >&2
        exit 2 ;;
    esac
done
[ -n "${steps//,/}" ] || { echo "error: KVBENCH_SESSION_STEPS is empty; valid: check, bench, bench:N, prefill" >&2; exit 2; }
[ -f "$bundle/manifest.json" ] || { echo "error: $bundle has no manifest.json (make it: python -m kvbench.assets bundle DIR)" >&2; exit 2; }
# the kvbench source: the bundle's copy, or (a --session bundle has none) the checkout this script sits in
src="$bundle/src"
[ -d "$src/kvbench" ] || src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -d "$src/kvbench" ] && [ -d "$src/conf" ] || { echo "error: neither $bundle/src nor $src holds kvbench's source (kvbench/ and conf/)" >&2; exit 2; }
python="${PYTHON:-python3}"
out="${KVBENCH_SESSION_OUT:-$PWD/kvbench-session-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out/logs" || exit 2
out="$(cd "$out" && pwd)"
echo "kvbench session: results in $out"
if [ -n "$tarball" ]; then  # at every exit from here: the whole results folder as one file (a node that hands back
    tarball="$(cd "$(dirname "$tarball")" && pwd)/$(basename "$tarball")" || exit 2  # only a few files)
    pack() {
        tar czf "$tarball" -C "$out" . && echo "kvbench session: packed into $tarball ($(du -h "$tarball" | cut -f1))" \
            || echo "error: could not pack $out into $tarball" >&2
    }
    trap pack EXIT
fi

export PYTHONPATH="$bundle/site:$src${PYTHONPATH:+:$PYTHONPATH}"
export KVBENCH_CACHE_DIR="$bundle/cache" KVBENCH_RESULTS_DIR="$out/results"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PIP_NO_INDEX=1
# whole seconds since the session began, from one clock read at its start (bash 5's microsecond EPOCHREALTIME; bash's
# $SECONDS ticks on whole wall-clock seconds, so two reads 10 ms apart could differ by one)
now_us() { if [ -n "${EPOCHREALTIME:-}" ]; then local t=${EPOCHREALTIME/[.,]/}; echo $((10#$t)); else echo $((SECONDS * 1000000)); fi; }
start_us=$(now_us)
elapsed() { echo $((($(now_us) - start_us) / 1000000)); }
status=0
: > "$out/summary.txt"

if [ "$device" = cpu ]; then  # a rehearsal: the same steps on the tiny model; a shared 2-core CPU needs minutes
    check_args=(--device cpu --model tiny-random --length 256 --sequential-length 160)
    bench_args=(bench=smoke model=tiny-random)
    prefill_args=(bench=gpu_prefill model=tiny-random 'bench.grids.0.context_lengths=[256]' 'bench.grids.0.budgets=[64]'
                  'bench.grids.0.methods=[fullkv,snapkv,h2o,kvzip]' bench.targets.0.context_length=256
                  bench.targets.1.context_length=256 bench.targets.2.context_length=256)
    total="${KVBENCH_SESSION_SECONDS:-900}" check_seconds=480
else
    check_args=(--device "$device")
    bench_args=(bench=gpu_targets model=llama3-8b-random model.dtype=bfloat16)
    prefill_args=(bench=gpu_prefill model=llama3-8b-random model.dtype=bfloat16)
    total="${KVBENCH_SESSION_SECONDS:-480}" check_seconds=200
fi

# step NAME SECONDS CMD...: run under `timeout`, log to logs/NAME.log (and the terminal), record the outcome
step() {
    local name="$1" seconds="$2" t0 rc
    t0=$(elapsed)
    shift 2
    echo "== $name (timeout ${seconds}s, at ${t0}s): $*"
    timeout --kill-after=15 "$seconds" "$@" 2>&1 | tee "$out/logs/${name//:/-}.log"
    rc=${PIPESTATUS[0]}
    local verdict="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="timed out after ${seconds}s"; elif [ "$rc" -ne 0 ]; then verdict="failed (exit $rc)"; fi
    printf '%-8s %-28s %4ss  %s\n' "$name" "$verdict" "$(($(elapsed) - t0))" "$*" | tee -a "$out/summary.txt"
    return "$rc"
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    "$python" -c "import sys, torch, transformers; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}')" 2>&1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "bundle: $bundle ($("$python" -c "import json, sys; m = json.load(open(sys.argv[1])); print(m.get('profile', 'full'), m['kvbench']['git'])" "$bundle/manifest.json" 2>&1)); source: $src ($(git -C "$src" rev-parse HEAD 2>/dev/null || echo "${KVBENCH_GIT_SHA:-not a git checkout, KVBENCH_GIT_SHA unset}"))"
} > "$out/environment.txt"
cat "$out/environment.txt"

cd "$src" || exit 2
if ! step install 120 "$python" -m kvbench.bundle install "$bundle"; then
    echo "kvbench session: the install refused or failed (logs/install.log); nothing else ran. Results in $out"
    exit 2
fi
# what a step keeps for itself from the steps before it: the prefill bench's ~30 eager prefills need about 2
# minutes, a decode bench a minute at least (model load, a compile), the check a minute
reserve() { case "$1" in prefill) echo 150 ;; *) echo 60 ;; esac; }
# the steps after the install, in order (KVBENCH_SESSION_STEPS, default bench:0,prefill,bench,check): each gets what
# is left of the total but the reserves of the steps after it (at least 60 s); the check at most check_seconds. A
# bench stopped by its step's timeout (SIGTERM) still judges and writes every cell it stored; a later bench step
# resumes from them (bench:0 then bench: the headline grid first, then the other grids)
read -r -a later <<< "${steps//,/ }"
for name in "${later[@]}"; do
    later=("${later[@]:1}")
    kept=0
    for next in "${later[@]}"; do kept=$((kept + $(reserve "$next"))); done
    left=$((total - $(elapsed) - 20 - kept))
    [ "$left" -lt 60 ] && left=60
    case "$name" in
        check)
            [ "$left" -gt "$check_seconds" ] && left=$check_seconds
            step check "$left" "$python" scripts/gpu_check.py "${check_args[@]}" --out "$out/gpu_check.json" || status=1 ;;
        bench|bench:*)
            read -r -a extra_bench_args <<< "${KVBENCH_BENCH_ARGS:-}"  # e.g. KVBENCH_BENCH_ARGS='only_grids=[0]'
            [ "$name" = bench ] || extra_bench_args+=("only_grids=[${name#bench:}]")
            step "$name" "$left" "$python" -m kvbench.bench "${bench_args[@]}" "${extra_bench_args[@]}" || status=1 ;;
        prefill)
            step prefill "$left" "$python" -m kvbench.bench "${prefill_args[@]}" || status=1 ;;
    esac
done
echo "kvbench session: $(elapsed) s; $( [ $status -eq 0 ] && echo 'every step passed' || echo 'a step failed' ) (summary.txt); results in $out"
exit $status
