"""The CUDA backend's FP8 KV cache choices that need no GPU: which kernels read it (their
names and shared memory), what the constructor refuses (the cache dtype, a decode kernel
that cannot read FP8, bad scales) and the GPU runner's block size in bytes. The kernels
themselves: tests/gpu/test_fp8_kv_cache.py."""

from __future__ import annotations

import types

import pytest
import torch

from inflightllm.attention.cuda import ops
from inflightllm.attention.cuda.backend import CudaPagedAttention


@pytest.fixture(autouse=True)
def _fresh_knobs(monkeypatch):
    for name in ("INFLIGHTLLM_DECODE_IMPL", "INFLIGHTLLM_DECODE_STAGES", "INFLIGHTLLM_DECODE_MIN_SPLIT",
                 "INFLIGHTLLM_DECODE_V5_KV_HEADS"):
        monkeypatch.delenv(name, raising=False)
    ops.decode_stages.cache_clear()
    yield
    ops.decode_stages.cache_clear()


def test_fp8_kernel_names_take_the_cache_type_last():
    assert ops.decode_kernel_name("v2", "__nv_bfloat16", 128, 4, ops.FP8_CTYPE) == (
        "paged_decode_v2<__nv_bfloat16,128,4,fp8e4m3>"
    )
    assert ops.decode_kernel_name("v4", "float", 64, 8, ops.FP8_CTYPE) == "paged_decode_v4<float,64,8,3,fp8e4m3>"
    # an unquantized cache keeps the names it had (the template argument defaults to T)
    assert ops.decode_kernel_name("v4", "__half", 64, 2) == "paged_decode_v4<__half,64,2,3>"
    assert ops.decode_kernel_name("v2", "__half", 64, 2, "__half") == "paged_decode_v2<__half,64,2>"
    with pytest.raises(ValueError, match=r"decode kernel 'v1' does not read an FP8 cache"):
        ops.decode_kernel_name("v1", "__nv_bfloat16", 128, 4, ops.FP8_CTYPE)
    assert ops.decode_kernel_name("v5", "__half", 64, 8, ops.FP8_CTYPE) == "paged_decode_v5<__half,64,1,fp8e4m3>"
    assert ops.decode_kernel_name("v5", "__nv_bfloat16", 128, 4, ops.FP8_CTYPE, 4) == (
        "paged_decode_v5<__nv_bfloat16,128,4,fp8e4m3>"
    )
    with pytest.raises(ValueError, match=r"decode kernel 'v5': 3 kv heads a block \(allowed: \(1, 2, 4\)\)"):
        ops.decode_kernel_name("v5", "__half", 64, 8, ops.FP8_CTYPE, 3)
    for ctype, cache in (("float", ops.FP8_CTYPE), ("__half", None)):
        with pytest.raises(ValueError, match=r"decode kernel 'v5' reads only an FP8 cache, with fp16 / bf16 queries"):
            ops.decode_kernel_name("v5", ctype, 64, 8, cache)
    assert ops.decode_group_split(4, "v5") == (8, 1) and ops.decode_group_split(16, "v5") == (8, 2)
    assert ops.decode_group_split(12, "v5") == (8, 2) and ops.decode_group_split(3) == (4, 1)


def test_fp8_v4_ring_is_half_of_bf16s():
    assert ops.fp8_slice_bytes(torch.bfloat16) == ops.fp8_slice_bytes(torch.float16) == 8
    assert ops.fp8_slice_bytes(torch.float32) == 4
    # 3 tiles x 128 threads x 2U slices of 8 bytes (U = 4), against 48 KiB for bf16
    assert ops.decode_dynamic_smem("v4", 4, 8) == 3 * 128 * 8 * 8 == 24 * 1024
    assert ops.decode_dynamic_smem("v4", 4) == 48 * 1024
    # 8 query heads a block: the warps' merge buffers (4 warps x 8 heads x (128 + 2) floats) are larger
    assert ops.decode_dynamic_smem("v4", 8, 8) == 4 * 8 * 130 * 4
    assert ops.decode_dynamic_smem("v2", 4, 8) == 0


