"""GPU benchmark: our engine vs `transformers` on the same random weights, one run.

Sections (all by default):
- `decode`: the decode step at batch 1, 32 and 256 (prompts of 128 tokens, contexts
  growing from there). Ours: the median of timed `Engine.step()` calls once every
  request decodes (host work included, CUDA graphs on). transformers: `generate` at the
  same batch, (time of 64 new tokens - time of 16) / 48 per step (prefill excluded).
- `throughput`: 1,024 requests of 128 prompt tokens and 128 output tokens submitted at
  once, engine-only (`LLM.generate`), output tokens/s; transformers `generate` at batch
  128 over the same prompts (8 batches), tokens/s.
- `long`: 8 requests with 32,000-token prompts and 256 output tokens; prefill TFLOP/s
  over the steps that prefill.
- `fill`: 256 requests of 1,536 prompt tokens that would each generate 4,096: how full
  the KV cache is when the first preemption is needed (blocks in use / blocks allocated).
- `profile`: a torch profiler trace of decode steps at batch 1 and 256; the kernels
  that take the GPU time, as a table.
- `throughput-profile` (with `throughput` and `--throughput-batch-sizes`): the throughput
  workload once more under the torch profiler, per cap: GPU time by kind of kernel
  (GEMMs, decode and prefill attention, norms, ...) and the GPU's busy time against wall time.

Prints a table and writes JSON (`--out`). Usage (on the GPU host):
    python perf/bench_gpu.py --shape llama3-8b --dtype bfloat16 --out $OUT/bench_gpu.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import ModelSpec
from inflightllm.sampling_params import SamplingParams


def prompts_of(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (count, length), generator=generator).tolist()


def sync() -> None:
    """Wait for the GPU (nothing to wait for on a CPU-only machine)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_step_ms(engine: Engine, batch: int, prompt_len: int = 128, steps: int = 30) -> dict:
    """The decode step at `batch` once every request decodes, two ways:
    - `synced`: median wall time of one `Engine.step()` with the GPU drained before and
      after (host work and GPU work in series: no overlap at all);
    - `pipelined`: `steps` consecutive `Engine.step()` calls, drained only at both ends,
      divided by `steps`. With asynchronous scheduling the host prepares step N+1 while the
      GPU runs step N, so this is the time between two tokens of a stream (inter-token
      latency at this batch), which is what a client sees.
    Contexts start at `prompt_len` tokens."""
    params = SamplingParams(max_tokens=2 * steps + 20, ignore_eos=True)
    for i, prompt in enumerate(prompts_of(batch, prompt_len, engine.vocab_size, seed=batch)):
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    # Until every request has its first token (all prefills done), then a few warm steps.
    while engine.stats().num_running < batch or any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    sync()
    reset_host_times(engine.host_seconds)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    pipelined = (time.perf_counter() - start) * 1e3 / steps
    host = host_ms_per_step(engine.host_seconds)
    while engine.has_unfinished():
        engine.step()
    return {"synced": statistics.median(times), "pipelined": pipelined, "host_ms_per_step": host}


def reset_host_times(times: dict) -> None:
    """Zero a host-time record (`Engine.host_seconds`, `TensorParallelRunner.host_seconds`)."""
    for key in times:
        times[key] = 0


def host_ms_per_step(times: dict) -> dict:
    """A host-time record per step, in ms, by part. The engine's (asynchronous scheduling):
    `wait` is the GPU time the host work did not hide; the rest is host work."""
    steps = max(1, times["steps"])
    return {key: round(value * 1e3 / steps, 3) for key, value in times.items() if key != "steps"} | {
        "steps": times["steps"]}


def compute_floor(engine: Engine, requests: int, prompt_len: int, output_len: int,
                  matmul_tflops: float = 790.0) -> dict:
    """The least time the workload's weight GEMMs need at the GPU's dense bf16 matmul rate
    (measured on the H200 at ~790 TFLOP/s): 2 FLOP per weight per token, the LM head
    counted once per sequence step that samples (the last prompt token, then every output
    token), the embedding not at all. Attention is left out (it only lowers the ceiling)."""
    arch = engine.loaded.arch
    weights = sum(t.numel() for t in engine.loaded.model.hf_state_dict().values())
    embed = arch.vocab_size * arch.hidden_size
    lm_head = 0 if getattr(arch, "tie_word_embeddings", False) else embed
    body = weights - embed - lm_head
    body_full = body + embed  # per sampled token: the body and an LM head
    flops = 2 * requests * ((prompt_len - 1) * body + output_len * body_full)
    seconds = flops / (matmul_tflops * 1e12)
    return {"matmul_tflops": matmul_tflops, "tflop": round(flops / 1e12, 1), "seconds": round(seconds, 2),
            "output_tokens_per_s": round(requests * output_len / seconds, 1)}


