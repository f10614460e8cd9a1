#!/usr/bin/env bash
# GPU check (issue 9, item 6): the GPU path end to end, on one GPU, in under 10 minutes.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else runs/gpu-check-<time>
#
# Run from the repository root, in an environment where pdlab is installed (pip install -e '.[test]')
# with a CUDA build of torch; pdlab[flash] is optional (without it the engine runs sdpa-expanded, and
# every output below says which kernel ran). Steps, each under its own time limit (timeout; a hang
# costs only its step) and all within one budget of $BUDGET_S seconds (default 570):
#
#   1. env         nvidia-smi, torch/CUDA versions, flash-attn, env.json's attention record    ~5 s
#   2. tests       the CUDA tests (pytest -m cuda): parity, bf16 preemption, kernels vs the GQA
#                  SDPA path, cuda-ipc + host transports in one process                      ~30-60 s
#   3. bench       benchmarks/bench_engine.py on gpu-0.6b, bf16, TP 1 (64 prompts x 64 tokens,
#                  with transformers' baselines)                                             ~60-120 s
#   4. run         pdlab run of a tiny gpu-0.6b recipe: unified, and 1P+1D over cuda-ipc (pull
#                  and push) on cuda:0 with share_devices, at saturation                     ~90-150 s
#   5. doctor      pdlab doctor --json (devices, peer matrix, transport probes)              ~20 s
#   6. profile     pdlab profile --model gpu-0.6b --device cuda:0 (timing model)             ~60-100 s
#
# A failed step is recorded and the next one runs. Everything goes under OUT_DIR: one log per step,
# the step's outputs, and summary.tsv (step, exit code, seconds). The exit code is the number of failed
# steps. Without a GPU (torch sees no CUDA device) the script only checks that its recipe parses, says
# there is no GPU, and exits 2 within seconds: there is nothing else here a CPU can tell.
#
# Status: written and checked on a CPU box only (syntax, recipe, the no-GPU exit); it has not run on a GPU.
set -u -o pipefail

PY=${PYTHON:-python}
PDLAB=("$PY" -m pdlab.cli)  # the CLI of the same interpreter, whether or not `pdlab` is on PATH
BUDGET_S=${BUDGET_S:-570}
OUT_DIR=${1:-${OUT:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY="$OUT_DIR/summary.tsv"
printf 'step\trc\tseconds\tlimit_s\n' > "$SUMMARY"
T0=$(date +%s)
FAILED=0

# step NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, what is left of the budget), log it, record it.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - T0)))
    if [ "$left" -lt 10 ]; then
        echo "== $name: skipped, the ${BUDGET_S}s budget is spent"
        printf '%s\tskipped\t0\t0\n' "$name" >> "$SUMMARY"
        FAILED=$((FAILED + 1))
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*"
    local s=$(date +%s)
    timeout --signal=TERM --kill-after=15 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local dt=$(($(date +%s) - s))
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dt" "$limit" >> "$SUMMARY"
    if [ "$rc" -ne 0 ]; then
        FAILED=$((FAILED + 1))
        local why=""
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (time limit)"
        echo "   FAILED rc=$rc$why after ${dt}s; last lines of $OUT_DIR/$name.log:"
        tail -n 15 "$OUT_DIR/$name.log" | sed 's/^/   | /'
    else
        echo "   ok in ${dt}s"
    fi
}

RECIPE="$OUT_DIR/gpu-check-recipe.yaml"
cat > "$RECIPE" <<'EOF'
# gpu_check.sh's run: gpu-0.6b in bf16 on one GPU; unified, and 1P+1D over cuda-ipc sharing cuda:0.
name: gpu-check
seed: 0
warmup: 1
model: {preset: gpu-0.6b, dtype: bfloat16}
# kv_memory_fraction 0.3: each of two workers sharing the GPU sizes its pool from 0.15 of the device
engine: {block_size: 16, kv_blocks: auto, kv_memory_fraction: 0.3, token_budget: 2048, chunked_prefill: false,
         prefix_caching: true, max_running: 32}
workload:
  requests: 24
  arrival: {kind: poisson}
  input_len: {kind: uniform, min: 200, max: 1000}
  output_len: {kind: fixed, value: 32}
rates: [.inf]
slo: {ttft_ms: 500, itl_ms: 50, itl_stat: p99, attainment: 0.9}
variants:
  unified:
    deployment: {unified: {devices: [cuda:0]}}
  disagg-pull:
    deployment: {prefill: {devices: [cuda:0]}, decode: {devices: [cuda:0]}, transport: cuda-ipc, mode: pull,
                 share_devices: true}
  disagg-push:
    deployment: {prefill: {devices: [cuda:0]}, decode: {devices: [cuda:0]}, transport: cuda-ipc, mode: push,
                 share_devices: true}
EOF

if ! "$PY" -c "from pdlab.recipe import load_recipe; load_recipe('$RECIPE')" > "$OUT_DIR/recipe-check.log" 2>&1; then
    echo "the check's own recipe does not parse:"; cat "$OUT_DIR/recipe-check.log"; exit 3
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no GPU: torch sees no CUDA device here; nothing else to check (recipe parses; outputs in $OUT_DIR)"
    printf 'gpu\tno-gpu\t0\t0\n' >> "$SUMMARY"
    exit 2
fi

step env 30 bash -c "nvidia-smi; echo; \"$PY\" -c 'import json, torch
from pdlab.measure.records import collect_env
e = collect_env()
print(json.dumps({k: e[k] for k in (\"torch_version\", \"cuda\", \"attention\")}, indent=2))
print(\"torch cuda\", torch.version.cuda)' | tee \"$OUT_DIR/env.json\""
step tests 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/ --junitxml="$OUT_DIR/tests.xml"
step bench 170 "$PY" benchmarks/bench_engine.py --device cuda --dtype bfloat16 --preset gpu-0.6b --prompts 64 \
    --json "$OUT_DIR/bench_engine.json"
step run 200 "${PDLAB[@]}" run "$RECIPE" --out "$OUT_DIR/run"
step doctor 60 bash -c "\"$PY\" -m pdlab.cli doctor --json > \"$OUT_DIR/doctor.json\""
step profile 150 "${PDLAB[@]}" profile --model gpu-0.6b --device cuda:0 --steps 200 --out "$OUT_DIR/profile-gpu-0.6b.yaml"

echo "== done in $(($(date +%s) - T0))s, $FAILED failed step(s); summary: $SUMMARY"
column -t "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
exit "$FAILED"
