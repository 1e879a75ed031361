"""The FP8 GEMMs of a decode step of 1-32 rows: fp8_small_m_gemm's layouts against torch._scaled_mm.

For each row count and each way to compute the W8A8 products (`scaled_mm`: torch._scaled_mm as
GpuLlama._fp8_mm calls it; `MT.NT.B.U`: ops.fp8_small_m_gemm with MT token tiles, NT channel tiles
a block, B resident blocks an SM and U 64-k chunks a warp in flight, one of ops.FP8_SMALL_M_LAYOUTS; `default`: the layout the
engine takes), the µs of a CUDA-graph replay of the four GEMMs of `--layers` layers of fresh FP8
weights (qkv, o, gate/up, down of the shape: nothing stays in L2 between layers), each GEMM kind
alone over all layers and the four together, with the GB/s of weights read. One JSON line a
(rows, variant, kind) and a table a row count:

    python perf/bench_fp8_small_m.py --rows 3,8,12,16,17,24,32 --out $OUT/small_m.json

Needs a GPU with FP8 tensor cores (8.9+); Llama-3-8B shape: about 7 GB of FP8 weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inflightllm.models.llama import LlamaArch  # noqa: E402
from inflightllm.models.shapes import shape_config  # noqa: E402
from perf.bench_gemm import layer_shapes  # noqa: E402
from perf.bench_small_gemv import SHAPES, graph_us, weights  # noqa: E402

KINDS = ("qkv", "o", "gate_up", "down")


def parse_variants(text: str, layouts: tuple) -> list[str]:
    """`all`, or a comma list of `scaled_mm`, `default` and `MT.NT.B.U` layouts."""
    if text == "all":
        return ["scaled_mm", "default", *(".".join(map(str, layout)) for layout in layouts)]
    variants = [v.strip() for v in text.split(",") if v.strip()]
    known = {".".join(map(str, layout)) for layout in layouts} | {"scaled_mm", "default"}
    for variant in variants:
        if variant not in known:
            raise SystemExit(f"--variants: {variant!r} is not scaled_mm, default or one of {sorted(known)}")
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="3,8,12,16,17,24,32")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--variants", default="all", help="all, or scaled_mm,default,MT.NT.B.U,...")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_small_m needs a CUDA GPU")

    from inflightllm.gpu import ops
    from inflightllm.quantization.fp8 import quantize_per_token

    device = torch.cuda.current_device()
    if not ops.fp8_small_m_ok(8, 64, device):
        raise SystemExit("bench_fp8_small_m: fp8_small_m_gemm needs FP8 tensor cores (compute capability 8.9+)")
    variants = parse_variants(args.variants, ops.FP8_SMALL_M_LAYOUTS)
    rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows_list or min(rows_list) < 1 or max(rows_list) > ops.FP8_SMALL_M_MAX:
        raise SystemExit(f"--rows: 1 to {ops.FP8_SMALL_M_MAX}")
    torch.manual_seed(0)
    arch = LlamaArch.from_config(shape_config(args.shape))
    shapes = {kind: nk for kind, nk in layer_shapes(arch).items() if kind in KINDS}
    layers = [{kind: weights(n, k, True, torch.bfloat16) for kind, (n, k) in shapes.items()}
              for _ in range(args.layers)]
    records = []
    print(torch.cuda.get_device_name(), flush=True)
    for m in rows_list:
        inputs = {}
        for kind, (n, k) in shapes.items():
            x_q, x_scale = quantize_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            inputs[kind] = (x_q, x_scale.float().reshape(m, 1).contiguous(), torch.empty(m, n, device="cuda",
                                                                                    dtype=torch.bfloat16))
        table = {}
        for variant in variants:
            layout = None
            if variant not in ("scaled_mm", "default"):
                layout = tuple(int(part) for part in variant.split("."))
                if 8 * layout[0] < m:
                    continue

            def gemm(kind, layer, layout=layout, variant=variant, inputs=inputs):
                x_q, x_scale, out = inputs[kind]
                weight, scale = layer[kind]
                if variant == "scaled_mm":
                    torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                                     out_dtype=torch.bfloat16)
                else:
                    ops.fp8_small_m_gemm(out, x_q, x_scale.view(-1), weight, scale, layout=layout)

            for kind in (*KINDS, "all four"):
                chosen = KINDS if kind == "all four" else (kind,)

                def body(chosen=chosen):
                    for layer in layers:
                        for name in chosen:
                            gemm(name, layer)

                us = graph_us(body)
                size = sum(shapes[name][0] * shapes[name][1] for name in chosen) * args.layers
                record = {"rows": m, "variant": variant, "kind": kind, "us": round(us, 1),
                          "weights_gb_s": round(size / us / 1e3, 1)}
                records.append(record)
                table.setdefault(variant, {})[kind] = us
                print(json.dumps(record), flush=True)
        base = table["scaled_mm"]["all four"] if "scaled_mm" in table else None
        print(f"rows {m}: µs of the {args.layers} layers' four GEMMs (qkv / o / gate_up / down)", flush=True)
        for variant, by_kind in sorted(table.items(), key=lambda item: item[1]["all four"]):
            parts = " / ".join(f"{by_kind[kind]:.0f}" for kind in KINDS)
            ratio = f", {base / by_kind['all four']:.2f}x scaled_mm" if base else ""
            print(f"  {variant:>10}: {by_kind['all four']:8.1f} ({parts}){ratio}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
