"""Where a one-token decode step's GPU time goes: the small-batch kernels alone and chained.

The batch-1 decode step of an 8B model is bound by reading its weights once (FP8: 7.0 GB of
layer weights and the 1.05 GB bf16 LM head). This benchmark times, by CUDA-graph replay of
`--layers` layers of fresh weights (nothing stays in L2), each small-batch kernel alone (one
launch a layer, in a PDL chain), the four GEMV kernels of a layer chained (no attention), the
whole layer (the real CudaPagedAttention decode in between, a `--context`-token bf16 cache),
and the LM head, each against the bytes it must read. The differences say what the kernel
boundaries and the attention cost beyond the weight reads.

    python perf/bench_small_gemv.py --weights fp8 --out $OUT/small_gemv.json
    INFLIGHTLLM_FP8_GEMV_U=16 INFLIGHTLLM_SMALL_BLOCKS=2 python perf/bench_small_gemv.py --warps 4

INFLIGHTLLM_FP8_GEMV_U (FP8 chunks of 8 bytes in flight a lane) and INFLIGHTLLM_SMALL_BLOCKS
(the resident blocks a SM the one-token kernels' registers are set for) are compile-time
settings of inflightllm/gpu/layers.cu (ops.small_gemv_defines); `--warps` the warps a block.
Needs a GPU (Llama-3-8B shape: about 8 GB of FP8 weights, 16 GB in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # hidden, intermediate, heads, kv heads, head dim, vocab
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256),
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152),
}


def graph_us(body, replays: int = 20) -> float:
    """Median µs of one replay of a CUDA graph of `body` (captured as the engine does)."""
    from inflightllm.gpu import ops
    from perf.bench_overlap import replay_ms

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), ops.torch_stream():
        body()  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        with ops.torch_stream():
            body()
    us = replay_ms(graph, replays) * 1e3
    del graph
    return us


def weights(rows: int, cols: int, fp8: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    from inflightllm.quantization.fp8 import quantize_per_channel

    w = torch.randn(rows, cols, device="cuda", dtype=dtype) * 0.02
    if not fp8:
        return w, None
    q, scale = quantize_per_channel(w)
    return q, scale.float().reshape(-1).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--weights", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=128, help="tokens of the decode's KV cache")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="the attention's longest context: its decode splits (as the runner's graphs)")
    parser.add_argument("--warps", type=int, default=None, help="warps a block (1..8; default ops._WARPS_PER_BLOCK)")
    parser.add_argument("--label", default="", help="a name for this variant in the output")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from inflightllm.attention.base import SequenceSlice
    from inflightllm.attention.cuda import CudaPagedAttention
    from inflightllm.gpu import ops

    if args.warps is not None:
        if not 1 <= args.warps <= 8:
            parser.error("--warps: 1..8 (the kernels are built for at most 256 threads a block)")
        ops._WARPS_PER_BLOCK = args.warps
    torch.manual_seed(0)
    hidden, inter, heads, kv_heads, head_dim, vocab = SHAPES[args.shape]
    dtype, fp8, n = torch.bfloat16, args.weights == "fp8", args.layers
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    layers = []
    for _ in range(n):
        layer = {}
        for name, rows, cols in (("qkv", q_size + 2 * kv_size, hidden), ("o", hidden, q_size),
                                 ("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            layer[name], layer[name + "_scale"] = weights(rows, cols, fp8, dtype)
        layer["input_norm"] = torch.ones(hidden, device="cuda", dtype=dtype)
        layer["post_norm"] = torch.ones(hidden, device="cuda", dtype=dtype)
        layers.append(layer)
    lm_head = torch.randn(vocab, hidden, device="cuda", dtype=dtype) * 0.02
    bytes_of = {name: layers[0][name].numel() * layers[0][name].element_size() for name in ("qkv", "o", "gate_up", "down")}

    residual = torch.randn(1, hidden, device="cuda", dtype=dtype)
    spare = torch.empty_like(residual)
    delta0 = torch.randn(1, hidden, device="cuda", dtype=dtype) * 0.1
    qkv = torch.empty(1, q_size + 2 * kv_size, device="cuda", dtype=dtype)
    attended = torch.randn(1, q_size, device="cuda", dtype=dtype)
    delta = torch.empty(1, hidden, device="cuda", dtype=dtype)
    act = torch.empty(1, inter, device="cuda", dtype=dtype)
    positions = torch.full((1,), args.context - 1, device="cuda", dtype=torch.int64)
    max_len = max(args.max_model_len, args.context)
    cos_sin = torch.randn(max_len, head_dim, device="cuda", dtype=dtype)
    eps = 1e-5

    block_size = 16
    attention = CudaPagedAttention(heads, kv_heads, head_dim, max_model_len=max_len)
    blocks = -(-args.context // block_size)
    attention.allocate_kv_cache(blocks + 8, block_size, n, kv_heads, head_dim, dtype, torch.device("cuda"))
    metadata = attention.build_metadata([SequenceSlice(0, 1, args.context, tuple(range(blocks)))], "cuda")
    metadata.max_context_len = max_len  # as the runner's graphs: splits for the longest context
    slots = metadata.slot_mapping

    def run_qkv(layer, index, kv=False):
        ops.qkv_norm_rope(qkv, residual, delta0, spare, layer["input_norm"], layer["qkv"], None, positions, cos_sin,
                          heads, kv_heads, head_dim, eps,
                          *((slots, attention.key_cache[index], attention.value_cache[index]) if kv else (None, None, None)),
                          weight_scale=layer["qkv_scale"])

    def run_o(layer, x=None):
        ops.small_gemv(delta, attended if x is None else x, layer["o"], None, weight_scale=layer["o_scale"])

    def run_gate_up(layer):
        ops.gate_up_norm_silu(act, residual, delta0, spare, layer["post_norm"], layer["gate_up"], None, eps,
                              weight_scale=layer["gate_up_scale"])

    def run_down(layer):
        ops.small_gemv(delta, act, layer["down"], None, weight_scale=layer["down_scale"])

    def gemvs():
        for layer in layers:
            run_qkv(layer, 0)
            run_o(layer)
            run_gate_up(layer)
            run_down(layer)

    def whole_layers():
        for index, layer in enumerate(layers):
            run_qkv(layer, index, kv=True)
            out = attention.forward(index, qkv[:, :q_size].view(1, heads, head_dim),
                                    qkv[:, q_size:q_size + kv_size].view(1, kv_heads, head_dim),
                                    qkv[:, q_size + kv_size:].view(1, kv_heads, head_dim), metadata, kv_written=True)
            run_o(layer, out.reshape(1, q_size))
            run_gate_up(layer)
            run_down(layer)

    def attention_only():
        for index in range(n):
            attention.forward(index, qkv[:, :q_size].view(1, heads, head_dim),
                              qkv[:, q_size:q_size + kv_size].view(1, kv_heads, head_dim),
                              qkv[:, q_size + kv_size:].view(1, kv_heads, head_dim), metadata, kv_written=True)

    def head():
        torch.nn.functional.linear(residual, lm_head)

    copy_src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)

    cases = {
        "qkv_norm_rope": (lambda: [run_qkv(layer, 0) for layer in layers], bytes_of["qkv"]),
        "small_gemv o": (lambda: [run_o(layer) for layer in layers], bytes_of["o"]),
        "gate_up_norm_silu": (lambda: [run_gate_up(layer) for layer in layers], bytes_of["gate_up"]),
        "small_gemv down": (lambda: [run_down(layer) for layer in layers], bytes_of["down"]),
        "the 4 GEMVs a layer": (gemvs, sum(bytes_of.values())),
        "attention (decode) alone": (attention_only, 0),
        "whole layers": (whole_layers, sum(bytes_of.values())),
    }
    impl, splits = attention.decode_kernel(1)
    report = {
        "shape": args.shape, "weights": args.weights, "layers": n, "context": args.context,
        "label": args.label, "warps": ops._WARPS_PER_BLOCK, "defines": list(ops.small_gemv_defines()),
        "decode_kernel": f"{impl}, {splits} splits", "device": torch.cuda.get_device_name(), "rows": [],
    }
    copy_us = graph_us(lambda: copy_dst.copy_(copy_src))
    floor = 2 * copy_src.numel() / copy_us / 1e3  # GB/s, read + write
    print(f"{args.label or 'default'}: {report['device']}, {args.weights} weights, warps {report['warps']}, "
          f"{' '.join(report['defines'])}; device copy {floor:.0f} GB/s (read + write)", flush=True)
    report["copy_gb_s"] = round(floor, 1)
    for name, (body, per_layer) in cases.items():
        us = graph_us(body)
        gb_s = per_layer * n / us / 1e3 if per_layer else float("nan")
        report["rows"].append({"case": name, "us_total": round(us, 1), "us_per_layer": round(us / n, 2),
                               "weight_gb_s": round(gb_s, 1)})
        print(f"  {name:26s} {us:9.1f} µs for {n} layers = {us / n:7.2f} µs a layer"
              + (f", {gb_s:7.0f} GB/s of weights" if per_layer else ""), flush=True)
    us = graph_us(head)
    lm_bytes = lm_head.numel() * lm_head.element_size()
    report["rows"].append({"case": "LM head (bf16)", "us_total": round(us, 1), "weight_gb_s": round(lm_bytes / us / 1e3, 1)})
    print(f"  {'LM head (bf16)':26s} {us:9.1f} µs, {lm_bytes / us / 1e3:7.0f} GB/s", flush=True)
    # model.fp8_lm_head / int8_lm_head: the one-token steps' LM head, e4m3 or int8 rows read by
    # small_gemv (weight-only)
    from inflightllm.quantization.fp8 import quantize_lm_head

    logits = torch.empty(1, vocab, device="cuda", dtype=dtype)
    for kind in ("e4m3", "int8"):
        head_q, head_scale = quantize_lm_head(lm_head, kind)
        head_scale = head_scale.view(1, -1).contiguous()
        us = graph_us(lambda q=head_q, s=head_scale: ops.small_gemv(logits, residual, q, None, weight_scale=s))
        name = f"LM head ({kind}, small_gemv)"
        report["rows"].append({"case": name, "us_total": round(us, 1), "weight_gb_s": round(head_q.numel() / us / 1e3, 1)})
        print(f"  {name:26s} {us:9.1f} µs, {head_q.numel() / us / 1e3:7.0f} GB/s", flush=True)
        del head_q, head_scale
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
