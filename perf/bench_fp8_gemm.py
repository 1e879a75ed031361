"""The FP8 weight GEMMs of a model shape on the GPU, alone, by scaling recipe: TFLOP/s by rows.

For each linear layer of one decoder layer (fused qkv, o, fused gate/up, down) and each row count
M, the median time of `torch._scaled_mm` on e4m3 operands under each recipe of `--recipes`:

- `row`: per-token activation scales [M, 1] and per-channel weight scales [1, N] (the engine's
  `model.quantization: fp8`), bf16 out;
- `row-fast`: the same with `use_fast_accum` (cuBLASLt's faster, less exact accumulation);
- `tensor`: one scale for the activations and one for the weights (TensorRT-LLM's and vLLM's
  default FP8 recipe), bf16 out;
- `tensor-fast`: the same with `use_fast_accum`;
- `row-t`: `row` computed transposed, out^T = W x^T (the weights as the first operand, [N, M]
  out): cuBLASLt tiles the weights' N as its M, which changes its tile count at a few hundred rows;
- `row-k2`, `row-k4`: `row` split over K into 2 or 4 parts, run as one batched
  `torch._scaled_grouped_mm` whose bf16 partial products are then summed: more output tiles for
  products that leave SMs idle (the o and qkv GEMMs at a few hundred rows). The engine's
  `inflightllm.gpu.fp8_split_k` (strided views of x and the weights, no copies) where the GPU's
  torch computes the right product with it, else the grouped GEMM on contiguous slices (the activations' copied each call, the weights' at load); the
  first call of each shape prints the layout taken and its largest difference from `row`
  (`"split_k_check"`);
- `bf16`: `F.linear` on the bf16 weights (the baseline).

`--copies N` rotates N sets of operands from call to call, so that a layer's weights come from
DRAM as in a step of 32 layers rather than from L2 (the 8B shape's qkv and o weights fit the
H100's 50 MB of L2). Each line gives the weights' bytes over the time (`weight_gb_s`): at a few
hundred rows the GEMMs are bound by those bytes as much as by their operations.

It prints one JSON line per (layer, M, recipe) and, per M and recipe, the four layers together
(ms and TFLOP/s), so that a recipe's gain on a whole layer's GEMMs reads directly:

    python3 -m perf.bench_fp8_gemm --rows 1024,4096,16384 --recipes row,row-fast,tensor,bf16
    python3 -m perf.bench_fp8_gemm --rows 128,256,512,1024 --recipes row,row-t --copies 8
    python3 -m perf.bench_fp8_gemm --rows 64,128,256,512 --recipes row,row-k2,row-k4 --copies 8
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from inflightllm.gpu import fp8_split_k
from inflightllm.models.llama import LlamaArch
from inflightllm.models.shapes import shape_config
from perf.bench_gemm import layer_shapes, time_ms

RECIPES = ("row", "row-fast", "row-t", "row-k2", "row-k4", "tensor", "tensor-fast", "bf16")
SPLIT_K = {"row-k2": 2, "row-k4": 4}


def gemm_fn(recipe: str, m: int, n: int, k: int, dev: str = "cuda", copies: int = 1):
    """A closure running one [m, k] x [k, n] product of `recipe` on random operands, each call on
    the next of `copies` sets of them."""
    calls = [_one_gemm(recipe, m, n, k, dev) for _ in range(max(1, copies))]
    if len(calls) == 1:
        return calls[0]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _one_gemm(recipe: str, m: int, n: int, k: int, dev: str):
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    if recipe == "bf16":
        return lambda: F.linear(x, w)
    e4m3 = torch.float8_e4m3fn
    fast = recipe.endswith("-fast")
    if recipe.startswith("row"):
        sa = x.abs().amax(dim=1, keepdim=True).float() / 448.0
        sb = w.abs().amax(dim=1, keepdim=True).float().t().contiguous() / 448.0
        xq, wq = (x / sa).to(e4m3), (w / sb.t()).to(e4m3)
    else:
        sa = (x.abs().amax().float() / 448.0).reshape(())
        sb = (w.abs().amax().float() / 448.0).reshape(())
        xq, wq = (x / sa).to(e4m3), (w / sb).to(e4m3)
    if recipe == "row-t":  # [n, k] x [k, m] (x^T column-major), scales [n, 1] and [1, m]
        sw, sx, xt = sb.t().contiguous(), sa.t().contiguous(), xq.t()
        return lambda: torch._scaled_mm(wq, xt, scale_a=sw, scale_b=sx, out_dtype=torch.bfloat16)
    if recipe in SPLIT_K:
        return _split_k(xq, wq, sa, sb, SPLIT_K[recipe])
    wt = wq.t()  # [k, n], column-major: the layout _scaled_mm wants for its second operand
    return lambda: torch._scaled_mm(xq, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)


def packed_slices(w_slices: torch.Tensor) -> torch.Tensor:
    """fp8_split_k.weight_slices' views [parts, k/parts, n] copied so that each slice is a
    contiguous column-major block (the `copies` layout)."""
    return w_slices.transpose(1, 2).contiguous().transpose(1, 2)


# Per (parts, m, n, k): the layout and scale form that computed `row`'s product on this GPU.
_SPLIT_CHOICE: dict[tuple[int, ...], tuple[str, bool]] = {}


def _split_k(xq, wq, sa, sb, parts: int):
    """The engine's split-K (inflightllm.gpu.fp8_split_k: views, no copies) where this GPU's
    torch computes `row`'s product with it, else the same grouped GEMM on contiguous slices."""
    w_slices, w_scales = fp8_split_k.weight_slices(wq, sb, parts)
    if not xq.is_cuda:  # no grouped kernel on the CPU: split_k_mm's one product a slice
        return lambda: fp8_split_k.split_k_mm(xq, sa, w_slices, w_scales)
    m = xq.shape[0]

    def make(layout: str, flat: bool):
        if layout == "views":
            return lambda: fp8_split_k.split_k_mm(xq, sa, w_slices, w_scales, flat)
        packed = packed_slices(w_slices)
        x_scales = sa.reshape(1, m).expand(parts, m).contiguous()
        scales = (x_scales.reshape(-1), w_scales.reshape(-1)) if flat else (x_scales, w_scales)

        def run():  # the activations' slices copied contiguous each call, the weights' once
            xs = fp8_split_k.x_slices(xq, parts).contiguous()
            return torch._scaled_grouped_mm(xs, packed, *scales, out_dtype=torch.bfloat16).sum(dim=0)
        return run

    key = (parts, m, *wq.shape)
    if key in _SPLIT_CHOICE:
        return make(*_SPLIT_CHOICE[key])
    ref = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
    tried = []
    for layout in ("views", "copies"):
        for flat in (False, True):  # row-wise scales of 3-D operands: [groups, rows], or flattened
            run = make(layout, flat)
            try:
                diff = float((run().float() - ref).abs().max())
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
                tried.append(f"{layout}/{'flat' if flat else '2d'}: {(str(error).splitlines() or [type(error).__name__])[0][:160]}")
                continue
            ok = diff <= float(ref.abs().max()) / 64
            print(json.dumps({"split_k_check": parts, "m": m, "n": wq.shape[0], "k": wq.shape[1],
                              "layout": layout, "flat_scales": flat, "max_abs_diff": round(diff, 5),
                              "max_abs_ref": round(float(ref.abs().max()), 5), "ok": ok}), flush=True)
            if ok:
                _SPLIT_CHOICE[key] = (layout, flat)
                return run
            tried.append(f"{layout}/{'flat' if flat else '2d'}: differs from row by {diff:.4g}")
    raise RuntimeError("split-K through torch._scaled_grouped_mm: " + "; ".join(tried))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--rows", default="1024,4096,16384")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--copies", type=int, default=1, help="sets of operands rotated call to call (L2)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm needs a CUDA GPU")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for recipe in recipes:
        if recipe not in RECIPES:
            raise SystemExit(f"--recipes: {recipe!r} is not one of {', '.join(RECIPES)}")
    rows = [int(r) for r in args.rows.split(",")]
    shapes = {name: nk for name, nk in layer_shapes(LlamaArch.from_config(shape_config(args.shape))).items()
              if name != "lm_head"}
    print(torch.cuda.get_device_name(), flush=True)
    for m in rows:
        totals = {}
        for recipe in recipes:
            total_ms = total_flop = 0.0
            for name, (n, k) in shapes.items():
                try:
                    ms = time_ms(gemm_fn(recipe, m, n, k, copies=args.copies), iters=30)
                except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:  # a recipe the GPU's torch lacks
                    print(json.dumps({"layer": name, "rows": m, "recipe": recipe, "error": str(error)[:300]}),
                          flush=True)
                    total_ms = float("nan")
                    break
                flop = 2.0 * m * n * k
                total_ms += ms
                total_flop += flop
                print(json.dumps({"layer": name, "rows": m, "recipe": recipe, "ms": round(ms, 4),
                                  "tflop_s": round(flop / ms / 1e9, 1),
                                  "weight_gb_s": round(n * k * (2 if recipe == "bf16" else 1) / ms / 1e6, 1)}),
                      flush=True)
                torch.cuda.empty_cache()
            if total_ms != total_ms:
                continue
            totals[recipe] = total_ms
            print(json.dumps({"layer": "all four", "rows": m, "recipe": recipe, "ms": round(total_ms, 4),
                              "tflop_s": round(total_flop / total_ms / 1e9, 1)}), flush=True)
        base = totals.get("row")
        if base:
            print(f"rows {m}: " + ", ".join(f"{r} {base / t:.3f}x" for r, t in totals.items()) + " of row's speed",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
