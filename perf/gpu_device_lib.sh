# Sourced by perf/run_gpu_bench.sh and perf/run_gpu_experiments.sh (bash; `set -u` there).
# On the air-gapped GPU host: installs the bundle's part 1 when it is in the checkout
# (idempotent: tools/bundle_install.py copies and installs only what is missing), sets the
# environment the server and the clients need, and runs steps under `timeout`.
#
# Environment: OUT (where logs and results go; default build/gpu-out), INFLIGHTLLM_BUNDLE_PREFIX
# (default ~/inflightllm-bundle), INSTALL_BUNDLE=0 (do not run part 1's installer).

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/build/gpu-out}"
mkdir -p "$OUT"
PREFIX="${INFLIGHTLLM_BUNDLE_PREFIX:-$HOME/inflightllm-bundle}"
PY="$PREFIX/venv/bin/python"
export INFLIGHTLLM_BUNDLE_PREFIX="$PREFIX"
# The tokenizer (SmolLM2's, for the random-weight shapes) comes with part 1 into the bundle's cache.
export INFLIGHTLLM_CACHE_DIR="${INFLIGHTLLM_CACHE_DIR:-$PREFIX/cache}"
export PYTHONPATH="$REPO"
# NVLink multicast stays off for every NCCL user (it can put shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
STATUS=0

note() { echo "$*" | tee -a "$SUMMARY"; }

install_bundle() {
  # Part 1 holds the server, tritonclient, perf_analyzer, NumPy 1.26 and the tokenizer.
  # INSTALL_BUNDLE=0: use the prefix as it is.
  if [ "${INSTALL_BUNDLE:-1}" != 0 ] && [ -f build/bundle/part1/install.sh ]; then
    timeout -k 10 120 bash build/bundle/part1/install.sh --prefix "$PREFIX" > "$OUT/install.log" 2>&1
    local rc=$?
    tail -8 "$OUT/install.log"
    [ $rc -eq 0 ] || { note "install: FAILED (status $rc, see install.log)"; exit 1; }
  fi
  for need in "$PY" "$PREFIX/tritonserver/bin/tritonserver" "$PREFIX/venv-np1/bin/python"; do
    [ -e "$need" ] || { note "install: $need is missing: carry build/bundle/part1 (make bundle) in this call"; exit 1; }
  done
  note "bundle: $PREFIX ($(ls "$PREFIX/.installed" 2>/dev/null | tr '\n' ' '))"
}

# GPU processes of ours still alive after a step (their executable under the bundle
# prefix: tritonserver and its Python backend stubs): a server orphaned by a step killed
# with SIGKILL would hold the GPU from the next step. They are ended by their id. (`timeout`
# signals the step's whole process group; the server has its own session.)
end_leftover_gpu_processes() {
  command -v nvidia-smi > /dev/null || return 0
  local pid exe left=""
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
    case "$exe" in
      "$PREFIX"/*) left="$left $pid" ;;
    esac
  done
  [ -z "$left" ] && return 0
  note "  leftover GPU process(es)$left after the step: ending them"
  kill -TERM $left 2>/dev/null; sleep 5; kill -KILL $left 2>/dev/null; sleep 1
  return 0
}

# step NAME SECONDS COMMAND...: runs COMMAND under `timeout` (SIGINT first, so that Python
# stops its servers on the way out; SIGKILL 30 s later), output in $OUT/NAME.log.
step() {
  local name="$1" limit="$2"
  shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit} s): $*"
  timeout -s INT -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  tail -25 "$OUT/$name.log"
  if [ $rc -eq 0 ]; then
    note "$name: OK in ${took} s"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    note "$name: TIMED OUT after ${took} s (limit ${limit} s; log $name.log)"
    STATUS=1
  else
    note "$name: FAILED with status $rc after ${took} s (log $name.log)"
    STATUS=1
  fi
  end_leftover_gpu_processes
  return 0
}

# PYSPY=/path/to/py-spy (a static binary; carry it, e.g. build/tools/py-spy): record_stubs
# LABEL starts a watcher in the background that attaches py-spy to each Python backend stub
# of the next server as it appears and records it until it exits (CPU samples of every
# thread, collapsed stacks: $OUT/pyspy-LABEL-<model>.txt, for flame graphs or a grep).
# stop_recording ends the watcher. PYSPY_ARGS adds options (e.g. --gil, --native). Without
# PYSPY both do nothing.
record_stubs() {
  [ -n "${PYSPY:-}" ] && [ -x "$PYSPY" ] || return 0
  local label="$1"
  (
    local seen="" pid model
    for _ in $(seq 1 1800); do
      for pid in $(pgrep -f triton_python_backend_stub 2>/dev/null); do
        case " $seen " in *" $pid "*) continue ;; esac
        model="$(tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null | sed -n 2p | xargs -r dirname | xargs -r dirname | xargs -r basename)"
        [ -n "$model" ] || continue
        seen="$seen $pid"
        "$PYSPY" record --pid "$pid" --rate 100 --threads --nonblocking --format raw ${PYSPY_ARGS:-} \
          -o "$OUT/pyspy-$label-$model.txt" > "$OUT/pyspy-$label-$model.log" 2>&1 &
      done
      sleep 0.5
    done
  ) &
  RECORDER=$!
}

stop_recording() {
  [ -n "${RECORDER:-}" ] || return 0
  kill "$RECORDER" 2>/dev/null
  RECORDER=""
  sleep 2  # the py-spy processes write their files when their stubs exit
}
