#!/usr/bin/env bash
# One device command for FP8 (issue 26): GPU tests against the emulation, SmolLM2 perplexity
# on the GPU, and engine-only throughput on TensorRT-LLM's ISL/OSL rows, bf16 vs fp8.
#
#   OUT=$OUT bash perf/run_fp8_device.sh      # carry build/bundle/part1 (make bundle) in the same call
#
# TESTS, ROWS, VARIANTS, PPL_VARIANTS and SKIP (comma-separated of tests,ppl,decode,rows) change what runs.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
TESTS="${TESTS:-tests/gpu/test_fp8_gpu.py}"
ROWS="${ROWS:-128/128x1024,2048/128x512}"
VARIANTS="${VARIANTS:-bf16,fp8}"
PPL_VARIANTS="${PPL_VARIANTS:-base,fp8,fp8-kv}"
SKIP="${SKIP:-}"
note "run_fp8_device: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
install_bundle
case ",$SKIP," in *,tests,*) ;; *)
  # shellcheck disable=SC2086
  step gpu_tests "${TESTS_LIMIT:-300}" "$PY" -m pytest -m gpu -q -p no:cacheprovider -k "${TESTS_K:-not tp2}" $TESTS ;;
esac
case ",$SKIP," in *,ppl,*) ;; *)
  step perplexity 200 "$PY" -m perf.perplexity --device gpu --variants "$PPL_VARIANTS" --out "$OUT/perplexity.json" ;;
esac
case ",$SKIP," in *,decode,*) ;; *)
  step decode_fp8 200 "$PY" perf/bench_gpu.py --sections decode --batches 1,32,256 --no-transformers \
    --quantization fp8 --kv-cache-dtype "${DECODE_KV:-auto}" --gpu-memory-utilization 0.9 --out "$OUT/decode_fp8.json" ;;
esac
case ",$SKIP," in *,rows,*) ;; *)
  step bench_rows 420 "$PY" -m perf.bench_rows --profile profiles/llama3-8b-h200.yaml --variants "$VARIANTS" \
    --rows "$ROWS" --out "$OUT/bench_rows.json" ;;
esac
cat "$SUMMARY"
exit $STATUS
