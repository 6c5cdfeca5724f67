#!/usr/bin/env bash
# The CUDA tests and the GPU benchmarks of docs/BENCHMARKS.md, run on a machine with an
# NVIDIA GPU (from the repository root):
#   bash scripts/gpu_checks.sh [tests] [prefill] [decode] [e2e] [kernel]   (default: all)
# Logs go to $OUT (or runs/gpu). Wheels in .whl/ (e.g. the transformers this project
# pins, where the machine's is older and cannot be upgraded online) are put first on PYTHONPATH.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
parts=${*:-tests prefill decode e2e kernel}
status=0
for part in $parts; do
    case $part in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_prefill.py 2>&1 |
               tee "$out/cuda_tests.log" | tail -15 ;;
    prefill) python3 scripts/bench_prefill_cuda.py 2>&1 | tee "$out/prefill_cuda.md" ;;
    kernel) python3 scripts/bench_kernel.py --grid paper --gqa --device cuda --dtype bfloat16 --out "$out" 2>&1 |
                tail -40 | tee "$out/kernel_grid.log" ;;
    decode) python3 scripts/bench_decode_step.py --device cuda --dtype bfloat16 --geometry llama-3.2-1b --repeat 20 2>&1 |
                tail -8 | tee "$out/decode_step.log" ;;
    e2e) python3 scripts/bench_e2e.py --device cuda --dtype bfloat16 --geometry llama-3.2-1b --num-requests 32 \
             --n-shared 2000 --max-new-tokens 64 --systems engine stock cb_share --json "$out/e2e_1b.json" 2>&1 |
             tail -12 | tee "$out/e2e_1b.log" ;;
    *) echo "unknown part $part"; exit 2 ;;
    esac
    status=$((status | $?))
done
exit $status
