"""Which rows the 16-byte add+RMSNorm and RoPE kernels take (gpu/ops.py): a 16-byte load of a
misaligned row would fault on the GPU, so anything not aligned or not whole chunks must go
to the scalar kernels. Checked on CPU tensors: only strides and addresses matter."""

from __future__ import annotations

import pytest
import torch

from inflightllm.gpu import ops


def test_add_norm_takes_aligned_whole_chunk_rows_only():
    hidden = torch.zeros(4, 4096, dtype=torch.bfloat16)
    residual, weight = torch.zeros_like(hidden), torch.ones(4096, dtype=torch.bfloat16)
    assert ops.add_norm_vector_ok(hidden, residual, weight)
    assert ops.add_norm_vector_ok(hidden.float(), residual.float(), weight.float())
    # SmolLM2's 576: 72 chunks of 8 bf16
    assert ops.add_norm_vector_ok(hidden[:, :576].contiguous(), residual[:, :576].contiguous(), weight[:576])
    odd = torch.zeros(4, 4100, dtype=torch.bfloat16)  # 4,100 is not whole 8-element chunks
    assert not ops.add_norm_vector_ok(odd, torch.zeros_like(odd), torch.ones(4100, dtype=torch.bfloat16))
    shifted = torch.zeros(4 * 4096 + 1, dtype=torch.bfloat16)[1:].view(4, 4096)  # 2 bytes off
    assert not ops.add_norm_vector_ok(shifted, residual, weight)
    assert not ops.add_norm_vector_ok(hidden, residual, torch.ones(4097, dtype=torch.bfloat16)[1:])
    strided = torch.zeros(4, 8192, dtype=torch.bfloat16)[:, :4096]  # not contiguous
    assert not ops.add_norm_vector_ok(strided, residual, weight)
    too_wide = torch.zeros(1, 1024 * 4 * 8 + 8, dtype=torch.bfloat16)  # more than 4 chunks a thread
    assert not ops.add_norm_vector_ok(too_wide, torch.zeros_like(too_wide), torch.ones(too_wide.shape[1], dtype=torch.bfloat16))


def test_rotary_takes_aligned_views_of_the_fused_qkv_rows():
    heads, kv_heads, head_dim = 32, 8, 128
    qkv = torch.zeros(5, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim :]
    cos_sin = torch.zeros(4096, head_dim, dtype=torch.bfloat16)
    assert ops.rotary_vector_ok(q, k, cos_sin, head_dim)
    # SmolLM2: 9 heads, 3 kv heads, head_dim 64 (rows of 960 bf16: 1,920 bytes)
    small = torch.zeros(5, (9 + 6) * 64, dtype=torch.bfloat16)
    assert ops.rotary_vector_ok(small[:, : 9 * 64], small[:, 9 * 64 :], cos_sin[:, :64].contiguous(), 64)
    # a row stride that is not 16-byte aligned (1 extra element), a shifted base, a strided table
    ragged = torch.zeros(5, (heads + 2 * kv_heads) * head_dim + 1, dtype=torch.bfloat16)
    assert not ops.rotary_vector_ok(ragged[:, : heads * head_dim], ragged[:, heads * head_dim :], cos_sin, head_dim)
    shifted = torch.zeros(5 * qkv.shape[1] + 1, dtype=torch.bfloat16)[1:].view(5, -1)
    assert not ops.rotary_vector_ok(shifted[:, : heads * head_dim], shifted[:, heads * head_dim :], cos_sin, head_dim)
    assert not ops.rotary_vector_ok(q, k, torch.zeros(4096, 2 * head_dim, dtype=torch.bfloat16)[:, :head_dim], head_dim)
    # half a head that is not whole 16-byte chunks: head_dim 24 in bf16 (12 elements)
    assert not ops.rotary_vector_ok(q, k, cos_sin, 24)


def test_small_gemv_compile_settings_and_their_refusals(monkeypatch):
    """The small-batch kernels' compile-time settings (perf/bench_small_gemv.py's variants):
    the defaults, an override from the environment, and a value out of range refused by name."""
    import pytest

    monkeypatch.delenv("INFLIGHTLLM_FP8_GEMV_U", raising=False)
    monkeypatch.delenv("INFLIGHTLLM_SMALL_BLOCKS", raising=False)
    assert ops.small_gemv_defines() == (f"-DFP8_GEMV_U={ops.FP8_GEMV_U}", f"-DSMALL_BLOCKS_M1={ops.SMALL_BLOCKS_M1}")
    monkeypatch.setenv("INFLIGHTLLM_FP8_GEMV_U", "16")
    monkeypatch.setenv("INFLIGHTLLM_SMALL_BLOCKS", "2")
    assert ops.small_gemv_defines() == ("-DFP8_GEMV_U=16", "-DSMALL_BLOCKS_M1=2")
    monkeypatch.setenv("INFLIGHTLLM_FP8_GEMV_U", "0")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_FP8_GEMV_U='0': an integer in 1\.\.32"):
        ops.small_gemv_defines()
    monkeypatch.setenv("INFLIGHTLLM_FP8_GEMV_U", "8")
    monkeypatch.setenv("INFLIGHTLLM_SMALL_BLOCKS", "two")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_SMALL_BLOCKS='two': an integer in 1\.\.8"):
        ops.small_gemv_defines()


