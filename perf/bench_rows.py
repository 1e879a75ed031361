"""Engine-only throughput on TensorRT-LLM's ISL/OSL rows, for any profile.

The rows (input length / output length x requests, all submitted at once, greedy,
`ignore_eos`) are those of TensorRT-LLM's published H200 performance table, with its
FP8 figures beside ours:

    128/128 x 1,024      27,911 output tok/s
    2048/128 x 512        3,538
    128/2048 x 512       26,221
    2048/2048 x 256      12,194

`--rows trtllm` runs the same four rows at the request counts TensorRT-LLM's overview itself
used for them (its "Reproducing" section: 30,000 / 3,000 / 3,000 / 1,500, enough for a
steady state where requests leave and join every step); the default counts above are
issue 26's. `--settings trtllm` gives each row the max batch size and token budget that
`trtllm-bench` derives for it (`trtllm_settings`: from the requests the KV cache holds at
ISL + OSL, capped at 4,096, the budget from the batch and ISL/OSL), where `fixed` (the
default) runs every row at `--max-batch-size` / `--max-num-tokens`. The JSON and the table
say the counts and the settings of every row.

The engine is built from the profile with `--max-batch-size` / `--max-num-tokens`
overrides (defaults 1,024 and 16,384, as the issue measured), and optionally
`--quantization` / `--kv-cache-dtype` overrides, so that bf16 and fp8 of one profile
compare in one run (`--variants bf16,fp8`). Per row: output tok/s, wall seconds,
preemptions, recomputed tokens (and their % of the generated ones), swapped blocks and
bytes, steps. A warm-up of 64 short requests runs first.

KV pressure (docs/KV-PRESSURE.md): `--capacity-policy`, `--preemption-mode` and
`--kv-watermark` take comma lists; every combination runs on the same loaded engine
(`Engine.reconfigure`: a fresh block manager and scheduler, an empty prefix cache), so
guaranteed_no_evict and max_utilization, or recompute, swap and auto, compare in one run.
`--profile-steps N` runs each greedy row a second time with the torch profiler on for N
steps from its start and N from its middle: where the time goes (GPU time by kind of kernel,
GPU busy against wall time, host time by phase). `--sampling greedy,sampled,sampled-penalty`
runs each row with each sampling (sampled:
temperature 0.8, top_p 0.95, top_k 50; sampled-penalty: the same + repetition_penalty 1.1
and 5 top log probs), on prompts of their own (no prefix-cache hit across them), and
prints the throughput ratio to greedy.

    python -m perf.bench_rows --profile profiles/llama3-8b-h200.yaml --variants bf16,fp8 --out $OUT/rows.json
    python -m perf.bench_rows --profile profiles/llama3-8b-h200.yaml --capacity-policy max_utilization,guaranteed_no_evict \
        --preemption-mode recompute,auto --sampling greedy,sampled,sampled-penalty --out $OUT/pressure.json
    python -m perf.bench_rows --profile profiles/smollm2-cpu.yaml --rows 16/8x8 --max-batch-size 8   # CPU check

Prints a table; `--out` saves the figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import logging
import math
import platform
import time
from pathlib import Path

import torch

from inflightllm.config import CAPACITY_POLICIES, PREEMPTION_MODES, capacity_policy_name
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.profile import load_profile
from inflightllm.sampling_params import SamplingParams
from perf.bench_gpu import kernel_report, prompts_of, sync

ROWS = "128/128x1024,2048/128x512,128/2048x512,2048/2048x256"
# --rows trtllm: the four rows at the request counts of TensorRT-LLM's performance overview
# (prepare_dataset.py --num-requests per ISL/OSL), all submitted at once as there.
NAMED_ROWS = {"trtllm": "128/128x30000,2048/128x3000,128/2048x3000,2048/2048x1500"}
# TensorRT-LLM's published H200 figures (FP8, its performance overview), output tok/s.
PUBLISHED = {(128, 128): 27911, (2048, 128): 3538, (128, 2048): 26221, (2048, 2048): 12194}
# (weights quantization, KV cache dtype): fp8-kv keeps bf16 weights with an FP8 KV cache.
VARIANTS = {"bf16": (None, "auto"), "fp8": ("fp8", "fp8"), "fp8-weights": ("fp8", "auto"), "fp8-kv": (None, "fp8")}
# --sampling: the rows' requests sampled each way (all with ignore_eos, so every row generates
# the same number of tokens).
SAMPLINGS = {
    "greedy": {},
    "sampled": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "sampled-penalty": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1,
                        "logprobs": True, "top_logprobs": 5},
}


def parse_rows(text: str) -> list[tuple[int, int, int]]:
    """ISL/OSLxREQUESTS items, comma-separated, or a name of NAMED_ROWS."""
    rows = []
    for item in NAMED_ROWS.get(text.strip(), text).split(","):
        try:
            lengths, count = item.strip().split("x")
            isl, osl = lengths.split("/")
            rows.append((int(isl), int(osl), int(count)))
        except ValueError:
            raise SystemExit(f"--rows: {item!r} is not ISL/OSLxREQUESTS (e.g. 128/128x1024) or one of "
                             f"{', '.join(NAMED_ROWS)}") from None
    return rows



def parse_list(text: str | None, option: str, allowed: tuple | None = None, kind=str) -> list:
    """A comma list of an option; [None] when not given (the profile's setting)."""
    if text is None:
        return [None]
    values = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = kind(item)
            if option == "--capacity-policy":
                value = capacity_policy_name(value)
        except ValueError:
            raise SystemExit(f"{option}: {item!r} is not allowed; allowed: "
                             f"{', '.join(allowed) if allowed else 'numbers'}") from None
        if allowed is not None and value not in allowed:
            raise SystemExit(f"{option}: {item!r} is not allowed; allowed: {', '.join(allowed)}")
        values.append(value)
    return values


def trtllm_settings(kv_tokens: int, isl: int, osl: int) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) for a row as trtllm-bench picks them (one GPU, no
    pipeline stages): the requests of ISL + OSL tokens the KV cache holds, at most 4,096,
    rounded up to a multiple of 32 (at least 64) under 256, of 128 under 1,024, else of 256;
    the budget those requests x (1 + ISL/OSL), at most 32,768, rounded up to a multiple of 256
    (at least 2,048) under 4,096, of 512 under 8,192, else of 1,024."""
    requests = min(kv_tokens / (isl + osl), 4096)
    tokens = min(requests * (1 + isl / osl), 32768)
    batch = _round_up(requests, 64, ((256, 32), (1024, 128), (math.inf, 256)))
    return batch, _round_up(tokens, 2048, ((4096, 256), (8192, 512), (math.inf, 1024)))


def _round_up(value: float, least: int, rungs: tuple[tuple[float, int], ...]) -> int:
    """`value` rounded up to a multiple of the first rung's step whose bound it is under, at least `least`."""
    step = next(step for bound, step in rungs if value < bound)
    return max(least, step * math.ceil(value / step))


