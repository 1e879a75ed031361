#!/usr/bin/env bash
# One run on a 2-GPU host (nvidia-h200-x2): the TP GPU tests, then perf/bench_tp.py.
# Logs and JSON go to $OUT; a short table is printed last.
set -u
OUT=${OUT:-/tmp/tp-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export INFLIGHTLLM_TP_TIMING=1 INFLIGHTLLM_CACHE_DIR=${INFLIGHTLLM_CACHE_DIR:-$PWD/.devcache} PYTHONPATH=$PWD
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count())'; } > "$OUT/machine.txt" 2>&1
timeout ${PYTEST_TIMEOUT:-150} python3 -u -m pytest -v -p no:cacheprovider tests/gpu/test_tp_gpu.py > "$OUT/pytest_tp_gpu.log" 2>&1
echo "pytest tests/gpu/test_tp_gpu.py rc=$?"
timeout ${BENCH_TIMEOUT:-330} python3 -u perf/bench_tp.py --sections ${SECTIONS:-exact,decode,profile,throughput,dp,failure} \
  --out "$OUT/bench_tp.json" > "$OUT/bench_tp.log" 2>&1
echo "bench rc=$?"
grep -E "Error|error|Traceback" "$OUT/bench_tp.log" | head -20
tail -4 "$OUT/pytest_tp_gpu.log"
head -3 "$OUT/machine.txt"
python3 - "$OUT/bench_tp.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no bench JSON:", e); raise SystemExit
print(json.dumps({k: v for k, v in r.items() if k not in ("decode_ms",)}, indent=1)[:3000])
d = r.get("decode_ms", {})
print("| measure | TP=1 | TP=2 | TP=2/TP=1 |")
for b, v in d.items():
    t1, t2 = v.get("tp1"), v.get("tp2")
    print(f"| decode step {b} (ms) | {t1} | {t2} | {t2 / t1:.3f} |" if t1 and t2 else f"| decode {b} | {t1} | {t2} | - |")
tp2 = r.get("throughput_tp2", {}).get("output_tokens_per_s")
dp2 = r.get("throughput_dp2", {}).get("output_tokens_per_s")
print(f"| 1024 x 128/128 output tok/s | TP=2: {tp2} | 2 DP engines: {dp2} | |")
print("| NCCL worker kill |", r.get("failure_nccl"), "|")
PY
