"""The FP8 activation-quantizing kernels on the GPU, alone: µs and TB/s by rows.

For each row count M, the median time of one launch (a CUDA graph of `--launches` launches,
replayed `--iters` times) of each kernel the FP8 model runs before a GEMM (inflightllm/gpu/ops.py):

- `silu-v2`, `silu-tma`: SiLU*mul of the gate/up GEMM's output [M, 2 x intermediate] into e4m3
  rows and per-row scales (version 2: the row in registers; TMA: the row in shared memory by
  cp.async.bulk, Hopper);
- `norm`: residual add + RMSNorm into e4m3 [M, hidden] (version 2);
- `rows`: plain rows [M, hidden] into e4m3 (the o projection's input, version 2).

TB/s counts each kernel's bytes once: what it reads and writes (e4m3 rows and float32 scales).
One JSON line per (kernel, M):

    python3 -m perf.bench_fp8_quant --rows 256,1024,4096,16384
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from inflightllm.models.shapes import shape_config
from perf.bench_overlap import replay_times_ms

KERNELS = ("silu-v2", "silu-tma", "norm", "rows")


def kernel_fn(kernel: str, m: int, hidden: int, inter: int, dev: str = "cuda"):
    """(a closure launching `kernel` once on random rows of M tokens, the bytes it moves)."""
    from inflightllm.gpu import ops

    dtype = torch.bfloat16
    e4m3 = torch.float8_e4m3fn
    if kernel.startswith("silu"):
        gate_up = torch.randn(m, 2 * inter, dtype=dtype, device=dev) * 2
        q = torch.empty(m, inter, dtype=e4m3, device=dev)
        scale = torch.empty(m, 1, dtype=torch.float32, device=dev)
        tma = kernel == "silu-tma"
        return (lambda: ops.silu_and_mul_fp8(q, scale, gate_up, tma=tma)), m * (4 * inter + inter + 4)
    q = torch.empty(m, hidden, dtype=e4m3, device=dev)
    scale = torch.empty(m, 1, dtype=torch.float32, device=dev)
    if kernel == "norm":
        residual = torch.randn(m, hidden, dtype=dtype, device=dev)
        delta = torch.randn(m, hidden, dtype=dtype, device=dev)
        weight = torch.ones(hidden, dtype=dtype, device=dev)
        # reads residual and delta, writes the residual back and the e4m3 row
        return (lambda: ops.add_rms_norm_fp8(q, scale, delta, residual, weight, 1e-5)), m * (6 * hidden + hidden + 4)
    x = torch.randn(m, hidden, dtype=dtype, device=dev)
    return (lambda: ops.quant_rows_fp8(q, scale, x)), m * (2 * hidden + hidden + 4)


def time_us(fn, launches: int, iters: int) -> float:
    """Median µs of one launch of `fn`: a CUDA graph of `launches` launches, replayed."""
    from inflightllm.gpu import ops

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), ops.torch_stream():
        fn()  # compiles, sets the shared-memory attribute
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), ops.torch_stream():
        for _ in range(launches):
            fn()
    return statistics.median(replay_times_ms(graph, iters)) * 1000 / launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--rows", default="256,1024,4096,16384")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    config = shape_config(args.shape)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    for name in kernels:
        if name not in KERNELS:
            raise SystemExit(f"--kernels: {name!r} is not one of {', '.join(KERNELS)}")
    print(f"# {torch.cuda.get_device_name()}, {args.shape}: hidden {hidden}, intermediate {inter}", flush=True)
    for m in (int(r) for r in args.rows.split(",")):
        for name in kernels:
            fn, moved = kernel_fn(name, m, hidden, inter)
            us = time_us(fn, args.launches, args.iters)
            print(json.dumps({"kernel": name, "rows": m, "us": round(us, 2), "tb_s": round(moved / us / 1e6, 3)}),
                  flush=True)
            del fn
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