def run_row(engine: Engine, llm: LLM, isl: int, osl: int, count: int, sampling: str = "greedy") -> dict:
    # Each sampling gets prompts of its own: no prefix-cache hit from the sampling before it.
    offset = list(SAMPLINGS).index(sampling) * 1000
    prompts = prompts_of(count, isl, engine.vocab_size, seed=isl * 7 + osl + offset)
    params = SamplingParams(max_tokens=osl, ignore_eos=True, **SAMPLINGS[sampling])
    before = engine.stats()
    sync()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    after = engine.stats()
    generated = sum(len(r.token_ids) for r in results)
    if generated != count * osl:
        raise RuntimeError(f"row {isl}/{osl}x{count}: {generated} tokens generated, expected {count * osl}")
    recomputed = after.num_recomputed_tokens_total - before.num_recomputed_tokens_total
    row = {
        "isl": isl, "osl": osl, "requests": count, "sampling": sampling, "seconds": round(seconds, 3),
        "output_tok_s": round(generated / seconds, 1),
        "preemptions": after.num_preemptions_total - before.num_preemptions_total,
        "swap_preemptions": after.num_swapped_out_total - before.num_swapped_out_total,
        "recomputed_tokens": recomputed,
        "recomputed_pct_of_generated": round(100.0 * recomputed / generated, 2),
        "swapped_out_blocks": after.num_swapped_out_blocks_total - before.num_swapped_out_blocks_total,
        "swapped_in_blocks": after.num_swapped_in_blocks_total - before.num_swapped_in_blocks_total,
        "swapped_out_bytes": after.swapped_out_bytes_total - before.swapped_out_bytes_total,
        "swapped_in_bytes": after.swapped_in_bytes_total - before.swapped_in_bytes_total,
        "steps": after.num_steps_total - before.num_steps_total,
        "max_batch_size": engine.config.max_batch_size, "max_num_tokens": engine.config.max_num_tokens,
    }
    published = PUBLISHED.get((isl, osl))
    if published:
        row["trtllm_published_fp8"] = published
        row["vs_published"] = round(row["output_tok_s"] / published, 3)
    return row