def test_silu_tma_setting_and_the_rows_it_takes(monkeypatch):
    """silu_and_mul_fp8_tma (Hopper): INFLIGHTLLM_FP8_SILU_TMA (default on, a bad value refused
    by name) and the rows whose gate and up halves fit a block's shared memory."""
    import pytest

    ops.fp8_silu_tma.cache_clear()
    monkeypatch.delenv("INFLIGHTLLM_FP8_SILU_TMA", raising=False)
    assert ops.fp8_silu_tma()
    ops.fp8_silu_tma.cache_clear()
    monkeypatch.setenv("INFLIGHTLLM_FP8_SILU_TMA", "0")
    assert not ops.fp8_silu_tma()
    ops.fp8_silu_tma.cache_clear()
    monkeypatch.setenv("INFLIGHTLLM_FP8_SILU_TMA", "yes")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_FP8_SILU_TMA='yes': 0 or 1"):
        ops.fp8_silu_tma()
    ops.fp8_silu_tma.cache_clear()
    # Llama-3-8B's 14,336 (56 KiB of gate and up in bf16), SmolLM2's 1,536, TP=2's 7,168
    assert ops.silu_tma_shared(14336, torch.bfloat16) == 57344
    assert all(ops.silu_tma_fits(width, torch.bfloat16) for width in (14336, 1536, 7168))
    assert not ops.silu_tma_fits(14336, torch.float32)  # 16-bit rows only
    assert not ops.silu_tma_fits(1540, torch.float16)  # not whole 16-byte chunks
    assert not ops.silu_tma_fits(60000, torch.bfloat16)  # 240,000 bytes: more than a block's shared memory


def test_fp8_small_m_default_layouts_are_built_and_hold_their_rows():
    """Each count of 8-row token tiles up to the kernel's 32 rows runs one of the instantiated
    layouts (ops.FP8_SMALL_M_LAYOUTS: the module compiles exactly those), with room for its rows;
    every layout names token tiles (1-4), channel tiles, blocks an SM (0-4) and chunks in flight."""
    assert sorted(ops.FP8_SMALL_M_DEFAULT_LAYOUT) == [1, 2, 3, 4] == list(range(1, ops.FP8_SMALL_M_MAX // 8 + 1))
    for tiles, layout in ops.FP8_SMALL_M_DEFAULT_LAYOUT.items():
        assert layout in ops.FP8_SMALL_M_LAYOUTS and layout[0] >= tiles, (tiles, layout)
    assert len(set(ops.FP8_SMALL_M_LAYOUTS)) == len(ops.FP8_SMALL_M_LAYOUTS)
    for token_tiles, channel_tiles, min_blocks, chunks in ops.FP8_SMALL_M_LAYOUTS:
        assert 1 <= token_tiles <= 4 and channel_tiles >= 1 and 0 <= min_blocks <= 4 and chunks >= 1


def test_fp8_small_m_rows_default_range_and_refusals(monkeypatch):
    """GpuLlama's FP8 GEMMs of up to ops.fp8_small_m_rows() rows take fp8_small_m_gemm:
    FP8_SMALL_M_ROWS unless INFLIGHTLLM_FP8_SMALL_M_ROWS gives a whole number from 0 to the
    kernel's 32; anything else is refused by name."""
    monkeypatch.delenv(ops.FP8_SMALL_M_ENV, raising=False)
    assert ops.fp8_small_m_rows() == ops.FP8_SMALL_M_ROWS == 32
    for text, rows in (("0", 0), ("8", 8), ("32", 32)):
        monkeypatch.setenv(ops.FP8_SMALL_M_ENV, text)
        assert ops.fp8_small_m_rows() == rows
    for text in ("33", "-1", "8.5", "on", ""):
        monkeypatch.setenv(ops.FP8_SMALL_M_ENV, text)
        with pytest.raises(ValueError, match=f"{ops.FP8_SMALL_M_ENV}=.*from 0 to 32"):
            ops.fp8_small_m_rows()
    # a GEMM past the kernel's rows or of a width not in steps of 64 is never given to it
    assert not ops.fp8_small_m_ok(33, 4096, 0)
    assert not ops.fp8_small_m_ok(8, 4100, 0)
    assert not ops.fp8_small_m_ok(0, 4096, 0)