def hf_model(engine: Engine):
    return hf_model_from_loaded(engine.loaded)


def hf_model_from_loaded(loaded):
    """`transformers`' Llama on the same weights as a loaded model (`Engine.loaded`): the
    GPU model's Hugging Face named views (`hf_state_dict()`), the CPU model's own state
    dict (its names are Hugging Face's). The engine itself may be gone (its KV cache freed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in loaded.config.items() if k != "architectures"})
    default = torch.get_default_dtype()
    torch.set_default_dtype(loaded.dtype)
    try:
        with torch.device(loaded.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    weights = loaded.model.hf_state_dict() if hasattr(loaded.model, "hf_state_dict") else loaded.model.state_dict()
    missing, _ = model.load_state_dict(weights, strict=False)
    # Rotary buffers are computed, and a tied LM head is the embedding: nothing else may lack.
    untied = [name for name in missing if "rotary" not in name
              and not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if untied:
        raise RuntimeError(f"transformers model: weights missing from the loaded model: {untied[:5]}")
    return model.eval()


@torch.inference_mode()
def hf_generate_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    sync()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - start


def hf_decode_step_ms(model, batch: int, vocab: int, prompt_len: int = 128) -> float:
    prompts = prompts_of(batch, prompt_len, vocab, seed=batch)
    hf_generate_s(model, prompts, 4)  # warm-up
    short = hf_generate_s(model, prompts, 16)
    long = hf_generate_s(model, prompts, 64)
    return (long - short) / 48 * 1e3


def profile_decode(engine: Engine, batch: int, steps: int = 10) -> list[dict]:
    """GPU time by kernel over `steps` decode steps at `batch` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 40, ignore_eos=True)
    for i, prompt in enumerate(prompts_of(batch, 128, engine.vocab_size, seed=100 + batch)):
        engine.add_request(f"profile-{batch}-{i}", prompt, params)
    while any(r.num_output_tokens < 2 for r in engine.requests.values()):
        engine.step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    while engine.has_unfinished():
        engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) or 1
    rows = []
    print(f"profile, decode batch {batch}, {steps} steps: GPU time per step {total / steps / 1e3:.3f} ms", flush=True)
    for event in events[:12]:
        share = event.self_device_time_total / total
        rows.append({"kernel": event.key[:80], "ms_per_step": round(event.self_device_time_total / steps / 1e3, 4),
                     "share": round(share, 3), "calls_per_step": event.count // steps})
        print(f"  {share:6.1%} {event.self_device_time_total / steps / 1e3:8.3f} ms  x{event.count // steps:4d}  "
              f"{event.key[:90]}", flush=True)
    return rows


KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("attention decode, cascade", ("cascade_prefix", "cascade_merge")),
    ("attention decode", ("paged_decode", "decode_reduce")),
    ("attention prefill", ("prefill_mma", "prefill_fma", "flash", "fmha", "gather_kv")),
    ("GEMM", ("nvjet", "gemm", "cutlass", "xmma", "splitK", "small_gemv", "gate_up_norm", "qkv_norm")),
    ("KV cache write", ("reshape_and_cache",)),
    ("FP8 activation quantization", ("quant_rows_fp8", "rms_norm_fp8", "silu_and_mul_fp8")),
    ("norm", ("rms_norm",)),
    ("RoPE", ("rotary",)),
    ("SiLU", ("silu",)),
    ("copies", ("Memcpy", "Memset", "copy", "fill", "index")),
)


def kernel_kind(name: str) -> str:
    for kind, parts in KERNEL_KINDS:
        if any(part in name for part in parts):
            return kind
    return "other (sampling, elementwise)"


def profile_run(generate, label: str) -> dict:
    """GPU time by kind of kernel over one whole `generate()` call (torch profiler), and how
    much of the wall time the GPU was busy with any kernel."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate()
        sync()
    return kernel_report(prof, time.perf_counter() - start, label)


def kernel_report(prof, wall: float, label: str, steps: int = 0) -> dict:
    """A finished torch profile's GPU time by kind of kernel (KERNEL_KINDS), the top kernels and
    the GPU's busy time (the union of the kernels' intervals) against `wall`, printed; with
    `steps`, also per step."""
    spans = []
    kinds: dict[str, float] = {}
    names: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        begin, end = event.time_range.start, event.time_range.end
        spans.append((begin, end))
        kind = kernel_kind(event.name)
        kinds[kind] = kinds.get(kind, 0.0) + (end - begin) / 1e6
        entry = names.setdefault(event.name[:90], [0.0, 0])
        entry[0] += (end - begin) / 1e6
        entry[1] += 1
    spans.sort()
    busy, reach = 0.0, float("-inf")
    for begin, end in spans:  # the union of the kernels' intervals
        if end > reach:
            busy += end - max(begin, reach)
            reach = end
    busy /= 1e6
    report = {"wall_s": round(wall, 3), "gpu_busy_s": round(busy, 3),
              "kinds_s": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
              "top_kernels": [{"kernel": k, "s": round(v[0], 4), "calls": v[1]}
                              for k, v in sorted(names.items(), key=lambda kv: -kv[1][0])[:20]]}
    per_step = f", {1e3 * wall / steps:.2f} ms a step, GPU busy {1e3 * busy / steps:.2f}" if steps else ""
    if steps:
        report["steps"] = steps
    print(f"profile of {label}: wall {wall:.2f} s (profiler on), GPU busy {busy:.2f} s{per_step}", flush=True)
    for kind, seconds in report["kinds_s"].items():
        each = f"  {1e3 * seconds / steps:8.3f} ms a step" if steps else ""
        print(f"  {seconds:8.3f} s  {seconds / max(busy, 1e-9):6.1%}{each}  {kind}", flush=True)
    for row in report["top_kernels"][: 12 if steps else 20]:
        print(f"  {row['s']:8.3f} s  x{row['calls']:6d}  {row['kernel']}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sections", default="decode,throughput,long,fill,profile")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192, help="tokens per step (chunked prefill budget)")
    parser.add_argument("--throughput-batch-sizes", default="",
                        help="also run the throughput workload with these max_batch_size caps, e.g. 512,1024")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="leaves room for the transformers model on the same GPU")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--quantization", default=None, choices=(None, "fp8"), help="model.quantization")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="engine.kv_cache_dtype")
    parser.add_argument("--fp8-lm-head", action="store_true", help="model.fp8_lm_head (with --quantization fp8)")
    parser.add_argument("--int8-lm-head", action="store_true", help="model.int8_lm_head (any weights)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sections = set(args.sections.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    spec = ModelSpec(source="random", shape=args.shape, seed=0, dtype=args.dtype, quantization=args.quantization,
                     fp8_lm_head=True if args.fp8_lm_head else None, int8_lm_head=True if args.int8_lm_head else None)
    long_input = 32768 if "long" in sections else 4096
    config = EngineConfig(
        device="gpu", gpu_ids=(0,), max_num_tokens=args.max_num_tokens, max_input_length=long_input,
        max_output_len=4096, gpu_memory_utilization=args.gpu_memory_utilization, async_scheduling=True,
        max_batch_size=args.max_batch_size, kv_cache_dtype=args.kv_cache_dtype,
    )
    start = time.perf_counter()
    engine = Engine(spec, config, sampler_seed=0)
    report: dict = {
        "shape": args.shape, "dtype": args.dtype, "quantization": args.quantization, "fp8_lm_head": args.fp8_lm_head,
        "int8_lm_head": args.int8_lm_head,
        "kv_cache_dtype": args.kv_cache_dtype, "gpu": torch.cuda.get_device_name(), "host": platform.node(),
        "date": time.strftime("%Y-%m-%d"), "engine_start_s": round(time.perf_counter() - start, 1),
        "kv_blocks": engine.runner.num_blocks, "kv_gib": round(engine.runner.kv_cache_bytes / 2**30, 2),
        "cuda_graph_buckets": sorted(engine.runner.graphs),
    }
    print(json.dumps(report), flush=True)
    model = None
    if not args.no_transformers:
        model = hf_model(engine)
    rows = []
    if "decode" in sections:
        for batch in batches:
            engine.async_scheduling = False
            synchronous = decode_step_ms(engine, batch)
            engine.async_scheduling = True
            ours = decode_step_ms(engine, batch)
            theirs = hf_decode_step_ms(model, batch, engine.vocab_size) if model is not None else float("nan")
            print(f"  host ms per step (asynchronous scheduling): {ours['host_ms_per_step']}", flush=True)
            rows.append({"batch": batch, "ours_pipelined_ms": round(ours["pipelined"], 3),
                         "host_ms_per_step": ours["host_ms_per_step"],
                         "ours_synced_ms": round(ours["synced"], 3),
                         "synchronous_scheduling_pipelined_ms": round(synchronous["pipelined"], 3),
                         "synchronous_scheduling_synced_ms": round(synchronous["synced"], 3),
                         "transformers_ms": round(theirs, 3)})
            print(f"decode step batch {batch:4d}: ours {ours['pipelined']:8.3f} ms between tokens "
                  f"({ours['synced']:.3f} ms drained around each step; synchronous scheduling "
                  f"{synchronous['pipelined']:.3f} / {synchronous['synced']:.3f} ms)"
                  f"   transformers {theirs:8.3f} ms", flush=True)
        report["decode_step"] = rows
    if "throughput" in sections:
        prompts = prompts_of(args.requests, 128, engine.vocab_size, seed=7)
        params = SamplingParams(max_tokens=128, ignore_eos=True)
        llm = LLM(spec, engine=engine, load_tokenizer_too=False)
        llm.generate(prompts[:64], params)  # warm-up
        sync()
        reset_host_times(engine.host_seconds)
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        sync()
        elapsed = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        report["throughput"] = {"requests": args.requests, "output_tokens": tokens, "seconds": round(elapsed, 2),
                                "output_tokens_per_s": round(tokens / elapsed, 1),
                                "preemptions": engine.stats().num_preemptions_total,
                                "host_ms_per_step": host_ms_per_step(engine.host_seconds)}
        print(f"  host ms per step: {report['throughput']['host_ms_per_step']}", flush=True)
        print(f"engine-only {args.requests} x 128/128: {tokens / elapsed:,.0f} output tokens/s ({elapsed:.1f} s)",
              flush=True)
        report["throughput"]["compute_floor"] = floor = compute_floor(engine, args.requests, 128, 128)
        print(f"  GEMM compute floor at {floor['matmul_tflops']} TFLOP/s: {floor['seconds']} s, i.e. at most "
              f"{floor['output_tokens_per_s']:,.0f} output tokens/s", flush=True)
        if model is not None:
            batch_prompts = prompts[:128]
            hf_generate_s(model, batch_prompts[:8], 4)
            elapsed_hf = hf_generate_s(model, batch_prompts, 128)
            report["throughput"]["transformers_batch128_tokens_per_s"] = round(128 * 128 / elapsed_hf, 1)
            print(f"transformers generate batch 128: {128 * 128 / elapsed_hf:,.0f} tokens/s", flush=True)
        if args.throughput_batch_sizes and model is not None:
            del model  # room for a second KV cache
            model = None
            gc.collect()
            torch.cuda.empty_cache()
        for cap in [int(c) for c in args.throughput_batch_sizes.split(",") if c]:
            blocks = args.requests * 272 // 16 + cap  # every request's 256 tokens (+ a block each) at once
            capped = Engine(spec, replace(config, max_batch_size=cap, max_num_tokens=max(args.max_num_tokens, cap),
                                          num_kv_blocks=blocks), sampler_seed=0, loaded=engine.loaded)
            capped_llm = LLM(spec, engine=capped, load_tokenizer_too=False)
            capped_llm.generate(prompts[:64], params)
            sync()
            reset_host_times(capped.host_seconds)
            start = time.perf_counter()
            results = capped_llm.generate(prompts, params)
            sync()
            seconds = time.perf_counter() - start
            report["throughput"][f"max_batch_size_{cap}_tokens_per_s"] = round(tokens / seconds, 1)
            report["throughput"][f"max_batch_size_{cap}_host_ms_per_step"] = host_ms_per_step(capped.host_seconds)
            print(f"  host ms per step: {host_ms_per_step(capped.host_seconds)}", flush=True)
            print(f"engine-only {args.requests} x 128/128 at max_batch_size {cap}: {tokens / seconds:,.0f} "
                  f"output tokens/s ({seconds:.1f} s)", flush=True)
            if "throughput-profile" in sections:
                # other prompts: the timed run's are all in the prefix cache now
                fresh = prompts_of(args.requests, 128, engine.vocab_size, seed=8)
                report["throughput"][f"max_batch_size_{cap}_profile"] = profile_run(
                    functools.partial(capped_llm.generate, fresh, params),
                    f"1,024 x 128/128 at max_batch_size {cap}")
            del capped, capped_llm
            gc.collect()
    if "long" in sections:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        prompts = prompts_of(8, 32000, engine.vocab_size, seed=9)
        params = SamplingParams(max_tokens=256, min_tokens=256, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"long-{i}", prompt, params)
        prefill_tokens = 0
        prefill_time = 0.0
        start = time.perf_counter()
        done = 0
        while engine.has_unfinished():
            sync()
            step_start = time.perf_counter()
            outputs = engine.step()
            sync()
            step_tokens = engine.stats().num_tokens_last_step
            if step_tokens > 256:
                prefill_tokens += step_tokens
                prefill_time += time.perf_counter() - step_start
            done += sum(1 for o in outputs if o.finished)
        elapsed = time.perf_counter() - start
        arch = engine.loaded.arch
        params_count = sum(t.numel() for t in engine.loaded.model.hf_state_dict().values())
        # 2 FLOP per weight per token, plus causal attention: 2 * 2 * layers * heads * d * L^2 / 2 per sequence.
        attention_flops = 8 * 2 * arch.num_layers * arch.num_heads * arch.head_dim * 32000**2
        flops = 2 * params_count * prefill_tokens + attention_flops
        report["long"] = {"requests_done": done, "seconds": round(elapsed, 1), "prefill_tokens": prefill_tokens,
                          "prefill_seconds": round(prefill_time, 2),
                          "prefill_tflops": round(flops / prefill_time / 1e12, 1) if prefill_time else None}
        print(f"8 x 32k prompts + 256 out: {done} done in {elapsed:.1f} s; prefill {prefill_tokens} tokens in "
              f"{prefill_time:.2f} s = {flops / max(prefill_time, 1e-9) / 1e12:.0f} TFLOP/s", flush=True)
    if "small-batch" in sections:
        # Side by side: the fused small-batch kernels vs cuBLAS GEMVs + separate norm/RoPE/SiLU
        # kernels, decode steps of 1-8 sequences, graphs re-captured for each.
        runner, gpu_model = engine.runner, engine.runner.model
        initial = gpu_model.small_batch_kernels, gpu_model.small_batch_max_tokens
        table = {}
        for label, flag in (("fused", True), ("unfused", False)):
            gpu_model.small_batch_kernels, gpu_model.small_batch_max_tokens = flag, 8
            runner._capture_graphs()
            table[label] = {batch: round(decode_step_ms(engine, batch)["pipelined"], 3) for batch in (1, 2, 4, 8)}
        gpu_model.small_batch_kernels, gpu_model.small_batch_max_tokens = initial
        runner._capture_graphs()
        report["small_batch"] = table
        for batch in (1, 2, 4, 8):
            print(f"decode step batch {batch}: fused small-batch kernels {table['fused'][batch]:.3f} ms, "
                  f"unfused {table['unfused'][batch]:.3f} ms between tokens", flush=True)
    if "pdl" in sections:
        # Side by side: programmatic dependent launch off and on (inflightllm/gpu/pdl.py), graphs
        # re-captured for each, twice in alternation (off, on, off, on) to show the noise.
        from inflightllm.gpu import pdl

        runner = engine.runner
        initial = os.environ.get(pdl.ENV)
        table: dict = {"off": {}, "on": {}}
        for _ in range(2):
            for label, setting in (("off", "0"), ("on", "1")):
                os.environ[pdl.ENV] = setting
                pdl.enabled.cache_clear()
                runner._capture_graphs()
                for batch in batches:
                    ms = round(decode_step_ms(engine, batch)["pipelined"], 3)
                    table[label].setdefault(batch, []).append(ms)
        if initial is None:
            os.environ.pop(pdl.ENV, None)
        else:
            os.environ[pdl.ENV] = initial
        pdl.enabled.cache_clear()
        runner._capture_graphs()
        report["pdl"] = table
        for batch in batches:
            print(f"decode step batch {batch}: programmatic dependent launch off {table['off'][batch]} ms, "
                  f"on {table['on'][batch]} ms between tokens", flush=True)
    if "profile" in sections:
        report["profile"] = {}
        for batch in (1, 256):
            report["profile"][batch] = profile_decode(engine, batch)
    if "fill" in sections:
        prompts = prompts_of(256, 1536, engine.vocab_size, seed=11)
        params = SamplingParams(max_tokens=4096, min_tokens=4096, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"fill-{i}", prompt, params)
        before = engine.stats().num_preemptions_total
        while engine.stats().num_preemptions_total == before and engine.has_unfinished():
            engine.step()
        stats = engine.stats()
        for request_id in list(engine.requests):
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
        usage = stats.kv_usage_at_first_preemption
        report["fill"] = {"blocks": stats.num_blocks_total, "usage_at_first_preemption": usage}
        print(f"KV cache: {stats.num_blocks_total} blocks; {usage:.1%} of them in use at the first preemption",
              flush=True)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
