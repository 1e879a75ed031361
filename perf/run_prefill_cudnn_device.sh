#!/usr/bin/env bash
# One device command for the prefill attention's dense cuDNN segments (issue 26;
# backend.plan_prefill_segments): the probe of cuDNN vs flash varlen over prompt shapes (first
# call and steady ms), one layer's prefill attention with the threshold and without
# (perf.bench_prefill_attention, FP8 and bf16 caches), bench rows with the default threshold and with it off
# (INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN=0), then the GPU tests that take the dense path.
#
#   OUT=$OUT bash perf/run_prefill_cudnn_device.sh                   # carry build/bundle/part1
#   OUT=$OUT SKIP=probe,layer MIN_LENS=default PADS="256 0" bash perf/run_prefill_cudnn_device.sh
#
# SHAPES (probe), ROWS (bench rows, fp8), MIN_LENS (thresholds to bench; "default" = unset), PADS
# (INFLIGHTLLM_PREFILL_CUDNN_PAD values to bench after them: unaligned whole prompts padded for cuDNN),
# TESTS_K (pytest -k over the three test files), PROFILE_STEPS (bench rows' profiler windows),
# SKIP (comma-separated of probe,layer,rows,tests).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
SHAPES="${SHAPES:-8x2048,7x2048,1x2048,2x4096,1x8192,16x1024,32x512,3x600,64x256,128x128}"
ROWS="${ROWS:-2048/128x512}"
MIN_LENS="${MIN_LENS:-default 0}"
SKIP="${SKIP:-}"
note "run_prefill_cudnn_device: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
install_bundle
case ",$SKIP," in *,probe,*) ;; *)
  step probe 120 "$PY" -m perf.probe_prefill_attention --shapes "$SHAPES" --candidates flash-varlen,sdpa-cudnn
  grep '^{' "$OUT/probe.log" >> "$SUMMARY" ;;
esac
case ",$SKIP," in *,layer,*) ;; *)
  for cache in fp8 bf16; do
    step "layer_$cache" 120 "$PY" -m perf.bench_prefill_attention --cache "$cache"
    grep '^{' "$OUT/layer_$cache.log" >> "$SUMMARY"
  done ;;
esac
case ",$SKIP," in *,rows,*) ;; *)
  # One bench per setting: "label setting" (setting "-": none).
  runs=()
  for min_len in $MIN_LENS; do
    if [ "$min_len" = default ]; then runs+=("min$min_len -"); else runs+=("min$min_len INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN=$min_len"); fi
  done
  for pad in ${PADS:-}; do runs+=("pad$pad INFLIGHTLLM_PREFILL_CUDNN_PAD=$pad"); done
  for run in "${runs[@]}"; do
    label="${run%% *}"; setting="${run#* }"; [ "$setting" = - ] && setting=""
    # shellcheck disable=SC2086
    step "rows_$label" 240 env $setting "$PY" -m perf.bench_rows --profile profiles/llama3-8b-h200.yaml \
      --variants fp8 --rows "$ROWS" --profile-steps "${PROFILE_STEPS:-0}" --out "$OUT/rows_$label.json"
    grep -E 'output tok/s|padded lengths|profile of|^   ' "$OUT/rows_$label.log" | sed "s/^/  [$label] /" >> "$SUMMARY"
  done ;;
esac
case ",$SKIP," in *,tests,*) ;; *)
  step gpu_tests 270 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs \
    -k "${TESTS_K:-cudnn or prefill_8b or prefill_only or mixed_batch or bf16}" \
    tests/gpu/test_cuda_attention.py tests/gpu/test_fp8_kv_cache.py tests/gpu/test_gpu_engine.py
  note "  tests: $(tail -1 "$OUT/gpu_tests.log")" ;;
esac
cat "$SUMMARY"
exit $STATUS
