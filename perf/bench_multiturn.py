"""Multi-turn chat through a small GPU KV cache, with and without the host KV tier
(issue 27; docs/HOST-KV-TIER.md), engine-only, in one run.

C conversations of T turns: a shared system prompt of S tokens, then per turn a user
message of U tokens appended to the conversation's history (the prompt is the whole
history plus the new message) and O generated tokens appended to it. A closed loop keeps
`--concurrency` turns in flight; a conversation whose turn ends queues its next turn at the
back, so the conversations interleave and their contexts together (the working set) exceed
the GPU cache, sized to `--gpu-cache-fraction` of the working set. Without the tier, a
conversation's history is evicted before its next turn and recomputed; with it (sized to
hold the whole working set unless `--host-kv-blocks` says otherwise), it comes back from
host memory.

Reports per engine: prefix-hit tokens (device and host), host copies each way, TTFT
p50 / p90 (all turns, and turns 2..T), total seconds; and the ratio TTFT p50 with / without
(goal <= 0.5 at a GPU cache of a third of the working set). Prints and saves JSON (`--out`).

On the GPU host (random weights of the Llama-3.1-8B shape):
    python -m perf.bench_multiturn --shape llama3-8b --device gpu --out $OUT/multiturn.json
On CPU: --profile profiles/smollm2-cpu.yaml (SmolLM2), or --shape tiny-llama3 --device cpu
with small sizes (`make bench-multiturn`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import time
from collections import deque
from pathlib import Path

import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import ModelSpec, kv_element_bytes, model_dims
from inflightllm.sampling_params import SamplingParams
from perf.bench_gpu import prompts_of, sync


@dataclasses.dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    output_tokens: int
    concurrency: int

    @property
    def final_context(self) -> int:
        """Tokens of a conversation after its last turn (its share of the working set)."""
        return self.system_tokens + self.turns * (self.user_tokens + self.output_tokens)

    def working_set_blocks(self, block_size: int) -> int:
        return self.conversations * math.ceil(self.final_context / block_size)


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (values non-empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def run_chats(engine: Engine, workload: Workload, vocab: int, tag: str, seed: int = 0) -> dict:
    """Drive the closed loop to the end; TTFT per turn (the engine's: arrival to the first
    sampled token), prefix-cache and host-tier counters, wall seconds. The token ids come
    from `seed` (the warm-up uses another seed, so it shares no prefix with the run)."""
    system = prompts_of(1, workload.system_tokens, vocab, seed=seed)[0] if workload.system_tokens else []
    messages = [prompts_of(workload.turns, workload.user_tokens, vocab, seed=seed + 1 + c)
                for c in range(workload.conversations)]
    histories = [list(system) for _ in range(workload.conversations)]
    next_turn = [0] * workload.conversations
    ready = deque(range(workload.conversations))
    in_flight: dict[str, tuple[int, int]] = {}  # request id -> (conversation, turn)
    outputs: dict[str, list[int]] = {}
    ttft: list[tuple[int, float]] = []  # (turn, seconds)
    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True)
    before = engine.stats()
    host_before = dict(engine.host_seconds)
    step_seconds: list[float] = []  # each engine.step() call's wall time (where a TTFT goes)
    sync()
    start = time.perf_counter()
    while ready or in_flight:
        while ready and len(in_flight) < workload.concurrency:
            conversation = ready.popleft()
            turn = next_turn[conversation]
            prompt = histories[conversation] + messages[conversation][turn]
            request_id = f"{tag}-c{conversation}-t{turn}"
            histories[conversation] = prompt
            engine.add_request(request_id, prompt, params)
            in_flight[request_id] = (conversation, turn)
            outputs[request_id] = []
        stepped = time.perf_counter()
        step_outputs = engine.step()
        step_seconds.append(time.perf_counter() - stepped)
        for output in step_outputs:
            if output.error is not None:
                raise RuntimeError(f"{tag}: {output.error}")
            request_id = output.request_id
            conversation, turn = in_flight[request_id]
            outputs[request_id].extend(output.new_token_ids)
            if output.finished:
                del in_flight[request_id]
                ttft.append((turn, output.time_to_first_token))
                histories[conversation] = histories[conversation] + outputs[request_id]
                next_turn[conversation] += 1
                if next_turn[conversation] < workload.turns:
                    ready.append(conversation)
    sync()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    all_turns = [s for _, s in ttft]
    later = [s for turn, s in ttft if turn > 0] or all_turns
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    host_hits = stats.prefix_cache_host_hits - before.prefix_cache_host_hits
    return {
        "seconds": round(seconds, 3),
        "requests": len(ttft),
        "prompt_tokens": stats.prompt_tokens_total - before.prompt_tokens_total,
        "prefix_hit_tokens": hits,
        "prefix_hit_tokens_gpu": hits - host_hits,
        "prefix_hit_tokens_host": host_hits,
        "ttft_p50_ms": round(1000 * percentile(all_turns, 0.5), 2),
        "ttft_p90_ms": round(1000 * percentile(all_turns, 0.9), 2),
        "ttft_p50_ms_turns_2_on": round(1000 * percentile(later, 0.5), 2),
        "ttft_p90_ms_turns_2_on": round(1000 * percentile(later, 0.9), 2),
        "host_offloaded_blocks": stats.host_kv_offloaded_blocks_total - before.host_kv_offloaded_blocks_total,
        "host_onloaded_blocks": stats.host_kv_onloaded_blocks_total - before.host_kv_onloaded_blocks_total,
        "host_offloaded_bytes": stats.host_kv_offloaded_bytes_total - before.host_kv_offloaded_bytes_total,
        "host_onloaded_bytes": stats.host_kv_onloaded_bytes_total - before.host_kv_onloaded_bytes_total,
        "host_blocks_held": stats.host_kv_blocks_held,
        "preemptions": stats.num_preemptions_total - before.num_preemptions_total,
        "step_calls": len(step_seconds),
        "step_ms_p50": round(1000 * percentile(step_seconds, 0.5), 2) if step_seconds else None,
        "step_ms_p90": round(1000 * percentile(step_seconds, 0.9), 2) if step_seconds else None,
        "step_ms_max": round(1000 * max(step_seconds), 2) if step_seconds else None,
        "ttft_p50_ms_by_turn": {turn: round(1000 * percentile([s for t, s in ttft if t == turn], 0.5), 2)
                                for turn in sorted({t for t, _ in ttft})},
        # The engine's own host seconds by part over the run (async scheduling: schedule,
        # launch, wait for the device, emit), in ms per step.
        "host_ms_per_step": {key: round(1000 * (value - host_before.get(key, 0.0)) / max(1, len(step_seconds)), 3)
                             for key, value in engine.host_seconds.items() if key != "steps"},
        "outputs": [outputs[key] for key in sorted(outputs)],
    }


def release_device_memory() -> None:
    """Give the first engine's KV cache back (CuPy's pool holds it until told)."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        except ImportError:
            pass
        torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=None,
                        help="a profile YAML for the model and engine settings (e.g. profiles/smollm2-cpu.yaml); "
                             "else --shape with random weights")
    parser.add_argument("--shape", default="llama3-8b", help="random weights of this shape (without --profile)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--conversations", type=int, default=32, help="C")
    parser.add_argument("--turns", type=int, default=6, help="T")
    parser.add_argument("--system-tokens", type=int, default=256, help="S: a system prompt every conversation shares")
    parser.add_argument("--user-tokens", type=int, default=384, help="U: tokens of each user message")
    parser.add_argument("--output-tokens", type=int, default=64, help="O: tokens generated per turn")
    parser.add_argument("--concurrency", type=int, default=8, help="turns in flight at once (closed loop)")
    parser.add_argument("--gpu-cache-fraction", type=float, default=0.33,
                        help="device KV blocks as a fraction of the working set's blocks")
    parser.add_argument("--host-kv-blocks", type=int, default=0,
                        help="host tier blocks (0: as many as the working set's blocks)")
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-outputs", action="store_true", help="save the generated token ids in the JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    workload = Workload(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.output_tokens,
                        args.concurrency)
    if min(workload.conversations, workload.turns, workload.user_tokens, workload.output_tokens,
           workload.concurrency) < 1:
        raise SystemExit("--conversations, --turns, --user-tokens, --output-tokens and --concurrency must be >= 1")
    if not 0.0 < args.gpu_cache_fraction <= 1.0:
        raise SystemExit(f"--gpu-cache-fraction {args.gpu_cache_fraction}: allowed greater than 0 and at most 1")
    context = workload.final_context
    if args.profile is not None:
        from inflightllm.profile import load_profile

        profile = load_profile(args.profile)
        spec, base = profile.model, profile.engine
    else:
        spec = ModelSpec(source="random", shape=args.shape, seed=0, dtype=args.dtype)
        base = EngineConfig(device=args.device, gpu_ids=(0,) if args.device == "gpu" else (),
                            async_scheduling=args.device == "gpu")
    block_size = base.block_size
    working_set = workload.working_set_blocks(block_size)
    one_request = math.ceil(context / block_size)
    gpu_blocks = max(math.ceil(args.gpu_cache_fraction * working_set), one_request + 1)
    host_blocks = args.host_kv_blocks or working_set
    dims = model_dims(spec)
    bytes_per_block = block_size * dims.kv_bytes_per_token(kv_element_bytes(spec.dtype, base.kv_cache_dtype),
                                                           base.tensor_parallel_size)
    config = dataclasses.replace(
        base, num_kv_blocks=gpu_blocks, enable_kv_cache_reuse=True, host_kv_cache_bytes=0,
        max_batch_size=max(base.max_batch_size, workload.concurrency), max_num_tokens=args.max_num_tokens,
        max_input_length=max(base.max_input_length, context), max_output_len=max(base.max_output_len,
                                                                                 workload.output_tokens),
    )
    report: dict = {
        "model": spec.shape if spec.source == "random" else str(args.profile), "dtype": spec.dtype,
        "device": config.device, "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if config.device == "gpu" and torch.cuda.is_available() else None,
        "workload": dataclasses.asdict(workload), "block_size": block_size,
        "working_set_blocks": working_set, "gpu_kv_blocks": gpu_blocks,
        "gpu_cache_fraction": round(gpu_blocks / working_set, 3), "host_kv_blocks": host_blocks,
        "bytes_per_block": bytes_per_block,
    }
    print(f"{workload.conversations} conversations x {workload.turns} turns (S={workload.system_tokens}, "
          f"U={workload.user_tokens}, O={workload.output_tokens}, concurrency {workload.concurrency}): working set "
          f"{working_set} blocks; GPU cache {gpu_blocks} blocks ({report['gpu_cache_fraction']:.2f}), host tier "
          f"{host_blocks} blocks ({host_blocks * bytes_per_block / 2**30:.2f} GiB)", flush=True)

    warm = Workload(2, 2, 0, min(16, workload.user_tokens), 2, 2)  # kernels, graphs, allocator
    first = Engine(spec, config, sampler_seed=0)
    loaded = first.loaded
    run_chats(first, warm, first.vocab_size, "warm", seed=7)
    without = run_chats(first, workload, first.vocab_size, "chat", seed=1000)
    del first
    release_device_memory()
    second = Engine(spec, dataclasses.replace(config, host_kv_cache_bytes=host_blocks * bytes_per_block),
                    sampler_seed=0, loaded=loaded)
    if second.block_manager.host_tier is None:
        raise SystemExit(f"the engine made no host KV tier of {host_blocks} blocks (a runner without one?)")
    run_chats(second, warm, second.vocab_size, "warm", seed=7)
    with_tier = run_chats(second, workload, second.vocab_size, "chat", seed=1000)
    same = without.pop("outputs") == with_tier.pop("outputs")
    report["without_host_tier"] = without
    report["with_host_tier"] = with_tier
    report["greedy_outputs_equal"] = same
    report["ttft_p50_ratio"] = round(with_tier["ttft_p50_ms"] / without["ttft_p50_ms"], 3)
    report["ttft_p50_ratio_turns_2_on"] = round(with_tier["ttft_p50_ms_turns_2_on"] / without["ttft_p50_ms_turns_2_on"],
                                                3)
    report["goal"] = "ttft_p50_ratio <= 0.5"
    for name, row in (("without host tier", without), ("with host tier", with_tier)):
        print(f"{name:>18}: TTFT p50 {row['ttft_p50_ms']:.1f} ms, p90 {row['ttft_p90_ms']:.1f} ms (turns 2+: p50 "
              f"{row['ttft_p50_ms_turns_2_on']:.1f} ms); prefix hits {row['prefix_hit_tokens']} tokens (GPU "
              f"{row['prefix_hit_tokens_gpu']}, host {row['prefix_hit_tokens_host']}) of {row['prompt_tokens']}; "
              f"host copies out {row['host_offloaded_blocks']} / back {row['host_onloaded_blocks']} blocks; "
              f"{row['seconds']:.2f} s", flush=True)
    print(f"TTFT p50 with / without: {report['ttft_p50_ratio']:.3f} (turns 2+: {report['ttft_p50_ratio_turns_2_on']:.3f}; "
          f"goal <= 0.5); greedy outputs equal: {same}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
