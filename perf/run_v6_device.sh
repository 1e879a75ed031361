#!/usr/bin/env bash
# One device command for paged_decode_v6 (issue 26; docs/CUDA-KERNELS.md): the FP8 KV cache's GPU
# tests in full (kernels, engine, timings; v6 beside v5 in each), one layer's decode attention
# under v5 (auto), v6 and v6 with a ring of 4 pages (perf.bench_decode_attention, JSON lines
# gathered in $OUT/decode.jsonl), then, with ROWS set, bench rows under v5 and under v6.
#
#   OUT=$OUT bash perf/run_v6_device.sh                                  # carry build/bundle/part1
#   OUT=$OUT ROWS=128/128x1024,2048/2048x256 bash perf/run_v6_device.sh
#   OUT=$OUT ROWS=... ROW_VARIANTS="auto v5" ROWS_V5=128/2048x512 bash perf/run_v6_device.sh
#
# CASES (bench_decode_attention --cases), TESTS_K (pytest -k; default "not tp2").
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
CASES="${CASES:-1024x192,512x1152,256x2048,256x3072,32x2048,8x4096,1x8192}"
note "run_v6_device: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
install_bundle
step gpu_tests 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -k "${TESTS_K:-not tp2}" tests/gpu/test_fp8_kv_cache.py
for variant in v5 v6 v6-stages4; do
  case "$variant" in
    v5) settings="INFLIGHTLLM_DECODE_IMPL=v5" ;;
    v6) settings="INFLIGHTLLM_DECODE_IMPL=v6" ;;
    *) settings="INFLIGHTLLM_DECODE_IMPL=v6 INFLIGHTLLM_DECODE_V6_STAGES=4" ;;
  esac
  # shellcheck disable=SC2086
  step "decode_$variant" 120 env $settings VARIANT="$variant" "$PY" -m perf.bench_decode_attention --cases "$CASES"
  grep '^{' "$OUT/decode_$variant.log" >> "$OUT/decode.jsonl"
done
# ROWS: bench rows (fp8 variant) for each of ROW_VARIANTS (auto: the engine's choice; default
# "v5 v6"); ROWS_V5 (optional): other rows for v5.
if [ -n "${ROWS:-}" ]; then
  for variant in ${ROW_VARIANTS:-v5 v6}; do
    rows="$ROWS"
    [ "$variant" = v5 ] && rows="${ROWS_V5:-$ROWS}"
    step "rows_$variant" 330 env INFLIGHTLLM_DECODE_IMPL="$variant" "$PY" -m perf.bench_rows \
      --profile profiles/llama3-8b-h200.yaml --variants fp8 --rows "$rows" --out "$OUT/rows_$variant.json"
  done
fi
cat "$SUMMARY"
exit $STATUS