def profile_row(engine: Engine, isl: int, osl: int, count: int, window: int, total_steps: int) -> dict:
    """The row again (prompts of its own), stepped here, with the torch profiler on for two
    windows of `window` steps: from the first step (prefill and its first decodes) and from
    the middle of the `total_steps` the timed run took. Per window: wall and GPU-busy time a
    step, GPU time by kind of kernel (bench_gpu.kernel_report), the engine's host time a
    step by phase (schedule, launch, wait for the GPU, emit) and the tokens computed a step."""
    from torch.profiler import ProfilerActivity, profile

    prompts = prompts_of(count, isl, engine.vocab_size, seed=isl * 7 + osl + 500)
    params = SamplingParams(max_tokens=osl, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{isl}-{osl}-{i}", prompt, params)
    middle = max(window, total_steps // 2)
    starts = {0: "first steps", middle: "middle steps"}
    reports, step, active = {}, 0, None
    while engine.has_unfinished():
        if step in starts and active is None:
            sync()
            prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
            prof.__enter__()
            host = dict(engine.host_seconds)
            active = {"label": starts[step], "start": time.perf_counter(), "first": step, "tokens": 0}
        engine.step()
        step += 1
        if active is not None:
            active["tokens"] += engine.stats().num_tokens_last_step
            if step - active["first"] == window or not engine.has_unfinished():
                sync()
                wall = time.perf_counter() - active["start"]
                prof.__exit__(None, None, None)
                steps = step - active["first"]
                label = f"{isl}/{osl} x{count}, {active['label']} ({active['first']}..{step - 1})"
                entry = kernel_report(prof, wall, label, steps)
                entry["tokens_per_step"] = round(active["tokens"] / steps, 1)
                entry["host_ms_per_step"] = {k: round(1e3 * (engine.host_seconds[k] - host.get(k, 0.0)) / steps, 3)
                                             for k in engine.host_seconds if k != "steps"}
                print(f"  tokens a step {entry['tokens_per_step']}, host ms a step {entry['host_ms_per_step']}",
                      flush=True)
                reports[active["label"]] = entry
                active = None
    return reports


def run_variant(args, report: dict, name: str, engine: Engine, llm: LLM, spec, rows, samplings, start_s, longest):
    config = engine.config
    stats = engine.stats()
    entry = {"quantization": spec.quantization, "kv_cache_dtype": config.kv_cache_dtype,
             "capacity_policy": config.capacity_policy, "preemption_mode": config.preemption_mode,
             "kv_watermark": config.kv_watermark, "engine_start_s": start_s,
             "kv_blocks": stats.num_blocks_total, "block_size": config.block_size,
             "host_link_gb_s": round(stats.host_link_bytes_per_second / 1e9, 2)
             if stats.host_link_bytes_per_second else None,
             "longest_request": longest, "rows": []}
    print(json.dumps({k: v for k, v in entry.items() if k != "rows"} | {"variant": name}), flush=True)
    built = engine.built_limits
    for isl, osl, count in rows:
        if args.settings == "trtllm":  # this row's own limits, within what the engine was built for
            batch, budget = trtllm_settings(stats.num_blocks_total * config.block_size, isl, osl)
            batch = min(batch, built["max_batch_size"])
            engine.reconfigure(max_batch_size=batch, max_num_tokens=max(batch, min(budget, built["max_num_tokens"])))
        greedy = None
        for sampling in samplings:
            row = run_row(engine, llm, isl, osl, count, sampling)
            if sampling == "greedy":
                greedy = row["output_tok_s"]
            elif greedy:
                row["ratio_to_greedy"] = round(row["output_tok_s"] / greedy, 3)
            if args.profile_steps and sampling == "greedy":
                row["profile"] = profile_row(engine, isl, osl, count, args.profile_steps, row["steps"])
            entry["rows"].append(row)
            print(f"{name:12s} {isl:5d}/{osl:<5d} x{count:5d} {sampling:15s}: {row['output_tok_s']:10.1f} output tok/s "
                  f"({row['seconds']:.1f} s, {row['preemptions']} preemptions ({row['swap_preemptions']} swapped), "
                  f"{row['recomputed_tokens']} recomputed tokens ({row['recomputed_pct_of_generated']:.1f}% of "
                  f"generated), {row['swapped_out_blocks']}/{row['swapped_in_blocks']} blocks swapped out/in "
                  f"({(row['swapped_out_bytes'] + row['swapped_in_bytes']) / 2**20:.1f} MiB), {row['steps']} steps, "
                  f"max batch {row['max_batch_size']}, {row['max_num_tokens']} tokens a step)"
                  + (f"  {row['ratio_to_greedy']:.2f}x greedy" if "ratio_to_greedy" in row else "")
                  + (f"  {row['vs_published']:.2f}x TensorRT-LLM's {row['trtllm_published_fp8']}"
                     if "vs_published" in row and sampling == "greedy" else ""), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report | {"variants": report["variants"] | {name: entry}}, indent=2))
    report["variants"][name] = entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--rows", default=ROWS, help=f"comma-separated ISL/OSLxREQUESTS (default {ROWS}), or trtllm: "
                             f"{NAMED_ROWS['trtllm']} (TensorRT-LLM's own counts)")
    parser.add_argument("--variants", default="profile",
                        help="comma-separated of profile (as written), " + ", ".join(VARIANTS))
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="fixed: every row's (default 1,024); trtllm: the most any row gets (default 4,096)")
    parser.add_argument("--settings", choices=("fixed", "trtllm"), default="fixed",
                        help="fixed: every row at --max-batch-size / --max-num-tokens; trtllm: each row at "
                             "trtllm-bench's limits for it (trtllm_settings), within those")
    parser.add_argument("--max-num-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--capacity-policy", default=None,
                        help="comma-separated of " + ", ".join(CAPACITY_POLICIES) + " (default: the profile's)")
    parser.add_argument("--preemption-mode", default=None,
                        help="comma-separated of " + ", ".join(PREEMPTION_MODES) + " (default: the profile's)")
    parser.add_argument("--kv-watermark", default=None,
                        help="comma-separated fractions of the KV blocks kept free at admission (default: the profile's)")
    parser.add_argument("--sampling", default="greedy",
                        help="comma-separated of " + ", ".join(SAMPLINGS) + " (each row runs each; default greedy)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after each greedy row, run it again under the torch profiler for two windows of this "
                             "many steps (its start and its middle): GPU time by kind, host time by phase")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    profile = load_profile(args.profile)
    rows = parse_rows(args.rows)
    policies = parse_list(args.capacity_policy, "--capacity-policy", CAPACITY_POLICIES)
    modes = parse_list(args.preemption_mode, "--preemption-mode", PREEMPTION_MODES)
    watermarks = parse_list(args.kv_watermark, "--kv-watermark", kind=float)
    if any(w is not None and not 0.0 <= w < 1.0 for w in watermarks):
        raise SystemExit(f"--kv-watermark: {args.kv_watermark!r}: each must be at least 0 and less than 1")
    # Greedy first: the others print their throughput as a ratio to it.
    samplings = sorted(set(parse_list(args.sampling, "--sampling", tuple(SAMPLINGS))), key=list(SAMPLINGS).index)
    longest = max(isl + osl for isl, osl, _ in rows)
    report = {"profile": args.profile, "settings": args.settings, "date": time.strftime("%Y-%m-%d"),
              "host": platform.node(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "variants": {}}
    for variant in args.variants.split(","):
        spec, config = profile.model, profile.engine
        if variant != "profile":
            if variant not in VARIANTS:
                raise SystemExit(f"--variants: {variant!r} is not one of profile, {', '.join(VARIANTS)}")
            quantization, kv = VARIANTS[variant]
            spec = dataclasses.replace(spec, quantization=quantization)
            config = dataclasses.replace(config, kv_cache_dtype=kv)
        max_batch_size = args.max_batch_size or (4096 if args.settings == "trtllm" else 1024)
        overrides = dict(max_batch_size=max_batch_size, max_num_tokens=args.max_num_tokens,
                         max_input_length=max(config.max_input_length, max(r[0] for r in rows)),
                         max_output_len=max(config.max_output_len, max(r[1] for r in rows)))
        if args.gpu_memory_utilization is not None:
            overrides["gpu_memory_utilization"] = args.gpu_memory_utilization
        config = dataclasses.replace(config, **overrides)
        started = time.perf_counter()
        engine = Engine(spec, config, sampler_seed=0)
        llm = LLM(spec, engine=engine, load_tokenizer_too=False)
        llm.generate(prompts_of(64, 16, engine.vocab_size, seed=1), SamplingParams(max_tokens=8, ignore_eos=True))
        start_s = round(time.perf_counter() - started, 1)
        for policy, mode, watermark in itertools.product(policies, modes, watermarks):
            changes = {key: value for key, value in (("capacity_policy", policy), ("preemption_mode", mode),
                                                     ("kv_watermark", watermark)) if value is not None}
            if changes:  # the same weights and KV memory; a fresh scheduler and an empty prefix cache
                engine.reconfigure(**changes)
            name = "/".join([variant] + [str(value) for value in changes.values()])
            run_variant(args, report, name, engine, llm, spec, rows, samplings, start_s, longest)
        del llm, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
