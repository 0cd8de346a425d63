#!/usr/bin/env bash
# One prepared GPU check, sized for one short lease: about 5 minutes of commands (GPU_CHECK_DEADLINE, 300 s), so
# that with the machine's start it stays under 6 minutes and a rerun fits in a 15-minute lease.
#
#   bash benchmarks/gpu_check.sh [WORKDIR]     on the GPU machine (default WORKDIR: /tmp/speccompile-gpu-check)
#   bash benchmarks/gpu_check.sh --wheels DIR  beforehand, on a machine with PyPI: the wheels the GPU image lacks
#
# WORKDIR receives four files (so that a lent machine's $OUT brings them back): results.json (one JSON, every
# row: each step's status, every gpu_shapes.py row, the refcoder bench rows), table.txt (the printed tables),
# log.txt (every step's log) and rows.jsonl (the refcoder bench rows, for render_results.py --gpu-rows). The venv, the artifacts and the step logs live in GPU_CHECK_SCRATCH
# (/tmp/speccompile-gpu-check-scratch).
#
# The machine this project borrows has no network and a 64 MiB carry: nothing is downloaded, nothing resolved.
# It brings CUDA torch, numpy, tokenizers, safetensors, transformers (a newer one than the project's pins) and
# pytest; what it lacks (array-api-compat, the project's transformers / tokenizers pins) comes as wheels:
# `--wheels .whl` here, then carry .whl and run with GPU_CHECK_WHEELS=.whl (installed with --no-index --no-deps).
# ONNX Runtime's CUDA provider and TensorRT are not tried: onnxruntime-gpu (256 MB) and TensorRT's libraries
# cannot reach that machine, so that code (runtime/backends/onnx, runtime/backends/tensorrt) stays as it is,
# tested on CPU, not run on a GPU; the torch backend is the GPU path this check shows.
#
# Steps, each under a time cap (cut further by the deadline; a step that no longer fits is skipped and says so):
#   1 GPU gate: without an NVIDIA GPU it prints what it would do and stops, exit 0, before installing anything
#   2 a venv with --system-site-packages (the preinstalled CUDA torch reused), GPU_CHECK_WHEELS installed, the
#     project's runtime dependencies checked (what is missing or outside the pins is printed), then
#     pip install --no-deps --no-build-isolation -e .
#   3 pytest -m cuda (the test files that hold CUDA tests)                                            cap  50 s
#   4 benchmarks/gpu_shapes.py --shape 1b (random-weight Llama-3.2-1B, bfloat16: costs, oracle rounds
#     and, with GPU_CHECK_ACCEPTANCE or benchmarks/data/smollm2_acceptance.json, expected speedups)   cap  90 s
#   5 refcoder, float16 then float32: speccompile build --device cuda --backend torch (GPU_CHECK_METHOD,
#     auto; GPU_CHECK_BUILD_BUDGET, 30 s) and gpu_bench.py rows: plain vs the default plan, in turns  caps 50 + 30 s each
#   6 gpu_shapes.py --shape 8b (Llama-3.1-8B), only when 100 s or more are left                      cap 120 s
#   7 results.json and the tables (gpu_bench.py results)
# Other knobs: GPU_CHECK_PROMPTS (refcoder prompts, 6), GPU_CHECK_TOKENS (new tokens, 64); GPU_CHECK_REHEARSAL=1
# runs every step on the CPU instead (gpu_shapes.py --smoke, builds and benches on cpu): the script itself tried
# end to end before the one GPU run it gets.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ "${1:-}" = "--wheels" ]; then  # on a machine with PyPI: wheels for the GPU image (CPython 3.12, x86-64)
    DIR="${2:?usage: gpu_check.sh --wheels DIR}"
    mkdir -p "$DIR"
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
        "array-api-compat>=1.16,<2" "transformers==4.57.6" "tokenizers==0.22.2" "huggingface-hub==0.36.2"
fi

