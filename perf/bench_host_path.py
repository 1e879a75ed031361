"""Host CPU per generated token of the engine process, without Triton: the dummy engine.

    OMP_NUM_THREADS=1 .venv/bin/python -m perf.bench_host_path [--mode engine|loop] [--stream]
        [--requests 512] [--input-len 32] [--output-len 128] [--runs 3] [--cprofile DIR]

Two modes over `profiles/dummy-engine-cpu.yaml` (no model compute):
- `engine`: what engine-only `LLM.generate` pays: `Engine.step()` in a loop until every
  request finished (scheduler, step description, the dummy runner, emit). Printed with
  `Engine.host_seconds`-like parts measured around the step.
- `loop`: what the engine model's stub pays besides the IPC itself: the `EngineLoop`
  thread, its `ResponseSender` thread building every response's tensors and DLPack
  capsules (`TritonSink.send` less `pb_utils`), and `EngineMetrics.update` after every
  step over a `pb_utils` whose metric calls do nothing.

All requests are submitted at once (distinct prompts, `min_tokens = max_tokens`). The
figure is the process's CPU time (`time.process_time`, all threads) from the first
submission to the last final output, divided by the generated tokens; every request is
checked to have produced exactly `output_len` tokens. As in the engine model, the objects
built before the run are frozen out of the garbage collector's scans (`gc.freeze`). `--cprofile DIR` writes a cProfile
of each thread (`engine.prof`, `loop.prof`, `sender.prof`) of the last run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from torch.utils.dlpack import to_dlpack  # noqa: E402

from inflightllm.engine import Engine  # noqa: E402
from inflightllm.metrics import EngineMetrics  # noqa: E402
from inflightllm.profile import load_profile  # noqa: E402
from inflightllm.sampling_params import SamplingParams  # noqa: E402
from inflightllm.serving.engine_io import EngineRequest  # noqa: E402
from inflightllm.serving.engine_loop import EngineLoop  # noqa: E402

PROFILE = REPO_ROOT / "profiles" / "dummy-engine-cpu.yaml"


class _NullMetric:
    def set(self, value):
        pass

    def increment(self, value):
        pass

    def observe(self, value):
        pass


class _NullFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

    def __init__(self, name, description, kind):
        pass

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        return _NullMetric()


class _NullPbUtils:
    MetricFamily = _NullFamily


class _Sink:
    """TritonSink without Triton: the DLPack capsules are made, nothing is sent."""

    def __init__(self, done):
        self.done = done
        self.tokens = 0  # output ids received (a shape, not a read of the data: cheap)

    def send(self, tensors, final):
        capsules = [to_dlpack(tensor) for tensor in tensors.values()]
        del capsules
        self.tokens += tensors["output_ids"].shape[1]
        if final:
            self.done(self)

    def send_error(self, message):
        raise RuntimeError(message)

    def is_cancelled(self):
        return False


def _prompts(count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True)


def _engine() -> Engine:
    profile = load_profile(PROFILE)
    engine = Engine(profile.model, profile.engine)
    # As the engine model's `initialize` does (model_repo/engine/1/model.py): what exists
    # now is never rescanned by the garbage collector.
    gc.collect()
    gc.freeze()
    return engine


def run_engine(args, profiler: cProfile.Profile | None) -> dict:
    engine = _engine()
    prompts = _prompts(args.requests, args.input_len)
    counts: dict[str, int] = {}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profiler:
        profiler.enable()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, _params(args.output_len), streaming=args.stream)
    steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            counts[output.request_id] = counts.get(output.request_id, 0) + len(output.new_token_ids)
        steps += 1
    if profiler:
        profiler.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    _check(counts, args)
    return {"cpu_s": cpu, "wall_s": wall, "steps": steps}


def run_loop(args, profilers: dict[str, cProfile.Profile] | None) -> dict:
    engine = _engine()
    metrics = EngineMetrics(_NullPbUtils, model_name="engine")

    def on_step(stats, outputs):
        metrics.update(stats, outputs)

    loop = EngineLoop(engine, on_step=on_step)
    if profilers:
        for name, thread in (("loop", loop._thread), ("sender", loop._sender._thread)):
            target = thread._target

            def profiled(target=target, profiler=profilers[name]):
                profiler.enable()
                try:
                    target()
                finally:
                    profiler.disable()

            thread._target = profiled
    loop.start()
    finished = threading.Event()
    sinks: list[_Sink] = []
    lock = threading.Lock()
    remaining = [args.requests]

    def done(sink):
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                finished.set()

    prompts = _prompts(args.requests, args.input_len)
    requests = [
        EngineRequest(prompt_token_ids=prompt, params=_params(args.output_len), priority=0,
                      streaming=args.stream, echo_prompt=False)
        for prompt in prompts
    ]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for request in requests:
        sink = _Sink(done)
        sinks.append(sink)
        loop.submit(request, sink)
    finished.wait()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    steps = engine.stats().num_steps_total
    loop.stop()
    _check({str(i): sink.tokens for i, sink in enumerate(sinks)}, args)
    return {"cpu_s": cpu, "wall_s": wall, "steps": steps, "responses": loop._sender.responses_sent}


def _check(counts: dict[str, int], args) -> None:
    if len(counts) != args.requests or any(count != args.output_len for count in counts.values()):
        bad = sum(1 for count in counts.values() if count != args.output_len)
        raise SystemExit(f"lost tokens: {len(counts)} requests reported, {bad} with a wrong count")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("engine", "loop"), default="loop")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cprofile", type=Path, default=None, help="folder for cProfile files of the last run")
    args = parser.parse_args()
    tokens = args.requests * args.output_len
    per_token = []
    for run in range(args.runs):
        last = run == args.runs - 1
        if args.mode == "engine":
            profiler = cProfile.Profile() if (args.cprofile and last) else None
            result = run_engine(args, profiler)
            profilers = {"engine": profiler} if profiler else {}
        else:
            profilers = {"loop": cProfile.Profile(), "sender": cProfile.Profile()} if (args.cprofile and last) else {}
            result = run_loop(args, profilers or None)
        us = result["cpu_s"] / tokens * 1e6
        per_token.append(us)
        extra = f", {result['responses']} responses" if "responses" in result else ""
        print(f"run {run + 1}: {us:.2f} us CPU per token ({result['cpu_s']:.3f} CPU-s, {result['wall_s']:.3f} s wall,"
              f" {result['steps']} steps{extra})", flush=True)
        if profilers:
            args.cprofile.mkdir(parents=True, exist_ok=True)
            for name, profiler in profilers.items():
                profiler.dump_stats(args.cprofile / f"{name}.prof")
    print(f"mode={args.mode} stream={args.stream} requests={args.requests} in={args.input_len} "
          f"out={args.output_len}: median {statistics.median(per_token):.2f} us CPU per token "
          f"(min {min(per_token):.2f}, max {max(per_token):.2f}, {args.runs} runs)")


if __name__ == "__main__":
    main()
