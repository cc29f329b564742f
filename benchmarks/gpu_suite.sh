#!/usr/bin/env bash
# GPU checks and benchmarks, in named steps (docs/results.md has the results and the machine):
#
#   bash benchmarks/gpu_suite.sh tests      # GPU tests (pytest -m gpu)
#   bash benchmarks/gpu_suite.sh speculate  # only the GPU tests of speculation (identical answers on the card)
#   bash benchmarks/gpu_suite.sh mixed      # 8B Q4_K_M on a GPU daemon beside CPU daemons: the all-CPU tokens
#   bash benchmarks/gpu_suite.sh blocks     # SmolLM2's GGUF blocks vs --dequantize on the card
#   bash benchmarks/gpu_suite.sh prefill    # one daemon, whole LLaMA-7B shape, vs transformers
#   bash benchmarks/gpu_suite.sh mps        # 3 MPS daemons at 50/30/20%: profile, plan, bench all strategies
#   bash benchmarks/gpu_suite.sh long       # 8k/16k/32k-token prefill on the same cluster, memory vs plan
#
# Logs and JSON go to $OUT (default /tmp/hpipe-gpu). Wheels in .whl/ (for a machine without the
# package index) are installed to /tmp/site first. MODEL, LONG_MODEL and CLUSTER override the
# defaults, e.g. to dry-run a step on CPU daemons with random:tiny.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hpipe-gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
if ! $PY -c "import grpc_tools, grpc_health" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
MODEL=${MODEL:-random:llama-7b}
LONG_MODEL=${LONG_MODEL:-random:llama3.1-8b}
CLUSTER=${CLUSTER:-clusters/mps-3.yaml}
BATCH=${BATCH:-6}
SEQ=${SEQ:-2048}
LONG_LENS=${LONG_LENS:-8192 16384 32768}
hpipe() { "$PY" -m hpipe.app.cli "$@"; }
$PY -m runtime.wire.protogen >/dev/null || exit 1
$PY -c "from hpipe.model.kernels import library; library.build()" || exit 1  # once, before daemons start

step_tests() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    command -v nvidia-cuda-mps-control || echo "no nvidia-cuda-mps-control on PATH"
    $PY -m pytest -q -rs --durations=0 -m gpu tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/tests.log"
}

step_speculate() {
    $PY -m pytest -q -rs -m gpu tests/test_gpu.py -k speculation 2>&1 | tee "$OUT/speculate.log"
}

step_mixed() {
    $PY benchmarks/gpu_mixed.py --json "$OUT/mixed.json" 2>&1 | tee "$OUT/mixed.log"
}

step_blocks() {
    $PY benchmarks/gpu_blocks.py 2>&1 | tee "$OUT/blocks.log"
}

step_prefill() {
    $PY benchmarks/gpu_prefill.py --model "$MODEL" --batch "$BATCH" --seq-len "$SEQ" --json 2>&1 | tee "$OUT/prefill.log"
}

step_mps() {
    hpipe cluster up "$CLUSTER" || return 1
    hpipe profile --cluster "$CLUSTER" --model "$MODEL" --dtype bfloat16 --max-len "$SEQ" --batch "$BATCH" \
        -o "$OUT/mps-profile.json" 2>&1 | tee "$OUT/mps-profile.log"
    hpipe plan --profile "$OUT/mps-profile.json" --seq-len "$SEQ" --batch "$BATCH" -o "$OUT/mps-plan.json" \
        --chart "$OUT/mps-plan.png" 2>&1 | tee "$OUT/mps-plan.log"
    hpipe bench --plan "$OUT/mps-plan.json" --cluster "$CLUSTER" --repeat 3 --json --chart "$OUT/mps-bench.png" \
        > "$OUT/mps-bench.json" 2> "$OUT/mps-bench.log"
    cat "$OUT/mps-bench.log"
    hpipe cluster down "$CLUSTER"
}

step_long() {
    local max=0
    for n in $LONG_LENS; do [ "$n" -gt "$max" ] && max=$n; done
    hpipe cluster up "$CLUSTER" || return 1
    hpipe profile --cluster "$CLUSTER" --model "$LONG_MODEL" --dtype bfloat16 --max-len "$max" \
        -o "$OUT/long-profile.json" 2>&1 | tee "$OUT/long-profile.log"
    hpipe plan --profile "$OUT/long-profile.json" --seq-len "$max" --max-len "$max" --granularity 64 \
        -o "$OUT/long-plan.json" 2>&1 | tee "$OUT/long-plan.log"
    for n in $LONG_LENS; do
        hpipe bench --plan "$OUT/long-plan.json" --cluster "$CLUSTER" --strategies hpipe --seq-len "$n" --repeat 1 \
            --json > "$OUT/long-$n.json" 2> "$OUT/long-$n.log"
        cat "$OUT/long-$n.log"
    done
    hpipe cluster down "$CLUSTER"
}

status=0
for step in "$@"; do
    echo "=== $step ($(date +%T))"
    "step_$step" || status=1
done
exit $status
