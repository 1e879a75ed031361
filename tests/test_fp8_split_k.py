"""Split-K FP8 GEMMs (inflightllm.gpu.fp8_split_k) on the CPU: the setting, the slice layouts,
and the product of the slices against the whole e4m3 product (the GPU's grouped GEMM is tested
against torch._scaled_mm in tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from inflightllm.gpu import fp8_split_k
from inflightllm.gpu.fp8_split_k import SplitK, setting, split_k_mm, weight_slices, x_slices
from inflightllm.quantization.fp8 import linear, quantize_per_channel, quantize_per_token


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("0", None), ("off", None),
    ("4:512", SplitK(4, 512)),
    (" 2:256 ", SplitK(2, 256)),
    ("8:1024:o,qkv", SplitK(8, 1024, ("o", "qkv"))),
])
def test_setting_reads_slices_rows_and_linears(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv(fp8_split_k.SPLIT_K_ENV, raising=False)
    else:
        monkeypatch.setenv(fp8_split_k.SPLIT_K_ENV, value)
    assert setting() == expected


@pytest.mark.parametrize("value", ["4", "3:512", "4:32", "4:20000", "4:x", "4:512:attn", "4:512:", "on"])
def test_a_malformed_setting_is_refused_naming_it(value, monkeypatch):
    monkeypatch.setenv(fp8_split_k.SPLIT_K_ENV, value)
    with pytest.raises(ValueError) as info:
        setting()
    message = str(info.value)
    assert f"INFLIGHTLLM_FP8_SPLIT_K={value!r}" in message
    assert "P:R" in message and "2, 4, 8" in message


def test_slices_are_views_of_the_operands():
    weight = torch.arange(6 * 64, dtype=torch.float32).reshape(6, 64)
    slices, scales = weight_slices(weight, torch.arange(6, dtype=torch.float32).view(1, 6), 4)
    assert slices.shape == (4, 16, 6) and slices.data_ptr() == weight.data_ptr()
    assert slices.stride(1) == 1  # each slice column-major
    for i in range(4):
        assert torch.equal(slices[i], weight[:, 16 * i:16 * (i + 1)].t())
        assert torch.equal(scales[i], torch.arange(6, dtype=torch.float32))
    x = torch.arange(3 * 64, dtype=torch.float32).reshape(3, 64)
    xs = x_slices(x, 4)
    assert xs.shape == (4, 3, 16) and xs.data_ptr() == x.data_ptr()
    assert torch.equal(xs[1], x[:, 16:32])
    with pytest.raises(ValueError, match="K=64 does not split into 8 slices of a multiple of 16"):
        weight_slices(weight, torch.ones(1, 6), 8)


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_the_slices_products_sum_to_the_whole_product(parts):
    torch.manual_seed(parts)
    x = torch.randn(40, 256)
    weight = torch.randn(96, 256) * 0.05
    weight_q, weight_scale = quantize_per_channel(weight)
    x_q, x_scale = quantize_per_token(x)
    slices, scales = weight_slices(weight_q, weight_scale.view(1, -1), parts)
    got = split_k_mm(x_q, x_scale, slices, scales).float()
    assert got.shape == (40, 96) and got.dtype == torch.float32
    whole = torch._scaled_mm(x_q, weight_q.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                             out_dtype=torch.bfloat16).float()
    # the partials are rounded to bf16 before the sum: within a few bf16 steps of the whole product
    assert float((got - whole).abs().max()) <= float(whole.abs().max()) * 2 ** -6
    # and the emulation (dequantize, then compute) agrees with both
    emulated = linear(x, weight_q, weight_scale)
    assert float((got - emulated).norm() / emulated.norm()) < 1e-2


def test_the_load_check_takes_a_product_that_agrees_and_refuses_one_that_does_not(monkeypatch):
    # fp8_split_k.check (GpuLlama._prepare_split_k runs it on layer 0) against torch._scaled_mm:
    # here on the CPU's per-slice products, then on a grouped GEMM that fails or computes garbage.
    torch.manual_seed(0)
    weight_q, weight_scale = quantize_per_channel(torch.randn(64, 128) * 0.05)
    split, why = fp8_split_k.check(weight_q, weight_scale.view(1, -1), SplitK(4, 48))
    assert split == SplitK(4, 48) and "relative error" in why

    def refused(*args):
        raise ValueError("scale_a must be 2D")

    monkeypatch.setattr(fp8_split_k, "split_k_mm", refused)
    split, why = fp8_split_k.check(weight_q, weight_scale.view(1, -1), SplitK(2, 40))
    assert split is None
    assert why == "[P, M] scales: scale_a must be 2D; flat scales: scale_a must be 2D"

    monkeypatch.setattr(fp8_split_k, "split_k_mm", lambda x_q, *args: torch.zeros(x_q.shape[0], 64))
    split, why = fp8_split_k.check(weight_q, weight_scale.view(1, -1), SplitK(2, 40))
    assert split is None and "relative error 1 from torch._scaled_mm" in why
