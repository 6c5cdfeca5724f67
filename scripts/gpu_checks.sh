#!/usr/bin/env bash
# The CUDA tests and the GPU benchmarks of docs/BENCHMARKS.md, sized for a lent machine: at most
# 8 minutes on an H100 or H200, the CUDA build included (run from the repository root):
#   bash scripts/gpu_checks.sh [build] [tests] [decode] [e2e] [prefill] [kernel]
# (default: build tests decode e2e prefill; kernel, the paper's grid, only when named).
# Each part writes $OUT/<part>.log (or runs/gpu/) as it runs, so a part that fails or runs out of
# time leaves its output and the next part still runs; every part has its own time limit, cut to
# what is left of the budget (CHUNK_LLAMA_GPU_BUDGET_S, default 470 s). Exit status: 0 when every
# part passed, else 1; $OUT/summary.txt says which part ended how and in how many seconds.
# Wheels in .whl/ (e.g. the transformers this project pins, where the machine's is older and cannot
# be upgraded offline) are put first on PYTHONPATH.
set -euo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=${CHUNK_LLAMA_GPU_BUDGET_S:-470}
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || echo "nvidia-smi failed"
    "$python" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())" ||
        echo "torch or transformers does not import"
    git log -1 --format="commit %H %s" 2>/dev/null || true
} 2>&1 | tee "$out/env.txt"

status=0
: >"$out/summary.txt"
# run_part NAME LIMIT_S COMMAND...: the command under `timeout` (at most what is left of the budget),
# its output in $OUT/NAME.log, the last lines on the terminal; a failure is recorded, not fatal.
run_part() {
    local name=$1 limit=$2 left rc start
    shift 2
    left=$((budget - SECONDS))
    if ((left < 20)); then
        echo "$name: skipped, $left s of the budget left" | tee -a "$out/summary.txt"
        status=1
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s): $*"
    start=$SECONDS
    rc=0
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    tail -n 25 "$out/$name.log"
    if ((rc == 0)); then
        echo "$name: passed in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    else
        [[ $rc == 124 || $rc == 130 || $rc == 137 ]] && why="ran out of its ${limit} s" || why="exit code $rc"
        echo "$name: FAILED ($why) after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
        status=1
    fi
}

parts=${*:-build tests decode e2e prefill}
for part in $parts; do
    case $part in
    build) run_part build 200 "$python" -c "
import torch
from chunk_llama.ops import prepare_backend
from chunk_llama.ops.cuda import decode
print(prepare_backend(torch.device('cuda'), torch.bfloat16, 64, 64))
lib = decode.build()
print('CUDA library:', lib and lib.path, lib and lib.origin, decode.build_failed())
assert lib is not None, 'the CUDA kernels did not build'" ;;
    tests) run_part tests 150 "$python" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py tests/test_cuda_prefill.py \
        tests/test_decode_graphs.py ;;
    decode) run_part decode_step 150 "$python" scripts/bench_decode_step.py --device cuda --dtype bfloat16 \
        --geometry llama-3.2-1b --repeat 20 --graphs ;;
    e2e) run_part e2e_1b 150 "$python" scripts/bench_e2e.py --device cuda --dtype bfloat16 --geometry llama-3.2-1b \
        --num-requests 32 --n-shared 2000 --max-new-tokens 64 --systems engine stock --no-parity \
        --json "$out/e2e_1b.json" ;;
    prefill) run_part prefill_cuda 90 "$python" scripts/bench_prefill_cuda.py --repeat 10 ;;
    kernel) run_part kernel_grid 300 "$python" scripts/bench_kernel.py --grid paper --gqa --device cuda \
        --dtype bfloat16 --out "$out" ;;
    *) echo "unknown part $part (build, tests, decode, e2e, prefill, kernel)"; exit 2 ;;
    esac
done
echo "== summary ($SECONDS s in all)"
cat "$out/summary.txt"
exit $status
