"""Sequence groups on one GPU (issue 29's goals), engine-only, in one run:

- beam search: 256 requests x beam_width 4, 128/128, against 1,024 independent greedy
  requests of the same lengths (wall time ratio; goal <= 1.3);
- parallel sampling: P prompts of 2,048 tokens with n=8 sampled outputs of 128 tokens,
  against the same 8 x P sequences as separate requests on an engine without the prefix
  cache (output tokens/s ratio; goal >= 5).

Prints the figures and saves them as JSON (`--out`), with the engine's host time per step
by part for each run (`host_ms_per_step`: schedule, launch, wait, emit and, within emit,
beam: the beam steps; on the CPU, where the loop is synchronous, the engine's time outside
the runner instead). Usage on the GPU host:
    python -m perf.bench_sequence_groups --out $OUT/sequence_groups.json
A CPU check at toy sizes: --shape tiny-llama3 --device cpu --scale 0.01
The host path of beam search on a CPU (model compute negligible at a 1,024-token vocabulary):
    python -m perf.bench_sequence_groups --shape tiny-llama3-v1k --device cpu --dtype float32 \
        --scale 0.25 --beam-only
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import time
from pathlib import Path

import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import ModelSpec
from inflightllm.sampling_params import SamplingParams
from inflightllm.sequence_group import GroupParams
from perf.bench_gpu import host_ms_per_step, prompts_of, reset_host_times, sync


class TimedRunner:
    """The engine's runner with the seconds spent in it counted (a synchronous CPU runner:
    the rest of a step is the engine's host time)."""

    def __init__(self, runner):
        self.runner = runner
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, step):
        start = time.perf_counter()
        try:
            return self.runner.execute(step)
        finally:
            self.seconds += time.perf_counter() - start

    def launch(self, step):
        start = time.perf_counter()
        try:
            return self.runner.launch(step)
        finally:
            self.seconds += time.perf_counter() - start


