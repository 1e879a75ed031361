"""The weight GEMMs of a model shape on the GPU, alone: TFLOP/s by rows (tokens) per call.

For each of the shape's linear layers (fused qkv, o, fused gate/up, down, LM head) and each
row count M, the median time of `torch.nn.functional.linear(x[M, in], W[out, in])` over CUDA
events, and the same M run as chunks of `--chunk` rows (one call per chunk), to show whether a
large prefill step would gain from splitting its GEMMs. Weights and inputs are random bf16
(normal, std 0.02 and 1), as in the engine's random-weight benchmarks. `--variants` adds other
ways to the same product, to find shapes where cuBLAS's default choice is slow:
`lt` (F.linear with torch's preferred BLAS library set to cublasLt) and `wt` (`x @ Wt`, the
weight stored transposed, [in, out]).

    python3 -m perf.bench_gemm --shape llama3-8b --rows 1024,4096,8192,16384,32768 --out $OUT/bench_gemm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from inflightllm.models.llama import LlamaArch
from inflightllm.models.shapes import shape_config


def layer_shapes(arch) -> dict[str, tuple[int, int]]:
    """(out, in) of each weight GEMM of one layer, and of the LM head."""
    hidden, head_dim = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * head_dim
    return {"qkv": (qkv, hidden), "o": (hidden, arch.num_heads * head_dim),
            "gate_up": (2 * arch.intermediate_size, hidden), "down": (hidden, arch.intermediate_size),
            "lm_head": (arch.vocab_size, hidden)}


def time_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def variant_ms(variant: str, x: torch.Tensor, weight: torch.Tensor, transposed: torch.Tensor | None) -> float:
    """The time of x @ weight.T computed another way (see --variants)."""
    if variant == "wt":
        return time_ms(lambda: torch.mm(x, transposed))
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return time_ms(lambda: F.linear(x, weight))
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--rows", default="1024,4096,8192,16384,32768")
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--variants", default="", help="comma-separated: lt, wt (see above)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - {"lt", "wt"}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; allowed: lt, wt")
    arch = LlamaArch.from_config(shape_config(args.shape))
    dtype, device = torch.bfloat16, "cuda"
    rows = [int(r) for r in args.rows.split(",")]
    x_all = torch.randn(max(rows), max(arch.intermediate_size, arch.hidden_size), device=device, dtype=dtype)
    square = torch.randn(8192, 8192, device=device, dtype=dtype) * 0.02
    ms = time_ms(lambda: square @ square)
    report = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "chunk": args.chunk,
              "square_8192_tflops": round(2 * 8192**3 / ms / 1e9, 1), "rows": {}}
    print(f"8192^3 matmul: {report['square_8192_tflops']} TFLOP/s", flush=True)
    for name, (out_features, in_features) in layer_shapes(arch).items():
        weight = torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02
        transposed = weight.t().contiguous() if "wt" in variants else None
        for m in rows:
            x = x_all[:m, :in_features]
            whole = time_ms(lambda x=x, w=weight: F.linear(x, w))
            chunks = [x[i:i + args.chunk] for i in range(0, m, args.chunk)]
            split = time_ms(lambda chunks=chunks, w=weight: [F.linear(c, w) for c in chunks]) if m > args.chunk else whole
            flop = 2 * m * out_features * in_features
            row = {"ms": round(whole, 4), "tflops": round(flop / whole / 1e9, 1),
                   "chunked_ms": round(split, 4), "chunked_tflops": round(flop / split / 1e9, 1)}
            report["rows"].setdefault(name, {})[m] = row
            extra = ""
            for variant in variants:
                ms = variant_ms(variant, x, weight, transposed)
                row[f"{variant}_ms"], row[f"{variant}_tflops"] = round(ms, 4), round(flop / ms / 1e9, 1)
                extra += f"   {variant}: {ms:8.3f} ms {row[f'{variant}_tflops']:6.1f}"
            print(f"{name:8s} {out_features:6d} x {in_features:5d}  M {m:6d}: {whole:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
                  f"   in chunks of {args.chunk}: {split:8.3f} ms {row['chunked_tflops']:6.1f} TFLOP/s{extra}", flush=True)
        del weight, transposed
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
