#!/usr/bin/env bash
# A knob of the decode step swept on a 2-GPU host (nvidia-h200-x2): for each setting,
# perf/bench_tp.py --sections decode in a process of its own (TP=1 on GPU 0, then TP=2 on
# GPUs 0,1; the workers inherit the environment). SETTINGS: space-separated settings, each
# comma-separated NAME=VALUE environment variables ("-" for none). Writes to $OUT:
# decode_sweep.md (one line per setting, TP and batch) and decode_sweep.tar.gz (each run's
# json and log).
#   OUT=$OUT SETTINGS="INFLIGHTLLM_GEMV_SPLIT_WAVES=0 INFLIGHTLLM_GEMV_SPLIT_WAVES=1.5" bash perf/run_decode_sweep.sh
set -u
OUT=${OUT:-/tmp/decode-sweep}
SETTINGS=${SETTINGS:--}
ARGS=${ARGS:---sections decode --batches 1,8}
mkdir -p "$OUT/runs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
SUMMARY="$OUT/decode_sweep.md"
printf '| setting | result |\n|---|---|\n' > "$SUMMARY"
index=0
for setting in $SETTINGS; do
  index=$((index + 1))
  vars=()
  [ "$setting" != "-" ] && IFS=, read -r -a vars <<< "$setting"
  log="$OUT/runs/bench_tp-$index.log"
  env "${vars[@]}" timeout ${BENCH_TIMEOUT:-150} python3 -u perf/bench_tp.py $ARGS \
    --out "$OUT/runs/bench_tp-$index.json" > "$log" 2>&1
  echo "[$index] $setting rc=$?"
  grep -E "between tokens" "$log" | while read -r line; do echo "| $setting | $line |" >> "$SUMMARY"; done
  grep -E "between tokens|Traceback|Error" "$log" | head -6
done
tar -czf "$OUT/decode_sweep.tar.gz" -C "$OUT" runs && rm -rf "$OUT/runs"