WORK="${1:-/tmp/speccompile-gpu-check}"
SCRATCH="${GPU_CHECK_SCRATCH:-/tmp/speccompile-gpu-check-scratch}"
VENV="$SCRATCH/venv"
LOG="$SCRATCH/log"
DEADLINE="${GPU_CHECK_DEADLINE:-300}"
METHOD="${GPU_CHECK_METHOD:-auto}"
BUILD_BUDGET="${GPU_CHECK_BUILD_BUDGET:-30}"
PROMPTS="${GPU_CHECK_PROMPTS:-6}"
NEW_TOKENS="${GPU_CHECK_TOKENS:-64}"
ACCEPTANCE="${GPU_CHECK_ACCEPTANCE:-$ROOT/benchmarks/data/smollm2_acceptance.json}"
REHEARSAL="${GPU_CHECK_REHEARSAL:-0}"
DEVICE=cuda; [ "$REHEARSAL" = 1 ] && DEVICE=cpu
SCALE=1; [ "$REHEARSAL" = 1 ] && SCALE=5  # a 2-core CPU builds and benches refcoder several times slower
step() { printf '[%4ss] %s\n' "$SECONDS" "$*"; }

step "1/7 GPU gate"
if [ "$REHEARSAL" = 1 ]; then
    echo "       GPU_CHECK_REHEARSAL=1: every step on the CPU (figures meaningless, paths real)"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    cat <<EOF
       no NVIDIA GPU here (nvidia-smi missing or sees none): nothing installed, built or measured. On a GPU
       machine this script would, within ${DEADLINE} s:
         2 make a venv in $VENV (--system-site-packages: the machine's CUDA torch), install GPU_CHECK_WHEELS
           (--no-index --no-deps), check the project's runtime dependencies, pip install --no-deps -e $ROOT
         3 run pytest -m cuda on the test files with CUDA tests (cap 50 s)
         4 run benchmarks/gpu_shapes.py --shape 1b --budget 78 (cap 90 s)
         5 build refcoder for torch on cuda in float16 and float32 and bench plain vs its default plan
           (caps 50 s + 30 s each)
         6 run benchmarks/gpu_shapes.py --shape 8b if 100 s or more are left (cap 120 s)
         7 write $WORK/results.json, table.txt and log.txt, and print the tables
       The same code paths on this CPU: python benchmarks/gpu_shapes.py --smoke
EOF
    exit 0
fi
[ "$REHEARSAL" = 1 ] || nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | sed 's/^/       /'
mkdir -p "$WORK" "$LOG"
rm -f "$SCRATCH"/shapes-*.json "$LOG"/*.txt  # nothing of an earlier run in this run's results
STEPS="$SCRATCH/steps.jsonl"; : >"$STEPS"
ROWS="$SCRATCH/refcoder.jsonl"; : >"$ROWS"
# record NAME STATUS STARTED [NOTE]: one line of steps.jsonl
record() {
    local note="${4:-}"; note="${note//[\"\\]/\'}"  # JSON-safe: no double quote, no backslash
    printf '{"step": "%s", "status": "%s", "seconds": %s, "note": "%s"}\n' "$1" "$2" "$((SECONDS - $3))" "$note" >>"$STEPS"
}
# limited CAP CMD...: CMD under a timeout of CAP seconds, less when the deadline is nearer; rc 124 without running it
# once fewer than 15 seconds are left (what a step needs at least to say anything)
limited() {
    local cap=$(($1 * SCALE)) rest; shift
    rest=$((DEADLINE - SECONDS - 10)); [ "$rest" -lt "$cap" ] && cap=$rest
    if [ "$cap" -lt 15 ]; then echo "skipped: the ${DEADLINE} s deadline is near" >&2; return 124; fi
    timeout "$cap" "$@"
}
status_of() { case "$1" in 0) echo ok ;; 124) echo timeout ;; *) echo "failed" ;; esac; }
finish() {  # step 7, also after an early stop: whatever was measured goes into results.json
    step "7/7 results: $WORK/results.json"
    local py="${PY:-python3}"
    "$py" - "$SCRATCH/info.json" <<'EOF' 2>/dev/null
import json, subprocess, sys, time
info = {"date": time.strftime("%Y-%m-%d"), "command": "bash benchmarks/gpu_check.sh"}
try:
    import torch
    info["machine"] = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
except Exception as error:
    info["machine"] = f"unknown ({error})"
try:
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    pass
open(sys.argv[1], "w").write(json.dumps(info))
EOF
    "$py" "$ROOT/benchmarks/gpu_bench.py" results --out "$WORK/results.json" --info "$SCRATCH/info.json" \
        --steps "$STEPS" --rows "$ROWS" --shapes "$SCRATCH/shapes-1b.json" "$SCRATCH/shapes-8b.json" | tee "$WORK/table.txt"
    cp "$ROWS" "$WORK/rows.jsonl" 2>/dev/null  # render_results.py --gpu-rows reads it
    for f in "$LOG"/*.txt; do [ -f "$f" ] && { echo "===== $(basename "$f")"; cat "$f"; }; done >"$WORK/log.txt"
    echo "results: $WORK/results.json, tables: $WORK/table.txt, logs: $WORK/log.txt; total ${SECONDS} s"
}

step "2/7 venv in $VENV (system site packages), the project installed without dependencies"
t=$SECONDS
rm -rf "$VENV"
python3 -m venv --system-site-packages "$VENV" || { echo "error: python3 -m venv failed"; exit 1; }
PY="$VENV/bin/python"
# When python3 is itself a venv (the CUDA image's /opt/torch/.venv), --system-site-packages shows the *base*
# interpreter's packages, not that venv's torch: list python3's own site-packages in a .pth as well (after the new
# venv's own, so wheels installed below take precedence).
python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
    >"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-check-parent.pth"
# A venv of Python < 3.12 brings its own old setuptools, which would shadow the machine's (what --no-build-isolation
# builds the project with; Python 3.12's venvs bring none): drop it when the machine has one.
if python3 -c "import setuptools" 2>/dev/null && "$PY" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)" 2>/dev/null \
    && [ -n "$(ls -d "$VENV"/lib/python3*/site-packages/setuptools 2>/dev/null)" ]; then
    "$PY" -m pip uninstall --quiet -y setuptools >/dev/null 2>&1
