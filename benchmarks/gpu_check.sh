#!/usr/bin/env bash
# One prepared GPU check (issue 13): torch-CUDA (eager and CUDA graphs), ONNX Runtime CUDA and TensorRT on
# refcoder and SmolLM2-135M, in a fresh venv, one table at the end. Meant to finish in under 8 minutes on
# one data-centre GPU.
#
#   bash benchmarks/gpu_check.sh [WORKDIR]        (default WORKDIR: /tmp/speccompile-gpu-check)
#
# Steps: (1) venv with --system-site-packages (a preinstalled CUDA torch / TensorRT is reused; pip
# installs only what is missing), project with [dev]; (2) GPU gate: without an NVIDIA GPU it stops here,
# exit 0, before anything GPU-only is installed or run; (3) onnxruntime-gpu, tensorrt, cuda-python (an
# install that fails, e.g. offline, marks that backend "not installed" instead of stopping); (4) pytest
# -m cuda; (5) one artifact per model with --backend torch,onnx,tensorrt --device cuda --method
# early-exit; (6) each backend decodes the same prompts plainly and speculatively; (7) the table.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-/tmp/speccompile-gpu-check}"
VENV="$WORK/venv"
LOG="$WORK/log"
PROMPTS="${GPU_CHECK_PROMPTS:-8}"
NEW_TOKENS="${GPU_CHECK_TOKENS:-64}"
mkdir -p "$WORK" "$LOG"
step() { printf '[%4ss] %s\n' "$SECONDS" "$*"; }

step "1/7 fresh venv in $VENV, project installed with [dev]"
rm -rf "$VENV"
python3 -m venv --system-site-packages "$VENV" || { echo "error: could not create a venv with python3 -m venv"; exit 1; }
PY="$VENV/bin/python"
if ! "$PY" -m pip install --quiet -e "$ROOT[dev]" >"$LOG/pip-project.txt" 2>&1; then
    echo "error: pip install -e .[dev] failed; see $LOG/pip-project.txt"; tail -3 "$LOG/pip-project.txt"; exit 1
fi
"$PY" -c "import speccompile, torch; print('       speccompile', speccompile.__version__, '| torch', torch.__version__)"

step "2/7 GPU gate"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "       no NVIDIA GPU here (nvidia-smi missing or sees none): stopping before the GPU-only steps"
    echo "       (onnxruntime-gpu / tensorrt installs, pytest -m cuda, CUDA builds, benches). Nothing was measured."
    exit 0
fi
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | sed 's/^/       /'
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: the GPU is there but this torch ($("$PY" -c 'import torch; print(torch.__version__)')) has no CUDA;"
    echo "       install a CUDA build of torch 2.5-2.13 (pip install torch) and rerun"; exit 1
fi

step "3/7 onnxruntime-gpu, tensorrt, cuda-python"
"$PY" -m pip uninstall --quiet -y onnxruntime >/dev/null 2>&1  # the CPU wheel would shadow onnxruntime-gpu
ORT_STATUS=ok; TRT_STATUS=ok
"$PY" -m pip install --quiet "onnxruntime-gpu>=1.20,<2" >"$LOG/pip-ort.txt" 2>&1 || ORT_STATUS="not installed"
"$PY" -c "import onnxruntime as o, sys; sys.exit(0 if 'CUDAExecutionProvider' in o.get_available_providers() else 1)" \
    2>/dev/null || ORT_STATUS="no CUDA provider"
timeout 300 "$PY" -m pip install --quiet -e "$ROOT[tensorrt]" >"$LOG/pip-trt.txt" 2>&1 || TRT_STATUS="not installed"
"$PY" -c "import tensorrt; from cuda.bindings import runtime" 2>/dev/null || TRT_STATUS="not installed"
echo "       onnxruntime-gpu: $ORT_STATUS | tensorrt: $TRT_STATUS $("$PY" -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null)"

