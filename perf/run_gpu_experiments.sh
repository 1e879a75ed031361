#!/usr/bin/env bash
# One device command: the four server experiments and the perf_analyzer sweep on the
# Llama-3-8B shape (profiles/llama3-8b-h200.yaml), each step bounded, in under 9 minutes on
# one H200 (7 server starts of ~20 s each are a good part of it).
#
#   OUT=$OUT bash perf/run_gpu_experiments.sh    # carry build/bundle/part1 (make bundle) in the same call
#
# Installs the bundle's part 1 if the checkout holds it, then runs
#   python -m perf.experiments inflight-vs-static | prefix-cache | dynamic-batching | triton-vs-engine
#   python -m perf.perf_analyzer_sweep
# with the bundle's server, tokenizer venv and perf_analyzer, at sizes cut from the GPU
# defaults of perf/experiments.py to fit the time. Writes to $OUT: <step>.log, each
# result's .json and .md (and PNGs when matplotlib is there: if not, render them here with
# `python -m perf.plots --from-json $OUT/*.json --out-dir DIR`), logs/tritonserver-*.log,
# summary.txt. SMOKE=1 runs every step at tiny sizes (a check of this script on a CPU
# profile: PROFILE=profiles/smollm2-cpu.yaml).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
PROFILE="${PROFILE:-profiles/llama3-8b-h200.yaml}"
NAME="$(basename "$PROFILE" .yaml)"
COMMON=(--profile "$PROFILE" --bundle "$PREFIX" --server-log-dir "$OUT/logs" --no-progress)

if [ "${SMOKE:-0}" = 1 ]; then
  INFLIGHT=(--num-requests 4 --concurrency 2 --input-len 8 --short-len 2 --long-len 6 --max-seconds 120)
  PREFIX_CACHE=(--num-requests 4 --concurrency 2 --input-len 8 --output-len 2 --prefix-len 32 --max-seconds 120)
  DYNAMIC=(--num-requests 16 --max-seconds 60)
  TVE=(--num-requests 4 --input-len 8 --output-len 4 --max-seconds 120)
  SWEEP=(--concurrency-range 1:2 --request-count 2 --timeout 240)
  LIMITS=(600 600 600 600 600)
else
  # inflight-vs-static: static batches of 64 wait for their longest request (1 in 10 is
  # long), so the long length sets the static run's time: ~4 batches x 800 steps.
  INFLIGHT=(--num-requests 256 --concurrency 64 --long-len 800 --max-seconds 75)
  # prefix-cache: with the cache off every request prefills 2,048 + 128 tokens.
  PREFIX_CACHE=(--num-requests 160 --concurrency 64 --max-seconds 50)
  # dynamic-batching: 1,000 unary preprocessing calls per concurrency, then 512 ensemble requests.
  DYNAMIC=(--num-requests 1000 --max-seconds 30)
  # triton-vs-engine: 512 requests x 512/256 through the server, then the engine in-process.
  TVE=(--num-requests 512 --max-seconds 60)
  # perf_analyzer: concurrency 8, 48, 88, 128; windows of 128 finished requests (32-token
  # chat answers), three per point.
  SWEEP=(--concurrency-range 8:128:40 --request-count 128 --timeout 55)
  # Seconds per step; with the install (at most 120 s, ~15 s in practice) under 9 minutes.
  LIMITS=(150 95 80 100 85)
fi

# INFLIGHT_ARGS="--num-requests 768 ..." and INFLIGHT_LIMIT=240 replace the in-flight step's sizes and limit.
if [ -n "${INFLIGHT_ARGS:-}" ]; then read -ra INFLIGHT <<< "$INFLIGHT_ARGS"; fi
LIMITS[0]="${INFLIGHT_LIMIT:-${LIMITS[0]}}"

note "run_gpu_experiments: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $PROFILE"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
install_bundle
# STEPS="inflight-vs-static prefix-cache" runs only those steps (default: all five).
STEPS="${STEPS:-inflight-vs-static prefix-cache dynamic-batching triton-vs-engine perf-analyzer}"
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) echo "skipped: $1" | tee -a "$SUMMARY"; return 1 ;; esac; }
want inflight-vs-static && step inflight-vs-static "${LIMITS[0]}" "$PY" -m perf.experiments inflight-vs-static "${COMMON[@]}" \
  --out "$OUT/inflight-vs-static-$NAME" "${INFLIGHT[@]}"
want prefix-cache && step prefix-cache "${LIMITS[1]}" "$PY" -m perf.experiments prefix-cache "${COMMON[@]}" \
  --out "$OUT/prefix-cache-$NAME" "${PREFIX_CACHE[@]}"
want dynamic-batching && step dynamic-batching "${LIMITS[2]}" "$PY" -m perf.experiments dynamic-batching "${COMMON[@]}" \
  --out "$OUT/dynamic-batching-$NAME" "${DYNAMIC[@]}"
want triton-vs-engine && step triton-vs-engine "${LIMITS[3]}" "$PY" -m perf.experiments triton-vs-engine "${COMMON[@]}" \
  --out "$OUT/triton-vs-engine-$NAME" "${TVE[@]}"
want perf-analyzer && step perf-analyzer "${LIMITS[4]}" "$PY" -m perf.perf_analyzer_sweep --profile "$PROFILE" --bundle "$PREFIX" \
  --server-log-dir "$OUT/logs" --out "$OUT/perf-analyzer-$NAME" "${SWEEP[@]}"

echo
echo "=== summary"
for md in "$OUT"/inflight-vs-static-*.md "$OUT"/prefix-cache-*.md "$OUT"/triton-vs-engine-*.md; do
  [ -f "$md" ] || continue
  echo "--- $(basename "$md")"
  # The comparison paragraph (before the load generator's table).
  sed -n '/^| batching |\|^| prefix cache | load |\|^| system | requests |/,/^$/p' "$md"
  grep -E "^(In-flight / static|On / off|Triton / engine-only)" "$md"
done
for md in "$OUT"/dynamic-batching-*.md "$OUT"/perf-analyzer-*.md; do
  [ -f "$md" ] || continue
  echo "--- $(basename "$md")"
  sed -n '/^| concurrency/,/^$/p' "$md"
done
cat "$SUMMARY"
exit $STATUS
