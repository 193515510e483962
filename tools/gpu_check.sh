#!/usr/bin/env bash
# One command for the GPU machine: compile-check, the GPU test suite and the
# benchmarks (python -m rawkv bench --peer: humming-kernels too where installed),
# run from the source tree (src/ on PYTHONPATH: no install, no network needed).
#
#   bash tools/gpu_check.sh                 # everything
#   RAWKV_TESTS="tests/fp8/test_e4m3.py" RAWKV_BENCH=core bash tools/gpu_check.sh
#   RAWKV_BENCH=none ... (tests only)       RAWKV_QUICK=1 ... (short benchmarks)
#
# Writes under $OUT (default ./gpu-out): nvrtc_check.log, pytest.log,
# bench.log and bench/<date>-<device>-<group>.json (shape: docs/benchmarks.md).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/bench"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RAWKV_CACHE_DIR=${RAWKV_CACHE_DIR:-/tmp/rawkv-cache}
TESTS=${RAWKV_TESTS:-tests}
BENCH=${RAWKV_BENCH:-core,nvfp4,fused,kvcache,gemm}
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"

# The local GPU's architecture, chosen exactly as the runtime chooses it.
ARCH=$(python3 -c "import torch; from rawkv.runtime import arch_for; print(arch_for(torch.cuda.get_device_capability()))") \
  || { echo "gpu_check: could not read the local GPU's architecture"; ARCH=""; status=1; }
if [ -n "$ARCH" ]; then
  echo "== compile-check ($ARCH, what the runtime builds here) =="
  python3 -m rawkv.tools.nvrtc_check --arch "$ARCH" > "$OUT/nvrtc_check.log" 2>&1 || status=1
  tail -n 1 "$OUT/nvrtc_check.log"
fi

# A hung kernel would block every later sync and the rest of the run: each
# stage gets a time limit (seconds; the device tool allows 600 per command).
LIMIT=${RAWKV_STAGE_TIMEOUT:-540}

[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && case " $TESTS " in *" tests "*|*" tests/ "*|*test_multi_gpu.py*) ;; *) TESTS="$TESTS tests/test_multi_gpu.py" ;; esac  # 2+ GPUs: the multi-GPU tests join the run, once
echo "== tests: $TESTS =="
# shellcheck disable=SC2086
timeout "$LIMIT" python3 -m pytest -q -rs -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/pytest.log" || status=1

if [ "$BENCH" != none ]; then
  echo "== benchmarks: $BENCH =="
  timeout "$LIMIT" python3 -m rawkv bench --peer --out "$OUT/bench" --only "$BENCH" ${RAWKV_QUICK:+--quick} 2>&1 \
    | tee "$OUT/bench.log" || status=1
fi
echo "gpu_check: exit $status"
exit $status
