"""FP8 (e4m3) quantization: per-output-channel weight scales, dynamic per-token activation
scales, per-tensor KV-cache scales, and the emulated linear that defines the numbers.

The reference semantics (what every FP8 path must compute, within the tolerance the
tests state):

    x_q, s_x = quantize_per_token(x)          # s_x [M, 1] = amax(|x[m]|) / 448
    y = (x_q.float() @ w_q.float().T) * s_x * s_w.T  (+ bias), cast to x's dtype

On the CPU this runs as written (dequantize, then compute in float32): the emulation.
On a Hopper GPU `torch._scaled_mm` computes the same products of the same e4m3 values,
accumulated in float32, with the same scales (only the summation order differs). The
small-batch GPU kernels dequantize the weights in registers and keep the activations in
the model's dtype (weight-only at 1-8 rows, where the weight bytes are the cost):
`linear_weight_only` is their reference.

With `model.fp8_lm_head` the LM head is held in e4m3 too (per-row scales) and steps of at
most `FP8_LM_HEAD_MAX_ROWS` rows (one-token decode steps: the batch-1 step, where its 1.05 GB
of bf16 weights are an eighth of the bytes read) compute their logits weight-only from it;
larger steps keep the bf16 head (W8A8 logits cost 0.7-1.0 % of perplexity, weight-only 0.3-0.4 %).
`model.int8_lm_head` does the same with the head in int8 (`quantize_rows_int8`: amax / 127 a
row; the same bytes at the 16-bit head's perplexity: docs/QUANTIZATION.md), with any weights, for
steps of up to `INT8_LM_HEAD_MAX_ROWS` (4) rows.

Device-agnostic torch: the same functions run on CPU and CUDA tensors.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
# Steps of at most this many rows read the e4m3 LM head (model.fp8_lm_head): one-token steps
# (its perplexity cost was measured at one row a step).
FP8_LM_HEAD_MAX_ROWS = 1
# Steps of at most this many rows read the int8 LM head (model.int8_lm_head): it costs no
# perplexity, so steps of a few rows read it too, where cuBLAS reads the whole bf16 head for a
# few rows of logits. Not 8: there small_gemv's FMAs bind and the bf16 head is as fast (one
# H100, FP8 Llama-3-8B decode step at batch 2 / 4 / 8: -0.17 / -0.14..-0.37 / +0.16..+0.24 ms).
INT8_LM_HEAD_MAX_ROWS = 4
FP8_MAX = 448.0  # largest finite e4m3fn value
# Floor of a scale: an all-zero row or channel gets this instead of 0 (no division by zero;
# its values quantize to 0 either way).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def lm_head_q_max_rows(weight_q: torch.Tensor) -> int:
    """The most rows a step may have to read the LM head's 8-bit copy `weight_q`."""
    return INT8_LM_HEAD_MAX_ROWS if weight_q.dtype == torch.int8 else FP8_LM_HEAD_MAX_ROWS


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 scales [N]) with weight ~= q * scale[:, None]."""
    amax = weight.detach().abs().amax(dim=1).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    quantized = (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


INT8_MAX = 127.0


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scales [N]) with weight ~= q * scale[:, None]:
    symmetric, one scale a row (amax / 127; model.int8_lm_head). `linear_weight_only` reads it
    as it reads e4m3 rows (the GPU's small_gemv converts the bytes exactly: gpu/layers.cu)."""
    scale = (weight.detach().abs().amax(dim=1).float() / INT8_MAX).clamp(min=1e-12)
    quantized = (weight.float() / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantized, scale


def quantize_lm_head(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head's 8-bit copy of `kind` ("e4m3": model.fp8_lm_head, "int8": model.int8_lm_head)."""
    if kind == "e4m3":
        return quantize_per_channel(weight)
    if kind == "int8":
        return quantize_rows_int8(weight)
    raise ValueError(f"LM head quantization {kind!r}: e4m3 or int8")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): dynamic per-token quantization."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    quantized = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x -> e4m3 with a given (per-tensor or broadcastable) scale, saturating at +-448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(quantized: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 values times their (broadcastable) scale, in `dtype`."""
    return (quantized.float() * scale).to(dtype)


def linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 reference: x [M, K] (quantized per token here) times e4m3 weight [N, K] with
    per-channel scales [N] -> [M, N] in x's dtype."""
    x_q, x_scale = quantize_per_token(x)
    out = (x_q.float() @ weight_q.float().t()) * x_scale * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def linear_weight_only(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A16 reference (the small-batch GPU kernels): x stays in its dtype, the e4m3
    (or int8) weight is dequantized, the dot products are float32, the channel scale applies last."""
    out = (x.float() @ weight_q.float().t()) * weight_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight is e4m3 with per-output-channel scales; forward is the W8A8
    reference (`linear`). Used by the CPU model (emulation)."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight_q.dtype != FP8_DTYPE:
            raise TypeError(f"Fp8Linear: weight must be {FP8_DTYPE}, got {weight_q.dtype}")
        self.register_buffer("weight", weight_q)
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.in_features = weight_q.shape[1]
        self.out_features = weight_q.shape[0]

    @classmethod
    def from_linear(cls, module: torch.nn.Linear) -> Fp8Linear:
        weight_q, scale = quantize_per_channel(module.weight.data)
        bias = None if module.bias is None else module.bias.data
        return cls(weight_q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per-channel"
