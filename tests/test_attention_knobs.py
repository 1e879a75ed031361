"""The CUDA attention backend's choices that need no GPU: which decode kernel and split count
a decode batch gets, the v4 kernel's shared memory and name, and the environment knobs'
checks (a bad value names the variable and what is allowed)."""

from __future__ import annotations

import pytest

from inflightllm.attention.cuda import backend, ops
from inflightllm.attention.cuda.backend import CudaPagedAttention


@pytest.fixture(autouse=True)
def _fresh_knobs(monkeypatch):
    for name in ("INFLIGHTLLM_DECODE_IMPL", "INFLIGHTLLM_DECODE_STAGES", "INFLIGHTLLM_DECODE_MIN_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    ops.decode_stages.cache_clear()
    yield
    ops.decode_stages.cache_clear()


def test_auto_takes_v4_only_where_contexts_are_not_split():
    attention = CudaPagedAttention(32, 8, 128, max_model_len=8192)  # Llama-3-8B, 132 SMs assumed
    assert attention.decode_impl == "auto"
    assert attention.decode_kernel(1) == ("v2", 64)  # 4 blocks x 132 SMs / 8 kv heads, capped at 8192/128
    assert attention.decode_kernel(32) == ("v2", 2)
    assert attention.decode_kernel(66) == ("v4", 1)
    assert attention.decode_kernel(1024) == ("v4", 1)
    attention.decode_impl = "v2"
    assert attention.decode_kernel(1024) == ("v2", 1)


def test_decode_impl_from_the_environment(monkeypatch):
    monkeypatch.setenv("INFLIGHTLLM_DECODE_IMPL", "v4")
    assert CudaPagedAttention(8, 2, 64).decode_impl == "v4"
    monkeypatch.setenv("INFLIGHTLLM_DECODE_IMPL", "v3")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_DECODE_IMPL='v3' is not a decode kernel; allowed: v1, v2, v4, v5, v6, auto"):
        CudaPagedAttention(8, 2, 64)
    assert backend.DECODE_IMPLS == ("v1", "v2", "v4", "v5", "v6", "auto")


def test_v4_ring_and_name(monkeypatch):
    assert ops.decode_stages() == ops.DECODE_STAGES == 3
    # 3 tiles x 128 threads x 2U 16-byte slices (U = 4, or 2 for 8 query heads a block)
    assert ops.decode_dynamic_smem("v4", 4) == 3 * 128 * 8 * 16 == 48 * 1024
    assert ops.decode_dynamic_smem("v4", 8) == 3 * 128 * 4 * 16  # the ring still holds the merge buffers
    assert ops.decode_dynamic_smem("v2", 4) == 0
    assert ops.decode_kernel_name("v4", "__nv_bfloat16", 128, 4) == "paged_decode_v4<__nv_bfloat16,128,4,3>"
    assert ops.decode_kernel_name("v2", "float", 64, 8) == "paged_decode_v2<float,64,8>"
    monkeypatch.setenv("INFLIGHTLLM_DECODE_STAGES", "2")
    ops.decode_stages.cache_clear()
    assert ops.decode_kernel_name("v4", "float", 64, 1) == "paged_decode_v4<float,64,1,2>"
    assert ops.decode_dynamic_smem("v4", 2) == 32 * 1024


@pytest.mark.parametrize("value", ["1", "5", "three"])
def test_bad_decode_stages_are_refused(monkeypatch, value):
    monkeypatch.setenv("INFLIGHTLLM_DECODE_STAGES", value)
    with pytest.raises(ValueError, match=rf"INFLIGHTLLM_DECODE_STAGES='{value}': 2, 3 or 4"):
        ops.decode_stages()