def drive(engine: Engine, requests: list[tuple[list[int], SamplingParams, GroupParams | None]], tag: str) -> dict:
    """Submit every request at once and step to the end: wall seconds, output tokens (every
    sequence's), KV figures."""
    sync()
    reset_host_times(engine.host_seconds)
    timed = engine.runner if isinstance(engine.runner, TimedRunner) else None
    if timed is not None:
        timed.seconds = 0.0
    steps_before = engine.stats().num_steps_total
    start = time.perf_counter()
    for index, (prompt, params, group) in enumerate(requests):
        engine.add_request(f"{tag}-{index}", prompt, params, group=group)
    tokens = 0
    peak_used = 0
    decode_from = None  # (time, steps) at the first step with no prompt tokens and nothing waiting
    while engine.has_unfinished():
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"{tag}: {output.error}")
            tokens += len(output.new_token_ids)
        peak_used = max(peak_used, engine.block_manager.num_used_blocks)
        if decode_from is None and not engine.scheduler.waiting:
            now = engine.stats()
            if 0 < now.num_tokens_last_step <= len(engine.scheduler.running):
                decode_from = (time.perf_counter(), now.num_steps_total)
    sync()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    steps = stats.num_steps_total - steps_before
    host = host_ms_per_step(engine.host_seconds)
    if timed is not None:  # synchronous: everything but the runner is the engine's host time
        host["outside_runner"] = round((seconds - timed.seconds) * 1e3 / max(1, steps), 3)
        host["beam"] = round(engine.host_seconds["beam"] * 1e3 / max(1, steps), 3)
        host["steps"] = steps
    phases = {}
    if decode_from is not None:  # the prefill phase (prompts, with decodes beside them) and the decode-only one
        decode_s = time.perf_counter() - decode_from[0]
        decode_steps = stats.num_steps_total - decode_from[1]
        phases = {"until_decode_only_s": round(decode_from[0] - start, 3), "decode_only_s": round(decode_s, 3),
                  "decode_only_steps": decode_steps,
                  "decode_only_ms_per_step": round(decode_s * 1e3 / max(1, decode_steps), 2)}
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "output_tok_s": round(tokens / seconds, 1),
            "peak_kv_blocks_used": peak_used, "preemptions_total": stats.num_preemptions_total,
            "steps": steps, "host_ms_per_step": host, **phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--scale", type=float, default=1.0, help="multiply request counts and lengths (CPU checks)")
    parser.add_argument("--prompts", type=int, default=64, help="P: prompts of the n=8 workload")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.44)
    parser.add_argument("--beam-only", action="store_true", help="skip the n=8 part")
    parser.add_argument("--n8-only", action="store_true",
                        help="the n=8 run alone (no beam part, no other cascade mode, no separate requests): "
                             "what perf/run_kv_pressure_device.sh's groups-pyspy step records")
    parser.add_argument("--profile", action="store_true",
                        help="the n=8 workload once more (other prompts) under the torch profiler: GPU busy "
                             "time and time by kind of kernel (perf.bench_gpu.profile_run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    def scaled(value: int) -> int:
        return max(1, int(value * args.scale))

    spec = ModelSpec(source="random", shape=args.shape, seed=0, dtype=args.dtype)
    length, beams, greedy_count = scaled(128), scaled(256), scaled(1024)
    long_prompt, prompts = scaled(2048), max(1, int(args.prompts * args.scale))
    config = EngineConfig(
        device=args.device, gpu_ids=(0,) if args.device == "gpu" else (), max_batch_size=1024,
        max_num_tokens=16384, max_input_length=max(long_prompt, length), max_output_len=length,
        gpu_memory_utilization=args.gpu_memory_utilization, async_scheduling=args.device == "gpu",
        max_beam_width=8, max_n=8, enable_kv_cache_reuse=True,
        **({} if args.device == "gpu" else {"num_kv_blocks": 4096}),
    )
    report: dict = {"shape": args.shape, "dtype": args.dtype, "device": args.device, "date": time.strftime("%Y-%m-%d"),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    engine = Engine(spec, config, sampler_seed=0)
    if args.device == "cpu":
        engine.runner = TimedRunner(engine.runner)
    vocab = engine.vocab_size
    drive(engine, [(p, SamplingParams(max_tokens=min(8, length), ignore_eos=True), None)
                   for p in prompts_of(32, min(16, long_prompt), vocab, 1)],
          "warm-up")

    # ---- beam search vs independent greedy requests
    if not args.n8_only:
        greedy = drive(engine, [(p, SamplingParams(max_tokens=length, ignore_eos=True), None)
                                for p in prompts_of(greedy_count, length, vocab, 2)], "greedy")
        beam = drive(engine, [(p, SamplingParams(max_tokens=length, ignore_eos=True), GroupParams(beam_width=4))
                              for p in prompts_of(beams, length, vocab, 3)], "beam")
        report["beam_search"] = {"greedy_requests": greedy_count, "beam_requests": beams, "beam_width": 4,
                                 "isl": length, "osl": length, "greedy": greedy, "beam": beam,
                                 "wall_ratio": round(beam["seconds"] / greedy["seconds"], 3), "goal": "<= 1.3"}
        print(f"beam search: {beams} x beam_width 4 in {beam['seconds']:.2f} s; {greedy_count} greedy in "
              f"{greedy['seconds']:.2f} s: ratio {report['beam_search']['wall_ratio']:.3f} (goal <= 1.3)", flush=True)
        for name, run in (("greedy", greedy), ("beam", beam)):
            print(f"  {name}: {run['steps']} steps, host ms per step {run['host_ms_per_step']}", flush=True)
    if args.beam_only:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
        return 0

    # ---- n=8 over long prompts vs 8 separate requests without the prefix cache
    texts = prompts_of(prompts, long_prompt, vocab, 4)
    sampled = SamplingParams(max_tokens=length, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    runner = getattr(engine.runner, "runner", engine.runner)  # the GPU runner (TimedRunner wraps the CPU's)
    has_cascade = hasattr(runner, "cascade_mode")
    mode = getattr(runner, "cascade_mode", None)
    if has_cascade:  # cascade decode (INFLIGHTLLM_CASCADE_DECODE) as auto decides, then off
        runner.cascade_mode = "auto"
    cascade_before = getattr(runner, "cascade_steps", 0)
    graph_before = getattr(runner, "cascade_graph_steps", 0)
    groups = drive(engine, [(p, sampled, GroupParams(n=8)) for p in texts], "n8")
    groups["cascade_steps"] = getattr(runner, "cascade_steps", 0) - cascade_before
    groups["cascade_graph_steps"] = getattr(runner, "cascade_graph_steps", 0) - graph_before
    plain = None
    other_mode = "off" if groups["cascade_steps"] else "always"
    if args.n8_only:
        print(f"n=8 over {prompts} prompts of {long_prompt}: {groups['output_tok_s']:.0f} output tok/s; cascade "
              f"decode in {groups['cascade_steps']} of {groups['steps']} steps ({groups['cascade_graph_steps']} as "
              f"CUDA graphs); {groups.get('decode_only_ms_per_step', 0):.1f} ms a decode step; host ms per step "
              f"{groups['host_ms_per_step']}", flush=True)
        return 0
    if has_cascade:
        # The same workload (other prompts: the prefix cache holds the first ones) with cascade
        # decode as auto did not decide: off (each sequence reads the shared prompt itself)
        # when auto used it, else always.
        runner.cascade_mode = other_mode
        before = runner.cascade_steps
        plain = drive(engine, [(p, sampled, GroupParams(n=8)) for p in prompts_of(prompts, long_prompt, vocab, 5)],
                      f"n8-cascade-{other_mode}")
        plain["cascade_mode"] = other_mode
        plain["cascade_steps"] = runner.cascade_steps - before
        runner.cascade_mode = mode
    if args.profile and torch.cuda.is_available():
        from perf.bench_gpu import profile_run

        runner.cascade_mode = "auto"
        report["profile_n8"] = profile_run(
            lambda engine=engine: drive(engine, [(p, sampled, GroupParams(n=8))
                                                for p in prompts_of(prompts, long_prompt, vocab, 6)],
                          "n8-profile"), "n=8, cascade auto")
        runner.cascade_mode = mode
    del engine, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    separate_engine = Engine(spec, dataclasses.replace(config, enable_kv_cache_reuse=False), sampler_seed=0)
    separate = drive(separate_engine, [(p, dataclasses.replace(sampled, seed=7 + i), None)
                                       for p in texts for i in range(8)], "separate")
    report["parallel_sampling"] = {"prompts": prompts, "n": 8, "isl": long_prompt, "osl": length,
                                   "groups": groups, f"groups_cascade_{other_mode}": plain,
                                   "separate_no_prefix_cache": separate,
                                   "throughput_ratio": round(groups["output_tok_s"] / separate["output_tok_s"], 3),
                                   "goal": ">= 5"}
    print(f"n=8 over {prompts} prompts of {long_prompt}: {groups['output_tok_s']:.0f} output tok/s "
          f"(peak {groups['peak_kv_blocks_used']} blocks); 8 separate requests each, no prefix cache: "
          f"{separate['output_tok_s']:.0f} (peak {separate['peak_kv_blocks_used']} blocks): ratio "
          f"{report['parallel_sampling']['throughput_ratio']:.2f} (goal >= 5); cascade decode in "
          f"{groups['cascade_steps']} of {groups['steps']} steps ({groups['cascade_graph_steps']} as CUDA graphs)"
          + (f"; cascade {other_mode}: {plain['output_tok_s']:.0f} tok/s ({plain['cascade_steps']} cascade steps)"
             if plain else ""), flush=True)
    for name, run in (("groups", groups), (f"cascade {other_mode}", plain), ("separate", separate)):
        if run and "decode_only_s" in run:
            print(f"  {name}: {run['until_decode_only_s']:.2f} s until decode alone, then {run['decode_only_s']:.2f} s "
                  f"({run['decode_only_steps']} steps, {run['decode_only_ms_per_step']:.1f} ms a step); "
                  f"host ms per step {run['host_ms_per_step']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