step "4/7 pytest -m cuda"
(cd "$ROOT" && "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_graphs.py tests/test_tensorrt.py) \
    >"$LOG/pytest-cuda.txt" 2>&1
PYTEST_RC=$?
tail -1 "$LOG/pytest-cuda.txt" | sed 's/^/       /'

step "5/7 builds (torch tuning on cuda, early-exit plans)"
SMOL="$("$PY" "$ROOT/benchmarks/smollm2.py" "$WORK/smollm2-135m-instruct" 2>"$LOG/smollm2.txt")" || SMOL=""
BACKENDS="torch,onnx"
[ "$TRT_STATUS" = ok ] && BACKENDS="torch,onnx,tensorrt"
declare -A ARTIFACT
for model in refcoder smollm2; do
    source_model=refcoder; calib=(); prompts="$ROOT/models/refcoder/prompts.jsonl"
    if [ "$model" = smollm2 ]; then
        [ -n "$SMOL" ] || { echo "       smollm2: model folder not available (see $LOG/smollm2.txt)"; continue; }
        source_model="$SMOL"; calib=(--calibration "$ROOT/benchmarks/data/smollm2_calibration.jsonl")
    fi
    out="$WORK/artifacts/$model"
    if timeout 240 "$VENV/bin/speccompile" build "$source_model" -o "$out" --force --quiet --device cuda \
        --method early-exit --backend "$BACKENDS" --max-draft 4 --calibration-tokens 32 ${calib[@]+"${calib[@]}"} \
        >"$LOG/build-$model.txt" 2>&1; then
        ARTIFACT[$model]="$out"; echo "       $model -> $out ($BACKENDS)"
    else
        echo "       $model: build failed: $(grep -m1 '^error' "$LOG/build-$model.txt" || tail -1 "$LOG/build-$model.txt")"
    fi
done

step "6/7 benches ($PROMPTS prompts x $NEW_TOKENS new tokens, greedy)"
RESULTS="$WORK/results.jsonl"; : >"$RESULTS"
for model in "${!ARTIFACT[@]}"; do
    prompts="$ROOT/models/refcoder/prompts.jsonl"
    [ "$model" = smollm2 ] && prompts="$ROOT/benchmarks/data/smollm2_prompts.jsonl"
    for row in "torch:0" "torch:1" "onnx:0" "tensorrt:0"; do
        backend="${row%%:*}"; graphs="${row##*:}"
        [ "$backend" = onnx ] && [ "$ORT_STATUS" != ok ] && { echo "{\"model\":\"$model\",\"backend\":\"onnx-cuda\",\"error\":\"$ORT_STATUS\"}" >>"$RESULTS"; continue; }
        [ "$backend" = tensorrt ] && [ "$TRT_STATUS" != ok ] && { echo "{\"model\":\"$model\",\"backend\":\"tensorrt\",\"error\":\"$TRT_STATUS\"}" >>"$RESULTS"; continue; }
        SPECCOMPILE_CUDA_GRAPHS=$graphs timeout 150 "$PY" - "${ARTIFACT[$model]}" "$backend" "$model" "$prompts" \
            "$PROMPTS" "$NEW_TOKENS" "$graphs" >>"$RESULTS" 2>"$LOG/bench-$model-$backend-$graphs.txt" <<'PYEOF' \
            || echo "{\"model\":\"$model\",\"backend\":\"$backend\",\"error\":\"bench failed, see log\"}" >>"$RESULTS"
import json, sys, time
from speccompile.runtime import load

root, backend, model_name, prompts_file, n, new_tokens, graphs = sys.argv[1:8]
texts = []
for line in open(prompts_file):
    if line.strip():
        item = json.loads(line)
        texts.append(item.get("prompt") or item.get("text"))
texts = texts[: int(n)]
model = load(root, backend=backend, device="cuda")
model.generate(texts[0], max_new_tokens=8)  # warm-up: CUDA graphs, TensorRT contexts, ORT CUDA kernels
model.generate(texts[0], max_new_tokens=8, speculate=False)
plain_s = spec_s = 0.0
tokens = rounds = accepted = 0
identical = True
outputs = []
for text in texts:
    t0 = time.perf_counter(); plain = model.generate(text, max_new_tokens=int(new_tokens), speculate=False); t1 = time.perf_counter()
    spec = model.generate(text, max_new_tokens=int(new_tokens)); t2 = time.perf_counter()
    plain_s += t1 - t0; spec_s += t2 - t1; tokens += len(spec.token_ids)
    rounds += spec.stats.rounds; accepted += spec.stats.accepted
    identical &= plain.token_ids == spec.token_ids
    outputs.append(plain.token_ids)
name = {"torch": "torch-cuda" + ("+graphs" if graphs == "1" else ""), "onnx": "onnx-cuda"}.get(backend, backend)
print(json.dumps({"model": model_name, "backend": name, "plain_tps": tokens / plain_s, "spec_tps": tokens / spec_s,
                  "ratio": plain_s / spec_s, "mean_accepted": (accepted + rounds) / max(rounds, 1),
                  "identical": identical, "outputs": outputs, "plan": model.manifest.default_plan}))
PYEOF
    done
done

step "7/7 table"
"$PY" - "$RESULTS" <<'PYEOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
reference = {r["model"]: r["outputs"] for r in rows if r.get("backend") == "torch-cuda" and "outputs" in r}
print(f"{'model':10} {'backend':18} {'plain tok/s':>11} {'spec tok/s':>10} {'spec/plain':>10} {'tok/round':>9} "
      f"{'spec==plain':>11} {'==torch-cuda':>12}")
for r in sorted(rows, key=lambda r: (r["model"], r["backend"])):
    if "error" in r:
        print(f"{r['model']:10} {r['backend']:18} {r['error']}")
        continue
    same = "-" if r["model"] not in reference else ("yes" if reference[r["model"]] == r["outputs"] else "no")
    print(f"{r['model']:10} {r['backend']:18} {r['plain_tps']:11.1f} {r['spec_tps']:10.1f} {r['ratio']:9.2f}x "
          f"{r['mean_accepted']:9.2f} {('yes' if r['identical'] else 'NO'):>11} {same:>12}")
PYEOF
echo "pytest -m cuda exit status: $PYTEST_RC (log: $LOG/pytest-cuda.txt); total ${SECONDS}s"
