"""Would a large decode step gain from overlapping attention with the GEMMs? Measured on the GPU.

A decode step at a large batch (the throughput run: 1,024 requests, contexts 128-256) spends
about a quarter of its GPU time in decode attention, which is bound by memory bandwidth, and the
rest in cuBLAS GEMMs, bound by compute (and, on the H200, by its power limit). NanoFlow-style
overlap splits the batch into two halves and runs them on two streams, so that one half's
attention runs beside the other half's GEMMs. This benchmark captures, in CUDA graphs, the
engine's own `GpuLlama.forward` on a paged KV cache (Llama-3-8B layer shape, `--layers` layers,
random weights, every request `--context` tokens) and times:

- `whole`: the batch in one forward (what the engine does now);
- `halves, one stream`: two forwards of half the batch, one after the other (the cost of
  smaller GEMMs alone);
- `halves, two streams`: the same two forwards on two streams, free to overlap;
- `... carve-out N`: the same with cuBLAS held to all SMs but N (torch's
  `_set_sm_carveout_experimental`), leaving room for the other stream's attention.

It also prints the whole step's GPU time by kernel (torch profiler), and checks that the halves
give the whole batch's hidden states.

    python3 -m perf.bench_overlap --batch 1024 --context 192 --layers 8 --out $OUT/bench_overlap.json

`--fp8`: FP8 weights (quantized at load) and an FP8 KV cache, as the FP8 profiles run; the long
rows of issue 26 (e.g. `--fp8 --batch 256 --context 3072`) spend most of a step in decode
attention, where overlap has the most GEMM time to hide.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda.backend import CudaAttentionMetadata, CudaPagedAttention
from inflightllm.gpu import ops
from inflightllm.gpu.model import GpuLlama
from inflightllm.models.llama import LlamaArch
from inflightllm.models.shapes import shape_config
from perf.bench_gpu import kernel_kind

BLOCK_SIZE = 16


def rows_of(md: CudaAttentionMetadata, start: int, end: int) -> CudaAttentionMetadata:
    """The decode metadata of rows start..end-1 (views; query_start_loc rebased)."""
    return CudaAttentionMetadata(
        num_decodes=end - start, num_prefills=0, num_decode_tokens=end - start, max_query_len=0,
        max_context_len=md.max_context_len, slot_mapping=md.slot_mapping[start:end],
        positions=md.positions[start:end], block_tables=md.block_tables[start:end],
        context_lens=md.context_lens[start:end], query_start_loc=md.query_start_loc[start : end + 1] - start,
    )


def replay_times_ms(graph: torch.cuda.CUDAGraph, iters: int) -> list[float]:
    """ms of each of `iters` replays of `graph` (CUDA events), after 3 untimed ones."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    return statistics.median(replay_times_ms(graph, iters))


