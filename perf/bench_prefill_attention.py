"""One layer's prefill attention on the GPU (CudaPagedAttention.forward: cache write, K/V gather,
attention), Llama-3-8B attention shape (32 heads, 8 kv heads, head_dim 128, block 16), queries
and new K/V as strided views of one fused qkv projection as the model makes them, with the
cuDNN dense segments at their default threshold and off (INFLIGHTLLM_PREFILL_CUDNN_MIN_LEN=0's
value), side by side in one process. A case is `+`-joined groups of PROMPTSxLENGTH (whole
prompts) or PROMPTSxLENGTH@CONTEXT (chunks / prefix hits of LENGTH new tokens over CONTEXT), in
packed order. Prints one JSON line per case and threshold: median ms, the dense calls a
forward made, whether the strided query had to be packed:

    python -m perf.bench_prefill_attention --cases 4x2048,3x2048+1x1500,1x2048@4096+3x2048 --cache fp8
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda import CudaPagedAttention
from perf.bench_gemm import time_ms


def parse_case(text: str) -> list[tuple[int, int]]:
    """'3x2048+1x1500@2048' -> [(2048, 2048)] * 3 + [(1500, 2048)] (query, context) pairs."""
    specs = []
    for group in text.split("+"):
        count, _, rest = group.partition("x")
        length, _, context = rest.partition("@")
        if not (count.isdigit() and length.isdigit() and (not context or context.isdigit())):
            raise SystemExit(f"--cases: {group!r} is not PROMPTSxLENGTH or PROMPTSxLENGTH@CONTEXT")
        specs += [(int(length), int(context or length))] * int(count)
    return specs


def run_case(text: str, cache: str, iters: int) -> None:
    h, kvh, d, bs, dev, dtype = 32, 8, 128, 16, "cuda", torch.bfloat16
    specs = parse_case(text)
    backend = CudaPagedAttention(h, kvh, d, max_model_len=8192, kv_cache_dtype="fp8" if cache == "fp8" else "auto")
    needed = [math.ceil(ctx / bs) for _, ctx in specs]
    backend.allocate_kv_cache(sum(needed) + 8, bs, 1, kvh, d, dtype, dev)
    perm = torch.randperm(sum(needed)).tolist()
    sequences, start, used = [], 0, 0
    for (ql, ctx), nb in zip(specs, needed):
        sequences.append(SequenceSlice(start, ql, ctx, tuple(perm[used : used + nb])))
        used += nb
        start += ql
    qkv = torch.randn(start, (h + 2 * kvh) * d, device=dev).to(dtype)
    q = qkv[:, : h * d].view(start, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(start, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(start, kvh, d)
    out = torch.empty(start, h, d, dtype=dtype, device=dev)
    metadata = backend.build_metadata(sequences, dev)
    calls = []
    dense = backend._dense

    def counting(*a, dense=dense, calls=calls):
        calls.append(list(a[3:5]))
        return dense(*a)

    backend._dense = counting
    default = backend.prefill_cudnn_min_len
    results = {}
    for min_len in (default, 0):
        backend.prefill_cudnn_min_len = min_len
        calls.clear()
        backend.forward(0, q, k, v, metadata, out=out)
        torch.cuda.synchronize()
        made = list(calls)
        ms = time_ms(lambda: backend.forward(0, q, k, v, metadata, out=out), iters, warmup=3)
        results[min_len] = out.float().clone()
        print(json.dumps({"case": text, "cache": cache, "min_len": min_len, "ms": round(ms, 4),
                          "dense_calls": made, "packed_q": backend._cudnn_packed_q,
                          "cudnn_error": backend._cudnn_error}), flush=True)
    diff = float((results[default] - results[0]).norm() / results[0].norm())
    print(json.dumps({"case": text, "rel_diff_dense_vs_varlen": round(diff, 6)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="4x2048,3x2048+1x1500,8x1024,1x2048@4096+3x2048,2x600+5x300")
    parser.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for text in args.cases.split(","):
        run_case(text, args.cache, args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