def test_constructor_refusals(monkeypatch):
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp16': allowed auto, fp8"):
        CudaPagedAttention(8, 2, 64, kv_cache_dtype="fp16")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"kv_scales: layer 1 v_scale .* \(a finite positive number is allowed\)"):
            CudaPagedAttention(8, 2, 64, kv_cache_dtype="fp8", kv_scales=[(1.0, 1.0), (0.5, bad)])
    monkeypatch.setenv("INFLIGHTLLM_DECODE_IMPL", "v1")
    assert CudaPagedAttention(8, 2, 64).decode_impl == "v1"  # an unquantized cache still may
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_IMPL='v1' does not read an FP8 KV cache "
                                         r"\(engine.kv_cache_dtype fp8\); allowed: v2, v4, v5, v6, auto"):
        CudaPagedAttention(8, 2, 64, kv_cache_dtype="fp8")
    monkeypatch.setenv("INFLIGHTLLM_DECODE_IMPL", "v5")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_IMPL='v5' reads only an FP8 KV cache "
                                         r"\(engine.kv_cache_dtype fp8\); allowed here: v1, v2, v4, auto"):
        CudaPagedAttention(8, 2, 64)
    assert CudaPagedAttention(8, 2, 64, kv_cache_dtype="fp8").decode_impl == "v5"
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_IMPL='v5' needs fp16 or bf16 queries \(the model's "
                                         r"dtype is float32\); allowed for float32: v2, v4, auto"):
        CudaPagedAttention(8, 2, 64, kv_cache_dtype="fp8").allocate_kv_cache(4, 16, 1, 2, 64, torch.float32, "cpu")
    # v6: every kv head of a sequence in one block, its ring of 3 x 2 pages in shared memory
    monkeypatch.setenv("INFLIGHTLLM_DECODE_IMPL", "v6")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_IMPL='v6' reads only an FP8 KV cache"):
        CudaPagedAttention(8, 2, 64)
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_IMPL='v6' needs fp16 or bf16 queries"):
        CudaPagedAttention(8, 2, 64, kv_cache_dtype="fp8").allocate_kv_cache(4, 16, 1, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_IMPL='v6' takes every kv head of a sequence in one "
                                         r"block: at most 8 kv heads .* this cache: 16 kv heads, head_dim 128, "
                                         r"block_size 16; allowed: v5, auto"):
        CudaPagedAttention(32, 16, 128, kv_cache_dtype="fp8").allocate_kv_cache(4, 16, 1, 16, 128, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"this cache: 8 kv heads, head_dim 128, block_size 64"):  # a 384 KiB ring
        CudaPagedAttention(32, 8, 128, kv_cache_dtype="fp8").allocate_kv_cache(4, 64, 1, 8, 128, torch.bfloat16, "cpu")
    assert ops.decode_v6_smem(16, 8, 128) == 96 * 1024 and ops.decode_v6_blocks_per_sm(96 * 1024) == 2
    assert ops.decode_v6_blocks_per_sm(ops.decode_v6_smem(32, 8, 128)) == 1
    assert ops.decode_kernel_name("v6", "__nv_bfloat16", 128, 8, ops.FP8_CTYPE) == "paged_decode_v6<__nv_bfloat16,128,fp8e4m3>"


def test_v5_kv_heads_and_splits():
    """paged_decode_v5's kv heads a block (at most the model's, a power of two) and its split
    count (ops.wave_splits: waves of blocks as full as can be, each split costing a little),
    with 3 blocks a SM on 132 SMs."""
    assert [ops.v5_kv_heads(k) for k in (1, 2, 3, 4, 8)] == [1, 2, 2, 4, 4]
    assert ops.v5_kv_heads(8, 1) == 1 and ops.v5_kv_heads(3, 4) == 2
    slots = ops.DECODE_V5_BLOCKS_PER_SM * 132
    # 8 kv heads in blocks of 4: 2 blocks a decode
    assert [ops.wave_splits(2 * nd, slots, 64) for nd in (1, 32, 256, 512, 1024)] == [64, 6, 3, 3, 2]
    assert ops.wave_splits(8, slots, 4) == 4  # capped (max_model_len / 128)
    assert ops.wave_splits(10**6, slots, 0) == 1
    # v5's split cost (0.10): 512 and more decodes unsplit (2.6 and more waves of blocks)
    cost = ops.DECODE_V5_SPLIT_COST
    assert [ops.wave_splits(2 * nd, slots, 64, cost) for nd in (1, 32, 128, 256, 512, 1024)] == [64, 6, 3, 3, 1, 1]


