#!/usr/bin/env bash
# One device command for FP8 (issue 26): GPU tests against the emulation, SmolLM2 perplexity
# on the GPU, and engine-only throughput on TensorRT-LLM's ISL/OSL rows, bf16 vs fp8.
#
#   OUT=$OUT bash perf/run_fp8_device.sh      # carry build/bundle/part1 (make bundle) in the same call
#
# ROWS_ARGS adds options to perf.bench_rows (e.g. "--settings trtllm"), ROWS_LIMIT its seconds (420).
# TESTS, ROWS, VARIANTS, PPL_VARIANTS and SKIP (comma-separated of tests,ppl,decode,lmhead,smallm,rows)
# change what runs (decode: batches 1, 2, 32, 256; lmhead: batch 1 with the e4m3 and the int8 LM head;
# smallm: batches 1-32 with fp8_small_m_gemm up to 0 and 32 (the default) rows);
# V6_STAGES="3 4 2" adds the decode-attention kernel per ring depth (perf.bench_decode_attention),
# GEMV_VARIANTS="- INFLIGHTLLM_FP8_GEMV_U=16 ..." the one-token kernels per variant (perf.bench_small_gemv;
# "-": the defaults; several variables of a variant joined by commas).
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
  step decode_fp8 200 "$PY" perf/bench_gpu.py --sections decode --batches 1,2,32,256 --no-transformers \
    --quantization fp8 --kv-cache-dtype "${DECODE_KV:-auto}" --gpu-memory-utilization 0.9 --out "$OUT/decode_fp8.json" ;;
esac
case ",$SKIP," in *,decode,*|*,lmhead,*) ;; *)
  # The same batch-1 step with the LM head in FP8 too (model.fp8_lm_head), beside the one above,
  step decode_fp8_lm_head 200 "$PY" perf/bench_gpu.py --sections decode --batches 1 --no-transformers \
    --quantization fp8 --fp8-lm-head --kv-cache-dtype "${DECODE_KV:-auto}" --gpu-memory-utilization 0.9 \
    --out "$OUT/decode_fp8_lm_head.json"
  # and with the LM head in int8 (model.int8_lm_head)
  step decode_int8_lm_head 200 "$PY" perf/bench_gpu.py --sections decode --batches 1 --no-transformers \
    --quantization fp8 --int8-lm-head --kv-cache-dtype "${DECODE_KV:-auto}" --gpu-memory-utilization 0.9 \
    --out "$OUT/decode_int8_lm_head.json" ;;
esac
case ",$SKIP," in *,decode,*|*,smallm,*) ;; *)
  # FP8 GEMMs of a few rows on fp8_small_m_gemm up to INFLIGHTLLM_FP8_SMALL_M_ROWS rows, torch._scaled_mm past them
  for setting in 0 32; do
    step "decode_fp8_small_m_$setting" 200 env INFLIGHTLLM_FP8_SMALL_M_ROWS="$setting" "$PY" perf/bench_gpu.py --sections decode \
      --batches 1,2,3,8,16,17,24,32 --no-transformers --quantization fp8 --int8-lm-head --gpu-memory-utilization 0.9 \
      --out "$OUT/decode_fp8_small_m_$setting.json"
  done ;;
esac
case ",$SKIP," in *,rows,*) ;; *)
  # shellcheck disable=SC2086
  step bench_rows "${ROWS_LIMIT:-420}" "$PY" -m perf.bench_rows --profile profiles/llama3-8b-h200.yaml --variants "$VARIANTS" \
    --rows "$ROWS" ${ROWS_ARGS:-} --out "$OUT/bench_rows.json" ;;
esac
for stages in ${V6_STAGES:-}; do
  step "decode_attention_v6_stages_$stages" 90 env INFLIGHTLLM_DECODE_V6_STAGES="$stages" "$PY" -m perf.bench_decode_attention \
    --cases "${ATTN_CASES:-1024x192,512x1152,256x2048,256x3072}" --cache fp8 --label "v6-stages-$stages"
done
for variant in ${GEMV_VARIANTS:-}; do
  settings=(); [ "$variant" != "-" ] && IFS=, read -r -a settings <<< "$variant"
  step "small_gemv_${variant//[^A-Za-z0-9_=]/_}" 90 env "${settings[@]}" "$PY" perf/bench_small_gemv.py --weights fp8 \
    --label "$variant"
done
cat "$SUMMARY"
exit $STATUS
