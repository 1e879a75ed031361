"""Offline throughput: this engine (in-flight and static batching) vs `transformers`.

32 requests with mixed output lengths (8 to 256 tokens, seeded), greedy, EOS ignored so
every request produces exactly its length. Output tokens/s counts only the tokens each
request asked for. Run on the CPU machine:

    make bench                      # = .venv/bin/python perf/bench_engine.py
    .venv/bin/python perf/bench_engine.py --requests 8 --max-len 32   # quick look

Prints a table and saves it as JSON (perf/results/bench_engine-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import DEFAULT_MODEL, load_tokenizer, prepare
from inflightllm.models.loader import load_model
from inflightllm.sampling_params import SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TOPICS = [
    "the history of the printing press", "how volcanoes form", "a day in the life of a beekeeper",
    "the rules of chess", "why the sky is blue", "the water cycle", "how to bake bread",
    "the life of Marie Curie", "the planets of the solar system", "how computers store numbers",
    "the migration of birds", "the invention of the telephone", "how vaccines work",
    "the history of the Olympic games", "the structure of a cell", "how bridges stay up",
]


def make_workload(tokenizer, num_requests: int, min_len: int, max_len: int, seed: int):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for i in range(num_requests):
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "user", "content": f"Write a detailed essay about {topic}."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        lengths.append(rng.randint(min_len, max_len))
    return prompts, lengths


def run_engine(loaded, prompts, lengths, strategy: str, max_batch_size: int) -> dict:
    config = EngineConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=2048,
        batching_strategy=strategy,
        kv_cache_bytes=1 << 30,
        enable_kv_cache_reuse=False,  # the prompts share a template: keep the comparison about batching
    )
    engine = Engine(DEFAULT_MODEL, config, sampler_seed=0, loaded=loaded)
    llm = LLM(DEFAULT_MODEL, engine=engine, load_tokenizer_too=False)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    produced = sum(len(r.token_ids) for r in results)
    assert produced == sum(lengths), (produced, sum(lengths))
    return {"seconds": elapsed, "output_tokens": produced, "steps": engine.stats().num_steps_total}


def run_transformers(hf_model, tokenizer, prompts, lengths, batch_size: int) -> dict:
    """`generate` on static batches of `batch_size` (left-padded); a batch runs until its
    longest request is done, and only each request's own length counts as output."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.perf_counter()
    useful = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        batch_lengths = lengths[start : start + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        longest = max(batch_lengths)
        with torch.no_grad():
            out = hf_model.generate(
                input_ids, attention_mask=attention, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=pad_id,
            )
        assert out.shape[1] - width == longest
        useful += sum(batch_lengths)
    return {"seconds": time.perf_counter() - started, "output_tokens": useful}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-sizes", default="8,32",
                        help="comma-separated: for each, the running-batch cap (ours) and the static batch size")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompts, lengths = make_workload(tokenizer, args.requests, args.min_len, args.max_len, args.seed)
    loaded = load_model(DEFAULT_MODEL)
    hf_model = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(prepare(DEFAULT_MODEL), dtype=torch.float32).eval()
    rows = {}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        rows[f"inflightllm in-flight, batch cap {batch_size}"] = run_engine(
            loaded, prompts, lengths, "inflight", batch_size)
        rows[f"inflightllm static, batches of {batch_size}"] = run_engine(loaded, prompts, lengths, "static", batch_size)
        if hf_model is not None:
            rows[f"transformers generate, static batches of {batch_size}"] = run_transformers(
                hf_model, tokenizer, prompts, lengths, batch_size)
    for row in rows.values():
        row["tokens_per_s"] = row["output_tokens"] / row["seconds"]

    print(f"\n{args.requests} requests, output lengths {args.min_len}-{args.max_len} "
          f"(sum {sum(lengths)}), prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"SmolLM2-135M fp32, torch threads {torch.get_num_threads()}")
    print(f"{'system':50s} {'seconds':>9s} {'tokens':>8s} {'tokens/s':>9s} {'steps':>6s}")
    for name, row in rows.items():
        print(f"{name:50s} {row['seconds']:9.1f} {row['output_tokens']:8d} {row['tokens_per_s']:9.1f} "
              f"{row.get('steps', ''):>6}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    for baseline_size in sizes:
        baseline = rows.get(f"transformers generate, static batches of {baseline_size}")
        for size in sizes if baseline else []:
            ours = rows[f"inflightllm in-flight, batch cap {size}"]
            print(f"in-flight (cap {size}) / transformers (batches of {baseline_size}) = "
                  f"{ours['tokens_per_s'] / baseline['tokens_per_s']:.2f}x")
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "args": vars(args) | {"out": None},
        "lengths": lengths,
        "rows": rows,
    }
    out = args.out or RESULTS_DIR / f"bench_engine-{record['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