def test_v5_splits_from_the_backend_and_the_environment(monkeypatch):
    attention = CudaPagedAttention(32, 8, 128, max_model_len=8192, kv_cache_dtype="fp8")
    attention._num_sms, attention.query_dtype = 132, torch.bfloat16
    assert (attention.v5_min_split, attention.decode_min_split) == (ops.DECODE_V5_MIN_SPLIT_TOKENS, 32)
    assert [attention.decode_kernel(nd) for nd in (1, 256, 512, 1024)] == [("v5", 49), ("v5", 3), ("v5", 1), ("v5", 1)]
    monkeypatch.setenv("INFLIGHTLLM_DECODE_V5_SPLIT_COST", "0.05")
    monkeypatch.setenv("INFLIGHTLLM_DECODE_MIN_SPLIT", "64")
    attention = CudaPagedAttention(32, 8, 128, max_model_len=8192, kv_cache_dtype="fp8")
    attention._num_sms, attention.query_dtype = 132, torch.bfloat16
    assert (attention.v5_min_split, attention.decode_min_split) == (64, 64)
    assert [attention.decode_kernel(nd)[1] for nd in (512, 1024)] == [3, 2]
    monkeypatch.setenv("INFLIGHTLLM_DECODE_V5_SPLITS", "100")
    attention = CudaPagedAttention(32, 8, 128, max_model_len=8192, kv_cache_dtype="fp8")
    attention.query_dtype = torch.bfloat16
    assert attention.decode_kernel(1024) == ("v5", 64)  # capped: one split a 128 tokens of max_model_len
    for name, text, allowed in (("INFLIGHTLLM_DECODE_V5_SPLITS", "0", "a positive count"),
                                ("INFLIGHTLLM_DECODE_V5_SPLIT_COST", "two", "a number from 0 to 1")):
        monkeypatch.setenv(name, text)
        with pytest.raises(ValueError, match=f"{name}='{text}': {allowed}"):
            CudaPagedAttention(32, 8, 128, kv_cache_dtype="fp8")
        monkeypatch.delenv(name)


def test_v5_kv_heads_by_batch_and_from_the_environment(monkeypatch):
    attention = CudaPagedAttention(32, 8, 128, kv_cache_dtype="fp8")
    assert attention.v5_kv_heads is None
    # a block a kv head until 8 kv heads x decodes fill the 396 resident blocks once, then 4
    assert [attention.v5_blocking(nd) for nd in (1, 49, 50, 1024)] == [1, 1, 4, 4]
    assert CudaPagedAttention(9, 3, 64, kv_cache_dtype="fp8").v5_blocking(1024) == 2  # SmolLM2: 3 kv heads
    monkeypatch.setenv("INFLIGHTLLM_DECODE_V5_KV_HEADS", "1")
    attention = CudaPagedAttention(32, 8, 128, kv_cache_dtype="fp8")
    assert attention.v5_kv_heads == 1 and attention.v5_blocking(1024) == 1
    monkeypatch.setenv("INFLIGHTLLM_DECODE_V5_KV_HEADS", "3")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_V5_KV_HEADS='3': 1, 2 or 4"):
        CudaPagedAttention(32, 8, 128, kv_cache_dtype="fp8")


