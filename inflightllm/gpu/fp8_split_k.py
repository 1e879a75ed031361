"""Split-K FP8 GEMMs for a few hundred rows (`INFLIGHTLLM_FP8_SPLIT_K`; off until measured).

At 64-512 rows the Llama-3-8B qkv and o GEMMs take ~32 us each through `torch._scaled_mm`
whatever the rows (one H100, `perf/bench_fp8_gemm.py`, docs/PERFORMANCE.md): their 4,096- and
6,144-wide outputs make 64-96 tiles of 128 x 128 for 132 SMs, so half the GPU waits while each
tile walks the whole K. Split into P slices of K, the same product is P times as many tiles, each
1/P as long: one batched `torch._scaled_grouped_mm` over the slices (row-wise scales factor out of
K, so every slice takes the row's and the channel's scales as they are), then the P bf16 partial
products summed (fp32 accumulation, one rounding to bf16).

The operands are views (no copies): x [M, K] as [P, M, K/P] and the weights [N, K] as
[P, K/P, N] (each slice column-major, the layout the grouped GEMM wants). GpuLlama checks at load
that the GPU's torch computes `torch._scaled_mm`'s product with them and turns split-K off with a
log line where it does not (or where the GPU has no grouped FP8 GEMM).

`INFLIGHTLLM_FP8_SPLIT_K=P:R[:names]`: P slices (2, 4 or 8) for the FP8 GEMMs of more than
`fp8_small_m_rows` and at most R rows; names: which fused linears (default qkv, o and down, the
ones whose outputs give few tiles). Unset, empty, 0 or off: none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SPLIT_K_ENV = "INFLIGHTLLM_FP8_SPLIT_K"
SPLIT_K_PARTS = (2, 4, 8)
SPLIT_K_LINEARS = ("qkv", "o", "down")
_ALL_LINEARS = ("qkv", "o", "gate_up", "down")
_MAX_ROWS = 16384


@dataclass(frozen=True)
class SplitK:
    parts: int
    max_rows: int
    linears: tuple[str, ...] = SPLIT_K_LINEARS
    flat_scales: bool = False  # the grouped GEMM's scales flattened ([P*M]) rather than [P, M]


def setting() -> SplitK | None:
    """`INFLIGHTLLM_FP8_SPLIT_K` as a SplitK, or None (off). A malformed value raises
    ValueError naming the variable, the value and what is allowed."""
    raw = os.environ.get(SPLIT_K_ENV, "").strip()
    if raw.lower() in ("", "0", "off"):
        return None
    allowed = (f"give P:R or P:R:names, P slices of K ({', '.join(map(str, SPLIT_K_PARTS))}), R the most "
               f"rows (33 to {_MAX_ROWS}), names some of {', '.join(_ALL_LINEARS)} (default "
               f"{','.join(SPLIT_K_LINEARS)}); 0 or off: none")
    fields = raw.split(":")
    if len(fields) not in (2, 3) or not fields[0].strip().isdigit() or not fields[1].strip().isdigit():
        raise ValueError(f"{SPLIT_K_ENV}={raw!r}: {allowed}")
    parts, rows = int(fields[0]), int(fields[1])
    if parts not in SPLIT_K_PARTS or not 33 <= rows <= _MAX_ROWS:
        raise ValueError(f"{SPLIT_K_ENV}={raw!r}: {allowed}")
    linears = SPLIT_K_LINEARS
    if len(fields) == 3:
        linears = tuple(name.strip() for name in fields[2].split(",") if name.strip())
        unknown = [name for name in linears if name not in _ALL_LINEARS]
        if unknown or not linears:
            raise ValueError(f"{SPLIT_K_ENV}={raw!r}: unknown linear(s) {unknown}; {allowed}")
    return SplitK(parts, rows, linears)


def splits(weight: torch.Tensor, parts: int) -> bool:
    """Whether the weights' K splits into `parts` slices of a multiple of 16 (the grouped GEMM's
    alignment)."""
    return weight.shape[1] % (16 * parts) == 0


def weight_slices(weight: torch.Tensor, scale: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 weights [N, K] as `parts` K slices [parts, K/parts, N] (a view: slice i is
    weight[:, i*K/parts:(i+1)*K/parts].t()), and their channel scales [1, N] as [parts, N]."""
    n, k = weight.shape
    if not splits(weight, parts):
        raise ValueError(f"split-K: K={k} does not split into {parts} slices of a multiple of 16")
    return (weight.view(n, parts, k // parts).permute(1, 2, 0),
            scale.reshape(1, n).expand(parts, n).contiguous())


def x_slices(x_q: torch.Tensor, parts: int) -> torch.Tensor:
    """The e4m3 activations [M, K] as `parts` K slices [parts, M, K/parts] (a view)."""
    m, k = x_q.shape
    return x_q.view(m, parts, k // parts).transpose(0, 1)


def split_k_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_slices: torch.Tensor, w_scales: torch.Tensor,
               flat_scales: bool = False) -> torch.Tensor:
    """x_q [M, K] e4m3 with scales [M, 1] times the weights' slices (weight_slices) -> [M, N]
    bf16: the slices' products with both scales applied, each rounded to bf16, summed. On the
    GPU one `torch._scaled_grouped_mm`; on the CPU (which has none) one `torch._scaled_mm` a slice,
    the same numbers."""
    parts, m = w_slices.shape[0], x_q.shape[0]
    xs = x_slices(x_q, parts)
    if x_q.is_cuda:
        x_scales = x_scale.reshape(1, m).expand(parts, m).contiguous()
        if flat_scales:
            out = torch._scaled_grouped_mm(xs, w_slices, x_scales.reshape(-1), w_scales.reshape(-1),
                                           out_dtype=torch.bfloat16)
        else:
            out = torch._scaled_grouped_mm(xs, w_slices, x_scales, w_scales, out_dtype=torch.bfloat16)
    else:
        out = torch.stack([
            torch._scaled_mm(xs[i].contiguous(), w_slices[i], scale_a=x_scale.reshape(m, 1).float(),
                             scale_b=w_scales[i:i + 1], out_dtype=torch.bfloat16)
            for i in range(parts)
        ])
    return out.sum(dim=0)  # bf16 in and out, accumulated in fp32: one rounding, one kernel


def unsupported(device: torch.device) -> str | None:
    """Why this GPU cannot take split-K, or None."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) not in ((9, 0), (10, 0)):
        return f"torch._scaled_grouped_mm runs on compute capability 9.0 and 10.0, this GPU is {major}.{minor}"
    return None


def check(weight: torch.Tensor, scale: torch.Tensor, split: SplitK) -> tuple[SplitK | None, str]:
    """Runs split-K on one layer's weights and random activations of `split.max_rows` rows
    against `torch._scaled_mm`: (the setting to use, with the scale form that computed the
    product) or (None, why not)."""
    from inflightllm.quantization.fp8 import FP8_DTYPE

    gen = torch.Generator(device=weight.device).manual_seed(0)
    rows = split.max_rows
    x = torch.randn(rows, weight.shape[1], device=weight.device, generator=gen)
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-6) / 448.0
    x_q = (x / x_scale).to(FP8_DTYPE)
    expected = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1),
                                out_dtype=torch.bfloat16).float()
    w_slices, w_scales = weight_slices(weight, scale, split.parts)
    tried = []
    for flat in (False, True):
        try:
            got = split_k_mm(x_q, x_scale, w_slices, w_scales, flat).float()
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:  # torch refuses the operands
            tried.append(f"{'flat' if flat else '[P, M]'} scales: {(str(error).splitlines() or [type(error).__name__])[0][:200]}")
            continue
        error = float((got - expected).norm() / expected.norm())
        if error <= 1e-2:
            return SplitK(split.parts, split.max_rows, split.linears, flat), f"relative error {error:.2e}"
        tried.append(f"{'flat' if flat else '[P, M]'} scales: relative error {error:.3g} from torch._scaled_mm")
    return None, "; ".join(tried)
