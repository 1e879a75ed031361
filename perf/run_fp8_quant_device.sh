#!/usr/bin/env bash
# One device command for the FP8 activation-quantizing kernels (docs/QUANTIZATION.md): their GPU
# tests against the unfused ops (tests/gpu/test_fp8_gpu.py -k quantizing), each kernel alone
# (perf.bench_fp8_quant, JSON lines in $OUT/quant.jsonl), with NCU=1 Nsight Compute on one launch
# of SiLU*mul's version 2 and TMA version at 16,384 rows, then, with ROWS set, bench rows
# alternated INFLIGHTLLM_FP8_SILU_TMA=0 / 1 for ROUNDS rounds (default 1).
#
#   OUT=$OUT bash perf/run_fp8_quant_device.sh                                  # carry build/bundle/part1
#   OUT=$OUT NCU=1 ROWS=128/128x1024,2048/128x512 ROUNDS=2 bash perf/run_fp8_quant_device.sh
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
note "run_fp8_quant_device: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
install_bundle
step quant_tests 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider -k quantizing tests/gpu/test_fp8_gpu.py
step quant_bench 180 "$PY" -m perf.bench_fp8_quant --rows "${QUANT_ROWS:-256,1024,4096,16384}"
grep '^{' "$OUT/quant_bench.log" >> "$OUT/quant.jsonl"
if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
  for kernel in silu-v2 silu-tma; do
    timeout 150 ncu --clock-control none -k regex:silu_and_mul_fp8 -s 2 -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section SchedulerStats \
      "$PY" -m perf.bench_fp8_quant --rows 16384 --kernels "$kernel" --launches 1 --iters 1 > "$OUT/ncu-$kernel.txt" 2>&1
    note "ncu $kernel: $(grep -E 'DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Eligible Warps|Block Limit' \
      "$OUT/ncu-$kernel.txt" | tr -s ' ' | tr '\n' ';')"
  done
fi
if [ -n "${ROWS:-}" ]; then
  for round in $(seq "${ROUNDS:-1}"); do
    for tma in 0 1; do
      step "rows_tma${tma}_r$round" 300 env INFLIGHTLLM_FP8_SILU_TMA=$tma "$PY" -m perf.bench_rows \
        --profile profiles/llama3-8b-h200.yaml --variants fp8 --rows "$ROWS" --out "$OUT/rows_tma${tma}_r$round.json"
      grep -E '^fp8 ' "$OUT/rows_tma${tma}_r$round.log" | sed "s/^/tma=$tma round $round: /" >> "$SUMMARY"
    done
  done
fi
cat "$SUMMARY"
exit $STATUS
