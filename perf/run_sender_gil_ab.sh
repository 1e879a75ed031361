#!/usr/bin/env bash
# One device command: the stream=true server phase (perf/bench_gpu_server.py, profile
# llama3-8b-h200, 1,024 x 128/128) with and without the response sender's pause, each run
# with its own server, in the order given, plus one engine-only run to compare against:
#   base: the default (no pause); y<us>: INFLIGHTLLM_SENDER_YIELD_US=<us>; w<pieces>:
#   INFLIGHTLLM_PIECE_WINDOW=<pieces> (the backpressure window, inflightllm/piece_ledger.py);
#   m0: INFLIGHTLLM_METRICS_BACKGROUND=0 (finished requests' metrics on the loop's thread);
#   t<ms>: INFLIGHTLLM_PIECE_MAX_WAIT_MS=<ms> (the sender's longest wait for room); pb: postprocessing
#   behind a dynamic batcher (bench_gpu_server.py --postprocessing-dynamic-batching, a measurement switch);
#   i<us>: INFLIGHTLLM_SWITCH_INTERVAL_US=<us> (the engine process's thread switch interval); h0:
#   INFLIGHTLLM_SENDER_HOLD=0 (no holding near the end: inflightllm/serving/engine_loop.py); p<n>:
#   the profile with `instances.postprocessing: n` (bench_gpu_server.py --set). Join
#   variants with '+': pb+i500.
#   PHASES="nostream stream" runs both server phases a variant (default: stream); TRACE=1 writes
#   each variant's engine step trace to $OUT/<variant>/trace (INFLIGHTLLM_STEP_TRACE); SKIP_ENGINE=1
#   leaves out the engine-only run.
#   OUT=$OUT VARIANTS="base y200 base y200" bash perf/run_sender_gil_ab.sh
#   OUT=$OUT PROFILE=profiles/llama3-8b-fp8-h200.yaml VARIANTS="base w16 w32 base" bash perf/run_sender_gil_ab.sh
# Writes $OUT/<variant>/bench_gpu_server-*.{json,md} and $OUT/summary.txt.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
PROFILE="${PROFILE:-profiles/llama3-8b-h200.yaml}"
VARIANTS="${VARIANTS:-base y200 base y200}"
PHASES="${PHASES:-stream}"
case " $PHASES " in *" nostream "*) skip_phases=engine,transformers ;; *) skip_phases=engine,transformers,nostream ;; esac
case " $PHASES " in *" stream "*) ;; *) skip_phases="$skip_phases,stream" ;; esac
note "run_sender_gil_ab: $(date -u '+%Y-%m-%d %H:%M UTC'), $PROFILE, variants: $VARIANTS"
install_bundle
engine_env=()
[ "${TRACE:-0}" = 1 ] && engine_env=(INFLIGHTLLM_STEP_TRACE="$OUT/engine/trace")
[ "${SKIP_ENGINE:-0}" = 1 ] || step engine 200 env "${engine_env[@]}" "$PY" -m perf.bench_gpu_server --profile "$PROFILE" --bundle "$PREFIX" --out "$OUT/engine" \
  --server-log-dir "$OUT/logs" --max-seconds 180 --server-timeout 240 --skip transformers,nostream,stream
for variant in $VARIANTS; do
  env_args=()
  extra=()
  known=1
  for part in ${variant//+/ }; do  # a variant may join several: pb+i500
    case "$part" in
      base) ;;
      pb) extra+=(--postprocessing-dynamic-batching) ;;
      p[0-9]*) extra+=(--set "instances.postprocessing=${part#p}") ;;
      y*) env_args+=(INFLIGHTLLM_SENDER_YIELD_US="${part#y}") ;;
      w*) env_args+=(INFLIGHTLLM_PIECE_WINDOW="${part#w}") ;;
      m0) env_args+=(INFLIGHTLLM_METRICS_BACKGROUND=0) ;;
      h0) env_args+=(INFLIGHTLLM_SENDER_HOLD=0) ;;
      t*) env_args+=(INFLIGHTLLM_PIECE_MAX_WAIT_MS="${part#t}") ;;
      i*) env_args+=(INFLIGHTLLM_SWITCH_INTERVAL_US="${part#i}") ;;
      *) known=0 ;;
    esac
  done
  [ $known = 1 ] || { note "unknown variant $variant"; continue; }
  [ "${TRACE:-0}" = 1 ] && env_args+=(INFLIGHTLLM_STEP_TRACE="$OUT/$variant/trace")
  step "stream-$variant" 200 env "${env_args[@]}" "$PY" -m perf.bench_gpu_server --profile "$PROFILE" --bundle "$PREFIX" \
    --out "$OUT/$variant" --server-log-dir "$OUT/logs-$variant" --max-seconds 180 --server-timeout 240 \
    --skip "$skip_phases" "${extra[@]}"
  mkdir -p "$OUT/$variant/runs" && cp "$OUT/$variant"/bench_gpu_server-*.json "$OUT/$variant/runs/$SECONDS.json" 2>/dev/null
  note "$variant: $(grep -E '^- \((b|c)\)' "$OUT/$variant"/bench_gpu_server-*.md 2>/dev/null | tr '\n' ' ')"
done
echo "=== engine-only"
sed -n '/^| system/,$p' "$OUT"/engine/bench_gpu_server-*.md 2>/dev/null
cat "$SUMMARY"
exit $STATUS
