#!/usr/bin/env bash
# One device command for issue 27 (KV pressure, host KV tier, GPU sampler) and the sequence
# groups of issue 29, on one H200: GPU tests, the sampler micro-benchmark, the rows under
# each capacity policy / preemption mode, sampled rows against greedy, the multi-turn chat
# workload with and without the host tier, beam search and n=8.
#
#   OUT=$OUT STEPS="tests,sampler,sampled" bash perf/run_kv_pressure_device.sh   # carry build/bundle/part1
#
# STEPS (comma-separated): tests, sampler, sampled, pressure, multiturn, groups (GROUPS_ARGS, e.g.
# --profile), groups-pyspy (the n=8 run under py-spy; carry build/tools/py-spy), guided and guided-pyspy (carry build/bundle/part2/guided.tar.xz too; guided-pyspy
# also build/tools/py-spy; guided-server: the burst through tritonserver). POLICIES,
# MODES and PRESSURE_ROWS choose the pressure step's variants (bench_rows options); VARIANTS
# (bench_rows --variants, e.g. fp8-kv: bf16 weights with an FP8 KV cache).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_device_lib.sh"
STEPS="${STEPS:-tests,sampler,sampled}"
PROFILE="${PROFILE:-profiles/llama3-8b-h200.yaml}"
note "run_kv_pressure_device: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), steps $STEPS"
install_bundle
has() { case ",$STEPS," in *,"$1",*) return 0 ;; esac; return 1; }
if has tests; then
  step gpu_tests "${TESTS_LIMIT:-240}" "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    ${TESTS:-tests/gpu/test_gpu_sampler.py tests/gpu/test_host_kv_tier_gpu.py tests/gpu/test_sequence_groups_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_kv_cache.py tests/gpu/test_gpu_engine.py} \
    -k "${TESTS_K:-not tp2}"
fi
if has sampler; then
  git show 67ab833:inflightllm/gpu/sampler.py > "$OUT/old_sampler.py" 2>/dev/null || true
  step bench_sampler 120 "$PY" -m perf.bench_sampler --baseline "$OUT/old_sampler.py" --out "$OUT/sampler.json"
fi
if has sampled; then
  step sampled_rows 200 "$PY" -m perf.bench_rows --profile "$PROFILE" --rows 128/128x1024 \
    --sampling greedy,sampled,sampled-penalty --out "$OUT/sampled_rows.json"
fi
if has pressure; then
  step pressure_rows "${PRESSURE_LIMIT:-540}" "$PY" -m perf.bench_rows --profile "$PROFILE" \
    --rows "${PRESSURE_ROWS:-128/2048x512,2048/2048x256}" --capacity-policy "${POLICIES:-max_utilization}" \
    --preemption-mode "${MODES:-auto,recompute}" ${VARIANTS:+--variants "$VARIANTS"} --out "$OUT/pressure_rows.json"
fi
if has multiturn; then
  step multiturn "${MULTITURN_LIMIT:-240}" "$PY" -m perf.bench_multiturn --shape llama3-8b --device gpu \
    ${MULTITURN_ARGS:-} --out "$OUT/multiturn.json"
fi
if has groups; then
  step bench_groups "${GROUPS_LIMIT:-270}" "$PY" -m perf.bench_sequence_groups ${GROUPS_ARGS:-} --out "$OUT/sequence_groups.json"
fi
if has groups-pyspy; then
  # bench_sequence_groups' n=8 run alone under py-spy (PYSPY, as guided-pyspy): the engine
  # thread's host time a decode step, collapsed stacks for a grep.
  step groups_pyspy "${PYSPY_LIMIT:-200}" "${PYSPY:-build/tools/py-spy}" record --threads --rate 100 --format raw \
    --nonblocking -o "$OUT/pyspy-groups.txt" -- "$PY" -m perf.bench_sequence_groups --n8-only ${GROUPS_ARGS:-} \
    --out "$OUT/groups-pyspy.json"
fi
if has guided || has guided-pyspy || has guided-server; then
  # xgrammar and jsonschema from the bundle's part 2 (carry build/bundle/part2/guided.tar.xz),
  # into the bundle's venv (the engine) and its NumPy 1 venv (preprocessing checks the specs)
  for python in "$PY" "$PREFIX/venv-np1/bin/python"; do
    if ! "$python" -c "import xgrammar, jsonschema" 2> /dev/null && [ -f build/bundle/part2/guided.tar.xz ]; then
      tar -xJf build/bundle/part2/guided.tar.xz -C "$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    fi
  done
fi
if has guided; then
  step bench_guided "${GUIDED_LIMIT:-300}" "$PY" -m perf.bench_guided ${GUIDED_ARGS:-} --out "$OUT/guided.json"
fi
if has guided-pyspy; then
  # The throughput runs only (no compile or burst run) under py-spy (PYSPY: a static binary,
  # carry it, e.g. build/tools/py-spy): every thread's Python stacks, collapsed, for a grep.
  step guided_pyspy "${PYSPY_LIMIT:-200}" "${PYSPY:-build/tools/py-spy}" record --threads --rate 100 --format raw \
    --nonblocking -o "$OUT/pyspy-guided.txt" -- "$PY" -m perf.bench_guided --schemas 1 --burst 0 ${GUIDED_ARGS:-} \
    --out "$OUT/guided-pyspy.json"
fi
if has guided-server; then
  # Issue 28's burst through tritonserver (the profile's whole ensemble, the bundle's server).
  step guided_server "${GUIDED_SERVER_LIMIT:-300}" "$PY" -m perf.bench_guided --server --bundle "$PREFIX" \
    --profile "$PROFILE" ${GUIDED_SERVER_ARGS:-} --out "$OUT/guided-server.json"
  end_leftover_gpu_processes
fi
cat "$SUMMARY"
exit $STATUS
