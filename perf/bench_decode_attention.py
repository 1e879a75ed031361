"""One layer's decode attention on the GPU: cache write + decode + split reduce, replayed from a
CUDA graph, Llama-3-8B attention shape (32 heads, 8 kv heads, head_dim 128, block 16), each
sequence's blocks in a random order. Prints the median µs per case and the K/V bytes the
decode reads over that time (GB/s), as JSON lines, for any compile-time variant of the
kernels (set their environment variables per process, e.g. INFLIGHTLLM_DECODE_V5_KV_HEADS;
perf/run_decode_ab_device.sh runs variants side by side):

    python -m perf.bench_decode_attention --cases 256x2048,32x2048,512x1088 --cache fp8
    ncu --clock-control none -k regex:paged_decode_v5 -c 1 -s 5 python -m perf.bench_decode_attention --cases 256x2048 --repeats 8

`--kv-heads` sets paged_decode_v5's kv heads a block (default: the backend's choice).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda import CudaPagedAttention
from inflightllm.quantization.fp8 import quantize_with_scale


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        batch, _, ctx = item.strip().partition("x")
        if not (batch.isdigit() and ctx.isdigit()) or int(batch) < 1 or int(ctx) < 1:
            raise SystemExit(f"--cases: {item!r} is not BATCHxCONTEXT (e.g. 256x2048)")
        cases.append((int(batch), int(ctx)))
    return cases


def forward_graph(backend: CudaPagedAttention, metadata, batch: int, dtype: torch.dtype, dev: str = "cuda",
                  warmups: int = 1):
    """A CUDA graph of one `backend.forward` (layer 0) of `batch` decodes over `metadata`, after
    `warmups` forwards on a side stream, with its static inputs: random `dtype` queries and new
    K/V rows (drawn q, k, v in that order) and the output buffer. Returns (graph, q, k, v, out)."""
    h, kvh, d = backend.num_heads, backend.num_kv_heads, backend.head_dim
    q = torch.randn(batch, h, d, device=dev).to(dtype)
    k = torch.randn(batch, kvh, d, device=dev).to(dtype)
    v = torch.randn(batch, kvh, d, device=dev).to(dtype)
    out = torch.empty(batch, h, d, dtype=dtype, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            backend.forward(0, q, k, v, metadata, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(0, q, k, v, metadata, out=out)
    return graph, q, k, v, out


def decode_layer_us(backend: CudaPagedAttention, batch: int, ctx: int, num_blocks: int, max_ctx: int,
                    repeats: int, dev: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> list[float]:
    """µs of each of `repeats` replays of one decode forward (cache write + decode + reduce) of
    `batch` sequences of `ctx` tokens, their blocks a random permutation of the cache's (seeded
    by the batch), captured in a CUDA graph; random `dtype` queries and new K/V rows. Raises if
    the output is not finite."""
    from perf.bench_overlap import replay_times_ms

    bs = backend.block_size
    gen = torch.Generator().manual_seed(batch)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    n = math.ceil(ctx / bs)
    if batch * n > num_blocks:
        raise ValueError(f"{batch}x{ctx}: {batch * n} blocks of {bs} tokens, the cache has {num_blocks}")
    seqs = [SequenceSlice(i, 1, ctx, tuple(perm[i * n : (i + 1) * n])) for i in range(batch)]
    md = backend.build_metadata(seqs, dev)
    md.max_context_len = max_ctx
    graph, _, _, _, out = forward_graph(backend, md, batch, dtype, dev)
    samples = [ms * 1e3 for ms in replay_times_ms(graph, repeats)]
    if not torch.isfinite(out).all():
        raise RuntimeError(f"{batch}x{ctx}: the output has non-finite values")
    return samples

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="256x2048,32x2048,1x8192")
    parser.add_argument("--cache", choices=("fp8", "auto"), default="fp8")
    parser.add_argument("--kv-heads", type=int, choices=(1, 2, 4), default=None)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads-total", type=int, default=8)
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--label", default=os.environ.get("VARIANT", ""))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention needs a CUDA GPU")
    dev = "cuda"
    h, kvh, d, bs = args.heads, args.kv_heads_total, args.head_dim, args.block_size
    cases = parse_cases(args.cases)
    max_ctx = max(ctx for _, ctx in cases)
    num_blocks = max(batch * math.ceil(ctx / bs) for batch, ctx in cases) + 64
    backend = CudaPagedAttention(h, kvh, d, max_model_len=max_ctx, kv_cache_dtype=args.cache)
    if args.kv_heads:
        backend.v5_kv_heads = args.kv_heads
    backend.allocate_kv_cache(num_blocks, bs, 1, kvh, d, torch.bfloat16, dev)
    if args.cache == "fp8":
        cache = backend.kv_cache.view(-1)
        for start in range(0, cache.numel(), 1 << 28):  # in slices: a float32 copy of the whole cache may not fit
            part = cache[start : start + (1 << 28)]
            part.copy_(quantize_with_scale(torch.randn(part.numel(), device=dev), 1.0).view(torch.uint8))
    else:
        backend.kv_cache.normal_()
    element = 1 if args.cache == "fp8" else 2
    for batch, ctx in cases:
        samples = decode_layer_us(backend, batch, ctx, num_blocks, max_ctx, args.repeats, dev)
        us = statistics.median(samples)
        kv_bytes = 2 * batch * ctx * kvh * d * element
        impl, splits = backend.decode_kernel(batch)
        print(json.dumps({"variant": args.label, "cache": args.cache, "batch": batch, "context": ctx,
                          "kernel": impl, "splits": splits, "median_us": round(us, 1),
                          "min_us": round(min(samples), 1), "kv_gb_s": round(kv_bytes / us / 1e3, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