fi
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile "$GPU_CHECK_WHEELS"/*.whl >"$LOG/pip-wheels.txt" 2>&1 \
        && echo "       installed from $GPU_CHECK_WHEELS: $(cd "$GPU_CHECK_WHEELS" && ls ./*.whl | sed 's|^\./||; s/-py3.*//; s/-cp3.*//' | tr '\n' ' ')" \
        || echo "       warning: the wheels of $GPU_CHECK_WHEELS did not install (see log.txt, pip-wheels.txt)"
fi
# what the project needs, against what is importable (no network: nothing can be resolved, only reported)
"$PY" - "$ROOT/pyproject.toml" <<'EOF' | tee "$LOG/dependencies.txt"
import importlib.metadata as md, sys, tomllib
from packaging.requirements import Requirement
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
needed = [(Requirement(r), "runtime") for r in project["dependencies"]]
extras = project["optional-dependencies"]
needed += [(Requirement(r), "torch backend") for r in extras["torch"]]
needed += [(Requirement(r), "build (refcoder)") for r in extras["build"] if Requirement(r).name in ("transformers", "huggingface-hub")]
missing = []
for req, role in needed:
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        print(f"       MISSING  {req.name} {req.specifier} ({role})")
        missing.append((req.name, role))
        continue
    within = req.specifier.contains(version, prereleases=True)
    print(f"       {'ok' if within else 'OUTSIDE':<8} {req.name} {version}" + ("" if within else f" (the project pins {req.specifier}; {role})"))
if any(role != "build (refcoder)" for _, role in missing):
    print("       the runtime cannot import without these: carry them as wheels (gpu_check.sh --wheels DIR, GPU_CHECK_WHEELS=DIR)")
    sys.exit(1)
EOF
DEPS_RC=${PIPESTATUS[0]}
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" >"$LOG/pip-project.txt" 2>&1
PIP_RC=$?
if [ "$PIP_RC" -ne 0 ] || [ "$DEPS_RC" -ne 0 ] || ! "$PY" -c "import speccompile.runtime.acceptance, torch, sys; sys.exit(0 if torch.cuda.is_available() or '$DEVICE' == 'cpu' else 1)" >>"$LOG/pip-project.txt" 2>&1; then
    tail -3 "$LOG/pip-project.txt" | sed 's/^/       /'
    record setup failed "$t" "pip rc $PIP_RC, dependencies rc $DEPS_RC, or speccompile / CUDA torch does not import (log: pip-project.txt)"
    echo "error: the project does not import with a CUDA torch in the venv; nothing else can run"
    finish; exit 1
fi
record setup ok "$t" "$("$PY" -c 'import torch; print("torch", torch.__version__)')"