def profile(graph: torch.cuda.CUDAGraph, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    return {e.key: e.self_device_time_total / steps / 1e3 for e in events if e.self_device_time_total > 0}  # ms a step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--carveouts", default="16,32", help="SM carve-outs to try for the two-stream run")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--fp8", action="store_true", help="FP8 weights and an FP8 KV cache")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    config = shape_config(args.shape)
    config["num_hidden_layers"] = args.layers
    arch = LlamaArch.from_config(config)
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    torch.cuda.set_device(device)
    model = GpuLlama(arch, dtype, device, max_positions=args.context + 64)
    model.init_random(0)
    if args.fp8:
        model.quantize_fp8()
    attention = CudaPagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, max_model_len=args.context + 64,
                                   kv_cache_dtype="fp8" if args.fp8 else "auto")
    per_seq = -(-args.context // BLOCK_SIZE)
    attention.allocate_kv_cache(args.batch * per_seq, BLOCK_SIZE, arch.num_layers, arch.num_kv_heads,
                                arch.head_dim, dtype, device)
    if args.fp8:  # e4m3 bytes of either sign up to 2^-1 (no NaN patterns)
        attention.kv_cache.copy_(torch.randint(0, 0x30, attention.kv_cache.shape, dtype=torch.uint8, device=device)
                                 | (torch.randint(0, 2, attention.kv_cache.shape, dtype=torch.uint8, device=device) << 7))
    else:
        attention.kv_cache.normal_(0.0, 1.0)
    sequences = [SequenceSlice(query_start=i, query_len=1, context_len=args.context,
                               block_table=tuple(range(i * per_seq, (i + 1) * per_seq))) for i in range(args.batch)]
    md = attention.build_metadata(sequences, device)
    half = args.batch // 2
    md_a, md_b = rows_of(md, 0, half), rows_of(md, half, args.batch)
    input_ids = torch.randint(0, arch.vocab_size, (args.batch,), device=device)
    positions = md.positions

    def forward(start, end, metadata):
        return model.forward(input_ids[start:end], positions[start:end], attention, metadata)

    pool = torch.cuda.graph_pool_handle()
    capture_stream = torch.cuda.Stream(device=device)
    side = torch.cuda.Stream(device=device)

    def capture(body):
        with torch.inference_mode():
            with ops.torch_stream():
                body()  # warm-up (kernel compilation, cuBLAS handles)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                result = body()
        return graph, result

    def whole():
        with ops.torch_stream():
            return forward(0, args.batch, md)

    def halves_one_stream():
        with ops.torch_stream():
            return torch.cat([forward(0, half, md_a), forward(half, args.batch, md_b)])

    def halves_two_streams():
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        with torch.cuda.stream(side), ops.torch_stream():
            second = forward(half, args.batch, md_b)
        with ops.torch_stream():
            first = forward(0, half, md_a)
        main_stream.wait_stream(side)
        return torch.cat([first, second])

    variants = [("whole", whole, None), ("halves, one stream", halves_one_stream, None),
                ("halves, two streams", halves_two_streams, None)]
    carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if carveout is not None:
        variants += [(f"halves, two streams, carve-out {n}", halves_two_streams, int(n))
                     for n in args.carveouts.split(",") if n]
    report = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "batch": args.batch, "fp8": args.fp8,
              "context": args.context, "layers": args.layers, "variants": {}}
    graphs = {}
    reference = None
    for name, body, sms in variants:
        if carveout is not None:
            carveout(sms)
        try:
            graph, hidden = capture(body)
        finally:
            if carveout is not None:
                carveout(None)
        graph.replay()
        torch.cuda.synchronize()
        if reference is None:
            reference = hidden.float().clone()
        error = (hidden.float() - reference).abs().max().item()
        graphs[name] = graph
        report["variants"][name] = {"max_abs_diff_vs_whole": error}
    # Interleave the timings (power and clocks drift over a run).
    times = defaultdict(list)
    for _ in range(3):
        for name, graph in graphs.items():
            times[name].append(replay_ms(graph, args.iters))
    base = statistics.median(times["whole"])
    for name in graphs:
        ms = statistics.median(times[name])
        entry = report["variants"][name]
        entry.update(ms=round(ms, 4), ms_per_layer=round(ms / args.layers, 4), vs_whole=round(ms / base, 4))
        print(f"{name:40s} {ms:8.3f} ms ({ms / args.layers * 1000:7.1f} us a layer)  {ms / base:5.3f}x"
              f"   max |diff| vs whole {entry['max_abs_diff_vs_whole']:.3g}", flush=True)
    for name in ("whole", "halves, one stream"):
        kernels = profile(graphs[name], 5)
        kinds: dict[str, float] = defaultdict(float)
        for kernel, ms in kernels.items():
            kinds[kernel_kind(kernel)] += ms
        report["variants"][name]["kernels_ms"] = {k: round(v, 4) for k, v in kernels.items()}
        report["variants"][name]["kinds_ms"] = {k: round(v, 4) for k, v in kinds.items()}
        print(f"\n{name}: GPU time a step by kind: " + ", ".join(f"{k} {v:.3f}" for k, v in kinds.items()))
        for kernel, ms in list(kernels.items())[:12]:
            print(f"  {ms:8.3f} ms  {kernel[:110]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
