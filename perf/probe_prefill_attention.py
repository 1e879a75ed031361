"""Which of torch's attention kernels would serve the engine's prefill best on this GPU.

The engine's prefill attention (attention/cuda/backend.py, `_prefill_flash`) gathers each prompt's
K/V rows from the paged cache (dequantized from FP8) and calls torch's flash varlen forward
(FlashAttention 2): ~41 ms of a 16,384-token prefill step of Llama-3-8B on an H100, ~215 TFLOP/s
(docs/PERFORMANCE.md, "Where the time goes"). This probe times, on the same shapes (causal,
`--prompts` prompts of `--length` tokens, 32 query heads, 8 kv heads, d 128, bf16), each
candidate that this torch build offers, and checks it against the current one:

- `flash-varlen`: `aten._flash_attention_forward` over packed rows (the engine's call);
- `cudnn-varlen`: `aten._cudnn_attention_forward` with the same cumulative lengths (ragged),
  K/V repeated to the query heads where the op refuses GQA;
- `sdpa-cudnn`, `sdpa-flash`, `sdpa-efficient`: `F.scaled_dot_product_attention` on a dense batch
  [prompts, heads, length, d] under one backend each (`enable_gqa`);
- `flash-fp8`: `aten._flash_attention_forward.quantized` on e4m3 Q/K/V with descales, where the
  build has it (FlashAttention 3's FP8 path).

One JSON line per shape and candidate: ms a layer (median), the first call's ms (cuDNN builds
and caches an execution plan per new shape: what a step of a new shape pays once), TFLOP/s
(causal: half the square), the largest difference from `flash-varlen`, or the error it raised.
`--shapes` (PROMPTSxLENGTH, comma-separated) replaces `--prompts`/`--length`; `--candidates`
picks some. Needs a GPU:

    python3 -m perf.probe_prefill_attention --shapes 8x2048,64x128 --candidates flash-varlen,sdpa-cudnn
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from perf.bench_gemm import time_ms


def candidates(q, k, v, prompts: int, length: int, scale: float):
    """name -> a closure returning [prompts * length, heads, d] (bf16)."""
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    cu = torch.arange(0, (prompts + 1) * length, length, dtype=torch.int32, device=q.device)

    def flash_varlen():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, length, length, 0.0, True, False,
                                                       scale=scale)[0]

    def cudnn_varlen():
        try:
            kk, vv = k, v
            out = torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, length, length, False, 0.0, True,
                                                          False, scale=scale)[0]
        except RuntimeError:
            kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, length, length, False, 0.0, True,
                                                          False, scale=scale)[0]
        return out

    qd = q.view(prompts, length, heads, d).transpose(1, 2)
    kd = k.view(prompts, length, kv_heads, d).transpose(1, 2)
    vd = v.view(prompts, length, kv_heads, d).transpose(1, 2)

    def sdpa(backend):
        from torch.nn.attention import sdpa_kernel

        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(1, 2).reshape(prompts * length, heads, d)

        return run

    from torch.nn.attention import SDPBackend

    result = {
        "flash-varlen": flash_varlen,
        "cudnn-varlen": cudnn_varlen,
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    quantized = getattr(torch.ops.aten._flash_attention_forward, "quantized", None)
    if quantized is not None:
        e4m3 = torch.float8_e4m3fn
        descale = torch.ones(prompts, kv_heads, dtype=torch.float32, device=q.device)
        q8, k8, v8 = q.to(e4m3), k.to(e4m3), v.to(e4m3)

        def flash_fp8():
            out = quantized(q8, k8, v8, cu, cu, length, length, 0.0, True, False,
                            torch.ones(prompts, heads, dtype=torch.float32, device=q.device), descale, descale,
                            scale=scale)[0]
            return out.to(torch.bfloat16)

        result["flash-fp8"] = flash_fp8
    return result


def probe(prompts: int, length: int, args, wanted: set[str] | None) -> None:
    torch.manual_seed(0)
    tokens = prompts * length
    dev = "cuda"
    q = torch.randn(tokens, args.heads, args.head_dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(tokens, args.kv_heads, args.head_dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn(tokens, args.kv_heads, args.head_dim, dtype=torch.bfloat16, device=dev)
    scale = args.head_dim ** -0.5
    flops = 4 * prompts * args.heads * args.head_dim * length * length / 2
    reference = None
    for name, fn in candidates(q, k, v, prompts, length, scale).items():
        if wanted is not None and name not in wanted and name != "flash-varlen":
            continue
        line = {"shape": f"{prompts}x{length}", "candidate": name}
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            line["first_ms"] = round((time.perf_counter() - start) * 1e3, 2)
            if reference is None:
                reference = out.float()
            line["max_diff"] = round(float((out.float() - reference).abs().max()), 5)
            ms = time_ms(fn, args.iters, warmup=3)
            line.update(ms=round(ms, 4), tflop_s=round(flops / ms / 1e9, 1))
        except Exception as error:  # noqa: BLE001 - a candidate this build or GPU lacks: say why
            line["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--shapes", default=None, help="PROMPTSxLENGTH,... (instead of --prompts/--length)")
    parser.add_argument("--candidates", default=None, help="comma-separated names (flash-varlen always runs)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    shapes = [(args.prompts, args.length)]
    if args.shapes:
        shapes = [tuple(int(x) for x in item.lower().split("x")) for item in args.shapes.split(",") if item]
    wanted = set(args.candidates.split(",")) if args.candidates else None
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}: "
          f"{args.heads}/{args.kv_heads} heads, d {args.head_dim}", flush=True)
    for prompts, length in shapes:
        probe(prompts, length, args, wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
