#!/usr/bin/env bash
# The TP decode step on a 2-GPU host (nvidia-h200-x2): perf/bench_tp.py --sections decode
# (TP=1 on GPU 0, then TP=2 on GPUs 0,1, asynchronous scheduling as the GPU profiles run),
# once plain, then once under py-spy (every process: rank 0 and the worker) for where the
# host time goes. Writes to $OUT: bench_tp_decode.{json,log}, and with PYSPY set (a py-spy
# binary, e.g. build/tools/py-spy) pyspy_tp_decode.raw (collapsed stacks) and its log.
#   OUT=$OUT PYSPY=$PWD/build/tools/py-spy bash perf/run_tp_decode_profile.sh
set -u
OUT=${OUT:-/tmp/tp-decode}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export INFLIGHTLLM_TP_TIMING=1 PYTHONPATH=$PWD
ARGS=${ARGS:---sections decode --batches 1,8}
timeout ${BENCH_TIMEOUT:-200} python3 -u perf/bench_tp.py $ARGS --out "$OUT/bench_tp_decode.json" \
  > "$OUT/bench_tp_decode.log" 2>&1
echo "bench rc=$?"
grep -E "between tokens|host ms|Traceback|Error" "$OUT/bench_tp_decode.log" | head -20
if [ -n "${PYSPY:-}" ]; then
  timeout ${BENCH_TIMEOUT:-200} "$PYSPY" record --subprocesses --rate 1000 --format raw \
    -o "$OUT/pyspy_tp_decode.raw" -- python3 -u perf/bench_tp.py $ARGS --out "$OUT/bench_tp_decode_pyspy.json" \
    > "$OUT/bench_tp_decode_pyspy.log" 2>&1
  echo "py-spy rc=$?"
  grep -E "between tokens" "$OUT/bench_tp_decode_pyspy.log" | head
fi
