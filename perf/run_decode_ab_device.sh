#!/usr/bin/env bash
# One device command: compile-time variants of the decode attention kernels side by side
# (perf/bench_decode_attention.py, each variant in its own process, rounds alternated), then the
# FP8 KV cache's kernel tests (not the engine ones, which need the bundle) under each variant of
# TEST_VARIANTS and, with NCU=1, Nsight Compute on one paged_decode_v5 or v6 launch of the first and
# last variants. Needs only the host's python3 (torch, CuPy, pytest): no bundle.
#
#   OUT=$OUT VARIANTS="- INFLIGHTLLM_DECODE_V5_KV_HEADS=1" bash perf/run_decode_ab_device.sh
#
# A variant is comma-joined VAR=VALUE settings ("-": none); its files are named after it with
# every character but letters, digits, '.', '_' and '-' as '_' (names with '=' do not come back
# from the device). CASES (bench_decode_attention --cases), ROUNDS (default 2), TEST_VARIANTS
# (default: the second variant; "" skips the tests), NCU=1.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT="${OUT:-build/gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VARIANTS="${VARIANTS:--}"
CASES="${CASES:-256x2048,512x1088,32x2048,1x8192}"
ROUNDS="${ROUNDS:-2}"
PY="${PY:-python3}"
read -r -a LIST <<< "$VARIANTS"
TEST_VARIANTS="${TEST_VARIANTS-${LIST[1]:-${LIST[0]}}}"
settings() { [ "$1" = - ] && return 0; echo "$1" | tr ',' ' '; }
safe() { printf '%s' "$1" | tr -c 'A-Za-z0-9._-' '_'; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u '+%Y-%m-%d %H:%M UTC')" | tee -a "$OUT/gpu.txt"
STATUS=0
for round in $(seq "$ROUNDS"); do
  for variant in "${LIST[@]}"; do
    # shellcheck disable=SC2046
    env $(settings "$variant") VARIANT="$variant" timeout 120 "$PY" -m perf.bench_decode_attention --cases "$CASES" \
      2>> "$OUT/bench.err" | tee -a "$OUT/bench.jsonl" || STATUS=1
  done
done
for variant in $TEST_VARIANTS; do
  # shellcheck disable=SC2046
  env $(settings "$variant") timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -x \
    -k "not timings and not tp2 and not engine" tests/gpu/test_fp8_kv_cache.py > "$OUT/tests-$(safe "$variant").log" 2>&1 || STATUS=1
  echo "tests under $variant: $(tail -1 "$OUT/tests-$(safe "$variant").log")"
done
if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  for variant in "${LIST[0]}" "${LIST[${#LIST[@]}-1]}"; do
    # shellcheck disable=SC2046
    env $(settings "$variant") timeout 150 ncu --clock-control none -k regex:paged_decode_v[56] -s 3 -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
      "$PY" -m perf.bench_decode_attention --cases 256x2048 --repeats 4 > "$OUT/ncu-$(safe "$variant").txt" 2>&1 || STATUS=1
    echo "ncu $variant:"
    grep -E "DRAM Throughput|Duration|Achieved Occupancy|Registers Per|L1/TEX Hit|Local Memory Spilling Requests  |Eligible Warps" \
      "$OUT/ncu-$(safe "$variant").txt" | head -12
  done
fi
exit $STATUS