def test_fp8_scales_and_kernel_choice():
    attention = CudaPagedAttention(32, 8, 128, max_model_len=8192, kv_cache_dtype="fp8",
                                   kv_scales=[(0.5, 2), (1, 1)])
    assert attention.fp8 and attention.kv_scales == [(0.5, 2.0), (1.0, 1.0)]
    assert all(isinstance(x, float) for pair in attention.kv_scales for x in pair)
    # fp16 / bf16 queries: v5 (tensor cores, 3 blocks a SM), split so that its waves of blocks come
    # close to full, each split costing a tenth of a block: one decode, a block a kv head, 49
    # splits; 1,024, blocks of 4 kv heads, unsplit
    attention.query_dtype = torch.bfloat16
    assert attention.decode_kernel(1) == ("v5", 49)
    assert attention.decode_kernel(1024) == ("v5", 1)
    # float32 queries: the kernels of an unquantized cache, v4 where unsplit, else v2
    attention.query_dtype = torch.float32
    assert attention.decode_kernel(1) == ("v2", 64)
    assert attention.decode_kernel(1024) == ("v4", 1)
    assert CudaPagedAttention(8, 2, 64, kv_cache_dtype="fp8").kv_scales is None  # 1.0 a layer at allocation


def test_gpu_runner_block_bytes_halve_with_fp8():
    """The GPU runner sizes its cache from gpu_memory_utilization in bytes a block: one byte an
    element with fp8, so twice the blocks of a bf16 cache in the same memory."""
    from inflightllm.gpu.runner import GpuModelRunner

    arch = types.SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    loaded = types.SimpleNamespace(dtype=torch.bfloat16)
    sizes = {
        kv: GpuModelRunner._bytes_per_block(types.SimpleNamespace(arch=arch, block_size=16, loaded=loaded,
                                                                  kv_cache_dtype=kv))
        for kv in ("auto", "fp8")
    }
    assert sizes == {"auto": 2 * 30 * 16 * 3 * 64 * 2, "fp8": 2 * 30 * 16 * 3 * 64}


def test_v6_ring_pages_from_the_environment(monkeypatch):
    """INFLIGHTLLM_DECODE_V6_STAGES sizes paged_decode_v6's ring (and so its resident blocks)."""
    try:
        for text, pages, blocks in (("2", 2, 2), ("4", 4, 1)):
            monkeypatch.setenv("INFLIGHTLLM_DECODE_V6_STAGES", text)
            ops.decode_v6_stages.cache_clear()
            assert ops.decode_v6_stages() == pages
            assert ops.decode_v6_smem(16, 8, 128) == pages * 2 * 16 * 8 * 128
            assert ops.decode_v6_blocks_per_sm(ops.decode_v6_smem(16, 8, 128)) == blocks
        monkeypatch.setenv("INFLIGHTLLM_DECODE_V6_STAGES", "5")
        ops.decode_v6_stages.cache_clear()
        with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_V6_STAGES='5': 2, 3 or 4"):
            ops.decode_v6_stages()
    finally:
        monkeypatch.delenv("INFLIGHTLLM_DECODE_V6_STAGES", raising=False)
        ops.decode_v6_stages.cache_clear()
    assert ops.decode_v6_stages() == ops.DECODE_V6_STAGES == 3


def test_v6_splits():
    """paged_decode_v6's splits: one block a sequence (and head group of 8), 2 resident a SM at
    block 16 (its 96 KiB ring), waves as full as can be (ops.wave_splits, 10 % a split), at most
    one split a 128 tokens of max_model_len (the H100 measurement's choices: 1,024, 512 and 256
    decodes unsplit, 32 in 8 splits, 1 in 64)."""
    attention = CudaPagedAttention(32, 8, 128, max_model_len=8192, kv_cache_dtype="fp8")
    attention._num_sms = 132
    assert [attention.decode_splits(nd, variant="v6") for nd in (1, 8, 32, 256, 512, 1024)] == [64, 33, 8, 1, 1, 1]
    attention.decode_impl = "v6"
    attention.query_dtype = torch.bfloat16
    assert attention.decode_kernel(32) == ("v6", 8)
