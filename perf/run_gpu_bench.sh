#!/usr/bin/env bash
# One device command: engine-only vs tritonserver (stream=false, stream=true) vs transformers
# on the Llama-3-8B shape (perf/bench_gpu_server.py), in under 9 minutes on one H200.
#
#   OUT=$OUT bash perf/run_gpu_bench.sh          # carry build/bundle/part1 (make bundle) in the same call
#
# Installs the bundle's part 1 if the checkout holds it (else it must be installed already),
# then runs the benchmark with profiles/llama3-8b-h200.yaml: 1,024 requests x 128/128,
# 8 client processes. Writes to $OUT: install.log, bench_gpu_server.log,
# bench_gpu_server-llama3-8b-h200.{json,md}, logs/tritonserver-*.log, summary.txt.
# PROFILE=... and BENCH_ARGS="..." change the profile and add options.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
PROFILE="${PROFILE:-profiles/llama3-8b-h200.yaml}"
BENCH_ARGS="${BENCH_ARGS:-}"

note "run_gpu_bench: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $PROFILE"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
install_bundle
# Budget: engine start ~5 s + 1,024 x 128/128 ~10 s, transformers b128 ~30 s, server start
# ~20 s, two server phases ~10-20 s each; the limit leaves room for a slow start.
# PHASES_APART=1 runs the server phases in separate calls (a server each), so that a
# py-spy recording (PYSPY=..., gpu_device_lib.sh) covers one phase: pyspy-nostream-engine.txt,
# pyspy-stream-engine.txt.
if [ "${PHASES_APART:-0}" = 1 ]; then
  record_stubs nostream
  # shellcheck disable=SC2086
  step bench_gpu_server 300 "$PY" -m perf.bench_gpu_server --profile "$PROFILE" --bundle "$PREFIX" \
    --out "$OUT" --server-log-dir "$OUT/logs" --max-seconds 180 --server-timeout 240 --skip transformers,stream $BENCH_ARGS
  stop_recording
  mkdir -p "$OUT/nostream" && mv "$OUT"/bench_gpu_server-*.json "$OUT"/bench_gpu_server-*.md "$OUT/nostream/" 2>/dev/null
  record_stubs stream
  # shellcheck disable=SC2086
  step bench_gpu_server_stream 300 "$PY" -m perf.bench_gpu_server --profile "$PROFILE" --bundle "$PREFIX" \
    --out "$OUT" --server-log-dir "$OUT/logs" --max-seconds 180 --server-timeout 240 --skip engine,transformers,nostream $BENCH_ARGS
  stop_recording
  cat "$OUT"/nostream/bench_gpu_server-*.md 2>/dev/null | sed -n '/^| system/,$p'
else
  # shellcheck disable=SC2086
  step bench_gpu_server 450 "$PY" -m perf.bench_gpu_server --profile "$PROFILE" --bundle "$PREFIX" \
    --out "$OUT" --server-log-dir "$OUT/logs" --max-seconds 180 --server-timeout 240 $BENCH_ARGS
fi

echo
echo "=== summary"
cat "$OUT"/bench_gpu_server-*.md 2>/dev/null | sed -n '/^| system/,$p'
cat "$SUMMARY"
exit $STATUS