step "3/7 pytest -m cuda"
t=$SECONDS
mapfile -t CUDA_TESTS < <(cd "$ROOT" && grep -l "mark.cuda" tests/test_*.py)
if [ "${#CUDA_TESTS[@]}" -gt 0 ]; then
    (cd "$ROOT" && limited 50 "$PY" -m pytest -q -o addopts="" -p no:cacheprovider -m cuda "${CUDA_TESTS[@]}") \
        >"$LOG/pytest-cuda.txt" 2>&1
    rc=$?
else
    echo "no test file holds a CUDA test" >"$LOG/pytest-cuda.txt"; rc=1
fi
tail -1 "$LOG/pytest-cuda.txt" | sed 's/^/       /'
record "pytest -m cuda" "$(status_of $rc)" "$t" "$(tail -1 "$LOG/pytest-cuda.txt")"

shapes() {  # shapes KEY CAP: gpu_shapes.py at one shape, its JSON in the scratch folder
    local key=$1 cap=$2 t=$SECONDS rc extra
    extra=(--shape "$key")
    [ "$REHEARSAL" = 1 ] && extra=(--smoke)
    [ -f "$ACCEPTANCE" ] && extra+=(--acceptance "$ACCEPTANCE")
    local rest=$((DEADLINE - SECONDS - 10)); [ "$rest" -lt "$((cap * SCALE))" ] && cap=$((rest / SCALE))
    (cd "$ROOT" && PYTHONUNBUFFERED=1 limited "$cap" "$PY" benchmarks/gpu_shapes.py --budget $((cap - 12)) \
        --json "$SCRATCH/shapes-$key.json" "${extra[@]}") >"$LOG/shapes-$key.txt" 2>&1
    rc=$?
    grep -E '^\[gpu_shapes' "$LOG/shapes-$key.txt" | tail -2 | sed 's/^/       /'
    record "gpu_shapes $key" "$(status_of $rc)" "$t" "$(grep -m1 -E 'Error|error' "$LOG/shapes-$key.txt")"
}
step "4/7 gpu_shapes.py --shape 1b$([ -f "$ACCEPTANCE" ] && echo " --acceptance $ACCEPTANCE")"
shapes 1b 90

step "5/7 refcoder, float16 and float32: build for torch on $DEVICE (--method $METHOD), bench plain vs the default plan"
for dtype in float16 float32; do
    t=$SECONDS; out="$SCRATCH/artifacts/refcoder-$dtype"
    limited 50 "$VENV/bin/speccompile" build "$ROOT/models/refcoder" -o "$out" --force --quiet --device "$DEVICE" \
        --dtype "$dtype" --method "$METHOD" --time-budget "$BUILD_BUDGET" --backend torch >"$LOG/build-$dtype.txt" 2>&1
    rc=$?
    record "refcoder $dtype build" "$(status_of $rc)" "$t" "$(grep -o "plan '[^']*'" "$LOG/build-$dtype.txt" | head -1)"
    if [ "$rc" -ne 0 ]; then echo "       $dtype build: $(status_of $rc): $(tail -1 "$LOG/build-$dtype.txt")"; continue; fi
    echo "       $dtype: built, $(grep -o "plan '[^']*'" "$LOG/build-$dtype.txt" | head -1)"
    t=$SECONDS
    limited 30 "$PY" "$ROOT/benchmarks/gpu_bench.py" rows "$out" --model refcoder --dtype "$dtype" \
        --prompts "$ROOT/models/refcoder/prompts.jsonl" --n "$PROMPTS" --new-tokens "$NEW_TOKENS" --engines torch-graphs --device "$DEVICE" \
        >>"$ROWS" 2>"$LOG/bench-$dtype.txt"
    rc=$?
    record "refcoder $dtype bench" "$(status_of $rc)" "$t" "$(tail -1 "$LOG/bench-$dtype.txt")"
done

step "6/7 gpu_shapes.py --shape 8b (when 100 s or more are left)"
if [ $((DEADLINE - SECONDS)) -ge 100 ]; then
    shapes 8b 120
else
    echo "       skipped: $((DEADLINE - SECONDS)) s left of ${DEADLINE} s"
    record "gpu_shapes 8b" skipped "$SECONDS" "$((DEADLINE - SECONDS)) s left of the ${DEADLINE} s deadline"
fi

finish
