#!/usr/bin/env bash
# The GPU path's device check in one call: kernels vs reference, Llama-3-8B-shaped decode (eager
# and CUDA graphs) against the HBM roofline. Everything lands in $OUT (gpu_check.json, the log).
#   OUT=/tmp/out bash benchmarks/gpu_check.sh            # on the GPU machine
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --dry-run   # CPU smoke test, tiny shapes
# Extra arguments go to gpu_check.py (--sections, --batches, --context, --iters).
set -uo pipefail
cd "$(dirname "$0")/.."
# The device machine has torch and triton but iterserve is not installed there: import it from here.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu --format=csv \
    >"$OUT/nvidia_smi.csv" 2>&1 || echo "no nvidia-smi"
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# Stop well inside a 10-minute call so $OUT still comes back if something hangs.
timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check exit code $rc; results in $OUT/gpu_check.json"
exit "$rc"
