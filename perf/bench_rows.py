"""Engine-only throughput on TensorRT-LLM's ISL/OSL rows, for any profile.

The rows (input length / output length x requests, all submitted at once, greedy,
`ignore_eos`) are those of TensorRT-LLM's published H200 performance table, with its
FP8 figures beside ours:

    128/128 x 1,024      27,911 output tok/s
    2048/128 x 512        3,538
    128/2048 x 512       26,221
    2048/2048 x 256      12,194

The engine is built from the profile with `--max-batch-size` / `--max-num-tokens`
overrides (defaults 1,024 and 16,384, as the issue measured), and optionally
`--quantization` / `--kv-cache-dtype` overrides, so that bf16 and fp8 of one profile
compare in one run (`--variants bf16,fp8`). Per row: output tok/s, wall seconds,
preemptions, steps. A warm-up of 64 short requests runs first.

    python -m perf.bench_rows --profile profiles/llama3-8b-h200.yaml --variants bf16,fp8 --out $OUT/rows.json
    python -m perf.bench_rows --profile profiles/smollm2-cpu.yaml --rows 16/8x8 --max-batch-size 8   # CPU check

Prints a table; `--out` saves the figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import platform
import time
from pathlib import Path

import torch

from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.profile import load_profile
from inflightllm.sampling_params import SamplingParams
from perf.bench_gpu import prompts_of, sync

ROWS = "128/128x1024,2048/128x512,128/2048x512,2048/2048x256"
# TensorRT-LLM's published H200 figures (FP8, its performance overview), output tok/s.
PUBLISHED = {(128, 128): 27911, (2048, 128): 3538, (128, 2048): 26221, (2048, 2048): 12194}
VARIANTS = {"bf16": (None, "auto"), "fp8": ("fp8", "fp8"), "fp8-weights": ("fp8", "auto")}


def parse_rows(text: str) -> list[tuple[int, int, int]]:
    rows = []
    for item in text.split(","):
        try:
            lengths, count = item.strip().split("x")
            isl, osl = lengths.split("/")
            rows.append((int(isl), int(osl), int(count)))
        except ValueError:
            raise SystemExit(f"--rows: {item!r} is not ISL/OSLxREQUESTS (e.g. 128/128x1024)") from None
    return rows



def run_row(engine: Engine, llm: LLM, isl: int, osl: int, count: int) -> dict:
    prompts = prompts_of(count, isl, engine.vocab_size, seed=isl * 7 + osl)
    params = SamplingParams(max_tokens=osl, ignore_eos=True)
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
    row = {
        "isl": isl, "osl": osl, "requests": count, "seconds": round(seconds, 3),
        "output_tok_s": round(generated / seconds, 1),
        "preemptions": after.num_preemptions_total - before.num_preemptions_total,
        "steps": after.num_steps_total - before.num_steps_total,
    }
    published = PUBLISHED.get((isl, osl))
    if published:
        row["trtllm_published_fp8"] = published
        row["vs_published"] = round(row["output_tok_s"] / published, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--rows", default=ROWS, help=f"comma-separated ISL/OSLxREQUESTS (default {ROWS})")
    parser.add_argument("--variants", default="profile",
                        help="comma-separated of profile (as written), " + ", ".join(VARIANTS))
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--max-num-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    profile = load_profile(args.profile)
    rows = parse_rows(args.rows)
    longest = max(isl + osl for isl, osl, _ in rows)
    report = {"profile": args.profile, "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "variants": {}}
    for variant in args.variants.split(","):
        spec, config = profile.model, profile.engine
        if variant != "profile":
            if variant not in VARIANTS:
                raise SystemExit(f"--variants: {variant!r} is not one of profile, {', '.join(VARIANTS)}")
            quantization, kv = VARIANTS[variant]
            spec = dataclasses.replace(spec, quantization=quantization)
            config = dataclasses.replace(config, kv_cache_dtype=kv)
        overrides = dict(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                         max_input_length=max(config.max_input_length, max(r[0] for r in rows)),
                         max_output_len=max(config.max_output_len, max(r[1] for r in rows)))
        if args.gpu_memory_utilization is not None:
            overrides["gpu_memory_utilization"] = args.gpu_memory_utilization
        config = dataclasses.replace(config, **overrides)
        started = time.perf_counter()
        engine = Engine(spec, config, sampler_seed=0)
        llm = LLM(spec, engine=engine, load_tokenizer_too=False)
        llm.generate(prompts_of(64, 16, engine.vocab_size, seed=1), SamplingParams(max_tokens=8, ignore_eos=True))
        entry = {"quantization": spec.quantization, "kv_cache_dtype": config.kv_cache_dtype,
                 "engine_start_s": round(time.perf_counter() - started, 1),
                 "kv_blocks": engine.stats().num_blocks_total, "block_size": config.block_size,
                 "longest_request": longest, "rows": []}
        print(json.dumps({k: v for k, v in entry.items() if k != "rows"} | {"variant": variant}), flush=True)
        for isl, osl, count in rows:
            row = run_row(engine, llm, isl, osl, count)
            entry["rows"].append(row)
            print(f"{variant:12s} {isl:5d}/{osl:<5d} x{count:5d}: {row['output_tok_s']:10.1f} output tok/s "
                  f"({row['seconds']:.1f} s, {row['preemptions']} preemptions, {row['steps']} steps)"
                  + (f"  {row['vs_published']:.2f}x TensorRT-LLM's {row['trtllm_published_fp8']}"
                     if "vs_published" in row else ""), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report | {"variants": report["variants"] | {variant: entry}}, indent=2))
        report["variants"][variant] = entry
        del llm, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
