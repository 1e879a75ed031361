"""The FP8 KV cache of the CUDA attention backend (kv_cache_dtype="fp8") against the torch
reference's FP8 cache (TorchReferenceAttention(kv_cache_dtype="fp8")), which defines it.

Both caches start with the same random e4m3 bytes; the oracle runs the reference in float64
over them (its reads are e4m3 -> float32 * scale, then float64), and every output row of
every sequence is checked by its relative error ||out - ref|| / ||ref||: < 2e-2 for bf16,
5e-3 for fp16, 1e-5 for fp32. The bytes the CUDA cache write stores are checked exactly
against `quantize_with_scale` on the CPU (IEEE division, saturation, nearest even), and
against the reference backend's own cache where the scales are powers of two (the
reference on the GPU divides by multiplying with the reciprocal, which can differ by an
ulp before rounding otherwise). Inputs are random, outputs are poisoned with NaN first.

Run on a GPU machine:
    PYTHONUNBUFFERED=1 python3 -m pytest -m gpu tests/gpu/test_fp8_kv_cache.py -x -q
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda import CudaAttentionMetadata, CudaPagedAttention, ops
from inflightllm.attention.torch_ref import TorchReferenceAttention
from inflightllm.quantization.fp8 import quantize_with_scale
from perf.bench_decode_attention import forward_graph

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def ref_metadata(ref: TorchReferenceAttention, sequences):
    """The reference's metadata on the GPU (its boolean masks of non-decode sequences are
    built on the CPU)."""
    md = ref.build_metadata(sequences, DEV)
    md.backend_data["others"] = [
        (index, gather, mask if isinstance(mask, str) else mask.to(DEV))
        for index, gather, mask in md.backend_data["others"]
    ]
    return md


def is_pow2(x: float) -> bool:
    return math.frexp(x)[0] == 0.5


def random_e4m3(shape, scale: float, generator=None) -> torch.Tensor:
    """e4m3 bytes of N(0, 1) values stored with `scale` (what a cache holds), on the GPU."""
    values = torch.randn(shape, generator=generator)
    return quantize_with_scale(values, scale).view(torch.uint8).to(DEV)


class Fp8Case:
    """A packed step: `specs` = [(query_len, context_len), ...], decodes (query_len 1) first.
    A CUDA backend with an FP8 cache and the FP8 reference share the same random bytes."""

    def __init__(self, specs, num_heads, num_kv_heads, head_dim, block_size, dtype, scales=(1.0, 1.0),
                 window=None, seed=0, max_model_len=None, fused=True):
        torch.manual_seed(seed)
        self.dtype, self.scales = dtype, scales
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        needed = [math.ceil(ctx / block_size) for _, ctx in specs]
        num_blocks = sum(needed) + 8
        perm = torch.randperm(num_blocks).tolist()
        self.sequences = []
        start, used = 0, 0
        for (ql, ctx), nb in zip(specs, needed):
            junk = torch.randint(0, num_blocks, (3,)).tolist()  # arbitrary unused entries
            self.sequences.append(SequenceSlice(start, ql, ctx, tuple(perm[used : used + nb] + junk)))
            used += nb
            start += ql
        self.num_tokens = start
        longest = max(ctx for _, ctx in specs)
        self.backend = CudaPagedAttention(num_heads, num_kv_heads, head_dim, window,
                                          max_model_len=max_model_len or max(longest, 1024),
                                          kv_cache_dtype="fp8", kv_scales=[scales])
        self.backend.allocate_kv_cache(num_blocks, block_size, 1, num_kv_heads, head_dim, dtype, DEV)
        cache = self.backend.kv_cache
        assert cache.dtype == torch.uint8 and self.backend.dtype == torch.uint8
        assert self.backend.kv_cache_bytes == cache.numel()
        cache[0, 0].copy_(random_e4m3(cache.shape[2:], scales[0]))
        cache[0, 1].copy_(random_e4m3(cache.shape[2:], scales[1]))
        self.initial = cache.clone()
        self.ref = TorchReferenceAttention(num_heads, num_kv_heads, head_dim, window,
                                           kv_cache_dtype="fp8", kv_scales=[scales])
        self.ref.allocate_kv_cache(num_blocks, block_size, 1, num_kv_heads, head_dim, torch.float64, DEV)
        self.ref.key_cache[0].copy_(cache[0, 0].reshape(-1, num_kv_heads, head_dim))
        self.ref.value_cache[0].copy_(cache[0, 1].reshape(-1, num_kv_heads, head_dim))
        t = self.num_tokens
        if fused:  # strided views of one fused qkv projection, as the model produces them
            qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, device=DEV).to(dtype)
            hd, kd = num_heads * head_dim, num_kv_heads * head_dim
            self.q = qkv[:, :hd].view(t, num_heads, head_dim)
            self.k = qkv[:, hd : hd + kd].view(t, num_kv_heads, head_dim)
            self.v = qkv[:, hd + kd :].view(t, num_kv_heads, head_dim)
        else:
            self.q = torch.randn(t, num_heads, head_dim, device=DEV).to(dtype)
            self.k = torch.randn(t, num_kv_heads, head_dim, device=DEV).to(dtype)
            self.v = torch.randn(t, num_kv_heads, head_dim, device=DEV).to(dtype)
        md = ref_metadata(self.ref, self.sequences)
        self.expected = self.ref.forward(0, self.q.double(), self.k.double(), self.v.double(), md)
        self.metadata = self.backend.build_metadata(self.sequences, DEV)

    def run(self, impl: str | None = None, decode: str = "v2") -> torch.Tensor:
        if impl is not None:
            self.backend.prefill_impl = impl
        self.backend.decode_impl = decode
        out = torch.full((self.num_tokens, self.h, self.d), float("nan"), dtype=self.dtype, device=DEV)
        result = self.backend.forward(0, self.q, self.k, self.v, self.metadata, out=out)
        assert result.data_ptr() == out.data_ptr()
        return out

    def check(self, out: torch.Tensor, label: str) -> float:
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{label}: unwritten (NaN) or non-finite outputs"
        worst = 0.0
        for seq in self.sequences:
            a = out[seq.query_start : seq.query_start + seq.query_len].double()
            b = self.expected[seq.query_start : seq.query_start + seq.query_len]
            rel = float((a - b).norm() / b.norm())
            worst = max(worst, rel)
            assert rel < TOL[self.dtype], f"{label}: seq q={seq.query_len} ctx={seq.context_len} rel {rel:.3e}"
        check_cache_bytes(self.backend, self.initial, self.metadata.slot_mapping, self.k, self.v, self.scales, label)
        if all(is_pow2(s) for s in self.scales):  # the reference's cache, byte for byte
            assert torch.equal(self.backend.key_cache[0].reshape(-1, self.kvh, self.d), self.ref.key_cache[0]), label
            assert torch.equal(self.backend.value_cache[0].reshape(-1, self.kvh, self.d), self.ref.value_cache[0]), label
        return worst


def check_cache_bytes(backend, initial, slot_mapping, k, v, scales, label, layer=0):
    """The new K/V's slots hold quantize_with_scale's bytes (computed on the CPU) exactly;
    every other slot kept its bytes (padding slots, -1, are not written)."""
    kvh, d = k.shape[1], k.shape[2]
    kc = backend.key_cache[layer].reshape(-1, kvh, d)
    vc = backend.value_cache[layer].reshape(-1, kvh, d)
    slots = slot_mapping.cpu()
    keep = slots >= 0
    written = slots[keep].to(DEV)
    want_k = quantize_with_scale(k.cpu()[keep], scales[0]).view(torch.uint8)
    want_v = quantize_with_scale(v.cpu()[keep], scales[1]).view(torch.uint8)
    got_k, got_v = kc[written].cpu(), vc[written].cpu()
    assert torch.equal(got_k, want_k), f"{label}: K bytes differ in {(got_k != want_k).sum().item()} elements"
    assert torch.equal(got_v, want_v), f"{label}: V bytes differ in {(got_v != want_v).sum().item()} elements"
    untouched = torch.ones(kc.shape[0], dtype=torch.bool, device=DEV)
    untouched[written] = False
    before_k = initial[layer, 0].reshape(-1, kvh, d)
    before_v = initial[layer, 1].reshape(-1, kvh, d)
    assert torch.equal(kc[untouched], before_k[untouched]), f"{label}: K bytes outside the slots changed"
    assert torch.equal(vc[untouched], before_v[untouched]), f"{label}: V bytes outside the slots changed"


def check_v4(case: Fp8Case, v2: torch.Tensor, label: str, impl: str | None = None) -> None:
    """paged_decode_v4 over the FP8 cache: within tolerance and with v2's bits (same scoring
    code, only the slices' way in differs)."""
    v2 = v2.clone()
    v4 = case.run(impl, decode="v4")
    case.check(v4, label + " decode v4")
    assert torch.equal(v4, v2), f"{label}: decode v4 differs from v2 in {(v4 != v2).sum().item()} elements"


MIXED = [
    (1, 1),
    (1, 15),
    (1, 16),
    (1, 17),  # block boundaries (block size 16)
    (1, 300),
    (1, 1000),
    (1, 2500),  # decodes; few of them: the contexts are split (v2 + decode_reduce)
    (100, 100),  # a whole prompt
    (1, 50),  # a one-token chunk
    (200, 1200),  # a chunk after earlier chunks
    (64, 64),
    (33, 33),
    (333, 900),  # a prompt after a prefix-cache hit
    (7, 7),
]
SCALES = [(1.0, 1.0), (0.5, 2.0), (0.023, 0.0171)]  # default, powers of two, a checkpoint's kind


@pytest.mark.parametrize("scales", SCALES, ids=["scale1", "pow2", "checkpoint"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_bf16(head_dim, group, scales):
    kvh = 3 if group == 3 else 2  # group 3 with 3 kv heads: SmolLM2's 9/3 heads
    block_size = 16 if group != 4 else 32
    case = Fp8Case(MIXED, kvh * group, kvh, head_dim, block_size, torch.bfloat16, scales, seed=group + head_dim)
    assert case.backend.decode_splits(case.metadata.num_decodes) > 1
    label = f"fp8 mixed bf16 d={head_dim} bs={block_size} gqa={group} scales={scales}"
    case.check(v2 := case.run("flash", decode="v2"), label + " flash, decode v2")
    assert case.backend._flash_error is None, case.backend._flash_error
    check_v4(case, v2, label + " flash,", "flash")
    case.check(case.run("mma", decode="v2"), label + " mma (dequantized scratch cache), decode v2")
    for kv_heads in (1, 2, 4):  # kv heads a block (more than the model has: spare warps)
        case.backend.v5_kv_heads = kv_heads
        case.check(case.run("flash", decode="v5"), label + f" flash, decode v5 (tensor cores), {kv_heads} kv heads a block")
    case.backend.v5_kv_heads = None
    case.check(case.run("flash", decode="v6"), label + " flash, decode v6 (pages by TMA)")
    case.backend.decode_impl = "auto"  # v5 below ops.DECODE_V6_MIN_DECODES decodes, v6 from it (an H100 / H200)
    assert [case.backend.decode_kernel(n)[0] for n in (1, ops.DECODE_V6_MIN_DECODES - 1, ops.DECODE_V6_MIN_DECODES)] == ["v5", "v5", "v6"]
    auto = case.backend.decode_kernel(case.metadata.num_decodes)[0]
    case.check(case.run("flash", decode="auto"), label + f" flash, decode auto ({auto}, {case.metadata.num_decodes} decodes)")


@pytest.mark.parametrize("group", [5, 12, 16])
def test_v5_groups_of_more_or_fewer_than_8_heads(group):
    """paged_decode_v5 takes 8 query heads a block: a group of 12 or 16 is two blocks per kv
    head (the second of 12 half empty), a group of 5 leaves 3 rows of its tile empty."""
    case = Fp8Case(MIXED, 2 * group, 2, 128, 16, torch.bfloat16, (0.023, 0.0171), seed=group)
    label = f"fp8 mixed bf16 d=128 gqa={group}"
    case.check(case.run("flash", decode="v5"), label + " decode v5")
    case.check(case.run("flash", decode="v6"), label + " decode v6")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mixed_batch_other_dtypes(dtype):
    """fp32 queries: 4-byte slices (cp.async of 4 bytes in v4) and prefill_fma over the
    dequantized scratch cache; fp16: the same as bf16. Powers of two for scales: the reference
    then stores the kernel's bytes (its GPU division by a reciprocal could put a new value on
    the other e4m3 neighbour, more than fp32's tolerance for a token attending itself)."""
    case = Fp8Case(MIXED, 8, 2, 128, 16, dtype, (0.25, 0.03125), seed=3)
    label = f"fp8 mixed {NAMES[dtype]} d=128 gqa=4"
    case.check(v2 := case.run("flash", decode="v2"), label + " decode v2")
    check_v4(case, v2, label, "flash")
    if dtype != torch.float32:
        case.check(case.run("mma", decode="v2"), label + " mma, decode v2")
        case.check(case.run("flash", decode="v5"), label + " decode v5")
        case.check(case.run("flash", decode="v6"), label + " decode v6")
    else:  # v5 computes in f16: not for float32 queries, which "auto" keeps on v2 / v4
        assert case.backend.decode_kernel(case.metadata.num_decodes)[0] in ("v2", "v4")


def test_many_decodes_unsplit():
    """300 decodes: "auto" takes v6 with the splits ops.wave_splits gives; then the contexts
    unsplit (the kernels' direct writes, no reduce), for v5 with 1, 2 and 4 kv heads a block, v6 (the
    model has 2: spare warps), v4 and v2; v4 has v2's bits."""
    gen = torch.Generator().manual_seed(9)
    specs = [(1, int(c)) for c in torch.randint(1, 1500, (300,), generator=gen)]
    case = Fp8Case(specs, 8, 2, 64, 16, torch.bfloat16, (0.5, 0.5), seed=9)
    impl, splits = case.backend.decode_kernel(300)
    assert impl == "v6" and splits >= 1
    case.check(case.run(decode="auto"), f"fp8 300 decodes, decode auto (v6, {splits} splits)")
    case.backend.decode_splits = lambda *args, **kwargs: 1  # unsplit from here on
    assert case.backend.decode_kernel(300) == ("v6", 1)
    for kv_heads in (1, 2, 4):
        case.backend.v5_kv_heads = kv_heads
        case.check(case.run(decode="v5"), f"fp8 300 decodes unsplit, decode v5, {kv_heads} kv heads a block")
    case.backend.v5_kv_heads = None
    case.check(case.run(decode="v6"), "fp8 300 decodes unsplit, decode v6")
    case.check(v4 := case.run(decode="v4"), "fp8 300 decodes unsplit, decode v4")
    v2 = case.run(decode="v2")
    case.check(v2, "fp8 300 decodes unsplit, decode v2")
    assert torch.equal(v2, v4)


@pytest.mark.parametrize("min_split", [32, 128, 256])
def test_long_contexts_and_splits(min_split):
    specs = [(1, n) for n in (1, 31, 32, 33, 511, 513, 4097, 20001)] + [(128, 9000)]
    case = Fp8Case(specs, 32, 8, 128, 16, torch.bfloat16, (0.07, 0.09), seed=21, max_model_len=32768)
    case.backend.decode_min_split = case.backend.v5_min_split = min_split
    case.check(v2 := case.run("flash", decode="v2"), f"fp8 long, min split {min_split}, decode v2")
    check_v4(case, v2, f"fp8 long, min split {min_split},", "flash")
    case.check(case.run("flash", decode="v5"), f"fp8 long, min split {min_split}, decode v5")
    case.check(case.run("flash", decode="v6"), f"fp8 long, min split {min_split}, decode v6")


def test_sliding_window():
    specs = [(1, 100), (1, 256), (1, 257), (1, 3000), (600, 600), (100, 2000), (1, 700), (300, 300)]
    case = Fp8Case(specs, 8, 2, 128, 16, torch.bfloat16, (1.0, 1.0), window=256, seed=11)
    case.check(v2 := case.run("flash", decode="v2"), "fp8 window=256 flash, decode v2")
    check_v4(case, v2, "fp8 window=256 flash,", "flash")
    case.check(case.run("mma", decode="v2"), "fp8 window=256 mma, decode v2")
    case.check(case.run("flash", decode="v5"), "fp8 window=256 flash, decode v5")
    case.check(case.run("flash", decode="v6"), "fp8 window=256 flash, decode v6")


def test_cudnn_dense_prefill_over_the_dequantized_cache():
    """Whole prompts of one length from 512 tokens as dense cuDNN calls over the K/V gathered
    (dequantized) from the FP8 cache, among chunks, prefix hits and decodes."""
    from .test_cuda_attention import DENSE, DENSE_CALLS, count_dense_calls

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN dense prefill attention is taken on Hopper or later")
    case = Fp8Case(DENSE, 32, 8, 128, 16, torch.bfloat16, (0.023, 0.0171), seed=13)
    calls = count_dense_calls(case.backend)
    case.check(case.run("flash", decode="auto"), "fp8 cudnn dense bf16 32/8 d=128")
    assert case.backend._cudnn_error is None, case.backend._cudnn_error
    assert calls == DENSE_CALLS


def test_prefill_only_unfused_inputs():
    case = Fp8Case([(1024, 1024), (77, 300)], 32, 8, 128, 16, torch.bfloat16, (0.5, 0.25), seed=2, fused=False)
    case.check(case.run("flash"), "fp8 prefill flash")
    case.check(case.run("mma"), "fp8 prefill mma")


def test_padding_and_unaligned_inputs():
    """Slot -1 tokens are not written, a context_len 0 row yields zeros, and misaligned K/V
    take reshape_and_cache_fp8's one-element path (the same bytes)."""
    torch.manual_seed(4)
    h, kvh, d, bs, scales = 8, 2, 64, 16, (0.5, 0.125)
    backend = CudaPagedAttention(h, kvh, d, max_model_len=2048, kv_cache_dtype="fp8", kv_scales=[scales])
    backend.allocate_kv_cache(64, bs, 1, kvh, d, torch.bfloat16, DEV)
    backend.kv_cache[0, 0].copy_(random_e4m3(backend.kv_cache.shape[2:], scales[0]))
    backend.kv_cache[0, 1].copy_(random_e4m3(backend.kv_cache.shape[2:], scales[1]))
    ref = TorchReferenceAttention(h, kvh, d, kv_cache_dtype="fp8", kv_scales=[scales])
    ref.allocate_kv_cache(64, bs, 1, kvh, d, torch.float64, DEV)
    ref.key_cache[0].copy_(backend.key_cache[0].reshape(-1, kvh, d))
    ref.value_cache[0].copy_(backend.value_cache[0].reshape(-1, kvh, d))
    seqs = [SequenceSlice(0, 1, 40, (5, 9, 11)), SequenceSlice(1, 1, 300, tuple(range(20, 39)))]
    md = backend.build_metadata(seqs, DEV)
    pad = CudaAttentionMetadata(  # a graph bucket of 3: one padding decode (context 0, slot -1)
        num_decodes=3, num_prefills=0, num_decode_tokens=3, max_query_len=0, max_context_len=2048,
        slot_mapping=torch.cat([md.slot_mapping, torch.tensor([-1], device=DEV)]),
        positions=torch.cat([md.positions, torch.tensor([0], device=DEV)]),
        block_tables=torch.cat([md.block_tables, torch.zeros_like(md.block_tables[:1])]),
        context_lens=torch.cat([md.context_lens, torch.zeros(1, dtype=torch.int32, device=DEV)]),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEV),
    )
    flat = torch.randn(3 * h * d + 2 * 3 * kvh * d + 3, device=DEV).to(torch.bfloat16)
    q = flat[1 : 1 + 3 * h * d].view(3, h, d)  # 2-byte misaligned
    k = flat[1 + 3 * h * d : 1 + 3 * h * d + 3 * kvh * d].view(3, kvh, d)
    v = flat[2 + 3 * h * d + 3 * kvh * d : 2 + 3 * h * d + 6 * kvh * d].view(3, kvh, d)
    assert not ops.aligned16(k)
    initial = backend.kv_cache.clone()
    expected = ref.forward(0, q[:2].double(), k[:2].double(), v[:2].double(), ref_metadata(ref, seqs))
    for decode in ("v2", "v4", "v5", "v6"):
        backend.decode_impl = decode
        out = torch.full((3, h, d), float("nan"), dtype=torch.bfloat16, device=DEV)
        backend.forward(0, q, k, v, pad, out=out)
        torch.cuda.synchronize()
        rel = float((out[:2].double() - expected).norm() / expected.norm())
        assert rel < 2e-2, (decode, rel)
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        check_cache_bytes(backend, initial, pad.slot_mapping, k, v, scales, f"unaligned, decode {decode}")
        assert torch.equal(backend.key_cache[0].reshape(-1, kvh, d), ref.key_cache[0])


def test_unaligned_write_equals_aligned_write():
    """The one-element and the 8-element cache writes store the same bytes (saturation at
    +-448 included: values up to 1000x the scale)."""
    torch.manual_seed(6)
    kvh, d, scales = 3, 64, (0.3, 0.007)
    tokens = 40
    count = 2 * tokens * kvh * d
    values = torch.randn(count, device=DEV) * 100
    values[::97] = float("inf")
    values[::89] = -1e6
    slots = torch.randperm(64 * 16, device=DEV)[:tokens]
    caches = []
    for offset in (0, 1):
        backend = CudaPagedAttention(kvh * 2, kvh, d, kv_cache_dtype="fp8", kv_scales=[scales])
        backend.allocate_kv_cache(64, 16, 1, kvh, d, torch.float32, DEV)
        buffer = torch.zeros(count + 1, device=DEV)
        buffer[offset : offset + count] = values  # the same values, 16-byte aligned or not
        kv = buffer[offset : offset + count].view(tokens, 2, kvh, d)
        k, v = kv[:, 0], kv[:, 1]
        assert ops.aligned16(k) == (offset == 0)
        ops.reshape_and_cache_fp8(k, v, backend.key_cache[0], backend.value_cache[0], slots, *scales,
                                  ops.current_stream())
        torch.cuda.synchronize()
        check_cache_bytes(backend, torch.zeros_like(backend.kv_cache), slots, k, v, scales, f"offset {offset}")
        caches.append(backend.kv_cache.clone())
    assert torch.equal(caches[0], caches[1])


def test_swap_round_trip():
    """swap_out copies the FP8 blocks' bytes of every layer to host memory and swap_in puts
    them into other blocks; attention over the new blocks gives the same output."""
    torch.manual_seed(8)
    h, kvh, d, bs, layers = 8, 2, 128, 16, 3
    scales = [(0.5, 0.25), (1.0, 1.0), (0.1, 0.3)]
    backend = CudaPagedAttention(h, kvh, d, max_model_len=1024, kv_cache_dtype="fp8", kv_scales=scales)
    backend.allocate_kv_cache(40, bs, layers, kvh, d, torch.bfloat16, DEV)
    for layer in range(layers):
        backend.kv_cache[layer, 0].copy_(random_e4m3(backend.kv_cache.shape[2:], scales[layer][0]))
        backend.kv_cache[layer, 1].copy_(random_e4m3(backend.kv_cache.shape[2:], scales[layer][1]))
    old_blocks, new_blocks = [3, 7, 1, 12], [30, 21, 25, 39]
    ctx = 60
    q = torch.randn(1, h, d, device=DEV).to(torch.bfloat16)
    k = torch.randn(1, kvh, d, device=DEV).to(torch.bfloat16)
    v = torch.randn(1, kvh, d, device=DEV).to(torch.bfloat16)

    def attend(blocks):
        md = backend.build_metadata([SequenceSlice(0, 1, ctx, tuple(blocks))], DEV)
        return [backend.forward(layer, q, k, v, md).clone() for layer in range(layers)]

    before = attend(old_blocks)
    saved = [backend.kv_cache[:, :, b].clone() for b in old_blocks]
    handle = backend.swap_out(old_blocks)
    assert handle[0][0].dtype == torch.uint8 and handle[0][0].is_pinned()
    backend.kv_cache[:, :, old_blocks] = 0  # the blocks go to another request
    backend.swap_in(handle, new_blocks)
    torch.cuda.synchronize()
    for block, want in zip(new_blocks, saved):
        assert torch.equal(backend.kv_cache[:, :, block], want)
    after = attend(new_blocks)
    for layer in range(layers):
        assert torch.equal(before[layer], after[layer]), f"layer {layer}"


def test_cuda_graph_decode():
    """A captured FP8 decode step replayed on new contexts, block tables and inputs (decode
    "auto": v5)."""
    h, kvh, d, bs, dtype, scales = 32, 8, 128, 16, torch.bfloat16, (0.5, 0.5)
    max_model_len, nd = 4096, 8
    width = max_model_len // bs
    num_blocks = nd * width + 8
    backend = CudaPagedAttention(h, kvh, d, max_model_len=max_model_len, kv_cache_dtype="fp8", kv_scales=[scales])
    backend.allocate_kv_cache(num_blocks, bs, 1, kvh, d, dtype, DEV)
    backend.kv_cache[0, 0].copy_(random_e4m3(backend.kv_cache.shape[2:], scales[0]))
    backend.kv_cache[0, 1].copy_(random_e4m3(backend.kv_cache.shape[2:], scales[1]))
    gen = torch.Generator().manual_seed(1)

    def tables(contexts):
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        seqs, used = [], 0
        for i, c in enumerate(contexts):
            n = math.ceil(c / bs)
            seqs.append(SequenceSlice(i, 1, c, tuple(perm[used : used + n])))
            used += n
        md = backend.build_metadata(seqs, DEV)
        table = torch.zeros((nd, width), dtype=torch.int32, device=DEV)
        table[:, : md.block_tables.shape[1]] = md.block_tables
        return seqs, md, table

    _, md_a, table_a = tables([5, 100, 17, 1, 600, 33, 2000, 64])
    static = CudaAttentionMetadata(
        num_decodes=nd, num_prefills=0, num_decode_tokens=nd, max_query_len=0, max_context_len=max_model_len,
        slot_mapping=md_a.slot_mapping.clone(), positions=md_a.positions.clone(), block_tables=table_a,
        context_lens=md_a.context_lens.clone(), query_start_loc=md_a.query_start_loc.clone(),
    )
    graph, q, k, v, out = forward_graph(backend, static, nd, dtype, DEV, warmups=2)

    seqs_b, md_b, table_b = tables([4096, 3000, 1, 2500, 700, 4000, 129, 1024])
    static.block_tables.copy_(table_b)
    static.context_lens.copy_(md_b.context_lens)
    static.slot_mapping.copy_(md_b.slot_mapping)
    q.copy_(torch.randn(nd, h, d, device=DEV))
    k.copy_(torch.randn(nd, kvh, d, device=DEV))
    v.copy_(torch.randn(nd, kvh, d, device=DEV))
    ref = TorchReferenceAttention(h, kvh, d, kv_cache_dtype="fp8", kv_scales=[scales])
    ref.allocate_kv_cache(num_blocks, bs, 1, kvh, d, torch.float64, DEV)
    ref.key_cache[0].copy_(backend.key_cache[0].reshape(-1, kvh, d))
    ref.value_cache[0].copy_(backend.value_cache[0].reshape(-1, kvh, d))
    out.fill_(float("nan"))
    graph.replay()
    expected = ref.forward(0, q.double(), k.double(), v.double(), ref_metadata(ref, seqs_b))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    for i in range(nd):
        rel = float((out[i].double() - expected[i]).norm() / expected[i].norm())
        assert rel < 2e-2, (i, rel)
    assert torch.equal(backend.key_cache[0].reshape(-1, kvh, d), ref.key_cache[0])


def test_decode_v4_fp8_keeps_the_blocks_per_sm():
    """The FP8 v4 kernels' ring (half the bytes of bf16's) leaves the resident blocks per SM
    that decode_splits counts on."""
    import ctypes

    from inflightllm.gpu import pdl

    for dtype in (torch.bfloat16, torch.float32):
        for maxg in ops.DECODE_MAXG:
            smem = ops.decode_dynamic_smem("v4", maxg, ops.fp8_slice_bytes(dtype))
            for head_dim in ops.HEAD_DIMS:
                mod = ops.fp8_module(dtype, head_dim, torch.cuda.current_device())
                fn = mod.get(ops.decode_kernel_name("v4", ops.CTYPE[dtype], head_dim, maxg, ops.FP8_CTYPE), smem)
                blocks = ctypes.c_int()
                status = pdl._driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(blocks), ctypes.c_void_p(fn.kernel.ptr), ctypes.c_int(ops.DECODE_THREADS),
                    ctypes.c_size_t(smem))
                assert status == 0, status
                assert blocks.value >= ops.decode_blocks_per_sm(maxg), (dtype, maxg, head_dim, blocks.value)
    for head_dim, kv_heads in itertools.product(ops.HEAD_DIMS, ops.DECODE_V5_KV_HEAD_CHOICES):  # v5
        mod = ops.fp8_module(torch.bfloat16, head_dim, torch.cuda.current_device())
        fn = mod.get(ops.decode_kernel_name("v5", "__nv_bfloat16", head_dim, 8, ops.FP8_CTYPE, kv_heads))
        blocks = ctypes.c_int()
        status = pdl._driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), ctypes.c_void_p(fn.kernel.ptr), ctypes.c_int(ops.DECODE_THREADS), ctypes.c_size_t(0))
        assert status == 0, status
        assert blocks.value >= ops.decode_blocks_per_sm(8, "v5"), (head_dim, kv_heads, blocks.value)


# ------------------------------------------------------------------------------ the engine
def reference_greedy(loaded, prompt: list[int], max_tokens: int):
    """Greedy ids of one request through the engine's own GPU model with the FP8 torch
    reference attention (one prefill, then one decode step at a time), and each step's
    float32 logits."""
    from inflightllm.gpu import ops as gpu_ops

    arch, model = loaded.arch, loaded.model
    bs = 16
    total = len(prompt) + max_tokens
    blocks = math.ceil(total / bs)
    ref = TorchReferenceAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.sliding_window,
                                  kv_cache_dtype="fp8", kv_scales=loaded.kv_scales)
    ref.allocate_kv_cache(blocks, bs, arch.num_layers, arch.num_kv_heads, arch.head_dim, loaded.dtype, loaded.device)
    table = tuple(range(blocks))
    tokens, ids, all_logits = list(prompt), [], []
    computed = 0
    with torch.inference_mode(), gpu_ops.torch_stream():
        for _ in range(max_tokens):
            new = tokens[computed:]
            md = ref.build_metadata([SequenceSlice(0, len(new), len(tokens), table)], loaded.device)
            hidden = model.forward(torch.tensor(new, device=loaded.device), md.positions, ref, md)
            logits = model.compute_logits(hidden[-1:])[0]
            token = int(logits.argmax())
            all_logits.append(logits)
            ids.append(token)
            computed = len(tokens)
            tokens.append(token)
    return ids, all_logits


def assert_greedy_matches(engine_ids, ref_ids, ref_logits, near_tie: float, label: str):
    """Equal ids, or at the first divergence the engine's token is a near tie of the
    reference's best there: within `near_tie` of the spread of its logits (max - mean).
    (Batched and single-request GEMMs round differently in float32, and a K value that
    lands on the other side of an e4m3 rounding midpoint moves the logits a little.)"""
    if engine_ids == ref_ids:
        return
    i = next((j for j, (a, b) in enumerate(zip(engine_ids, ref_ids)) if a != b), None)
    assert i is not None, f"{label}: lengths differ: {len(engine_ids)} vs {len(ref_ids)}"
    logits = ref_logits[i]
    finite = logits[torch.isfinite(logits)]
    spread = float(finite.max() - finite.mean())
    gap = float(logits.max() - logits[engine_ids[i]])
    assert gap <= near_tie * spread, (
        f"{label}: first divergence at token {i}: engine {engine_ids[i]} vs reference {ref_ids[i]}, "
        f"logit gap {gap:.4f} > {near_tie} x spread {spread:.4f}"
    )


def gpu_config(**overrides):
    from inflightllm.config import EngineConfig

    values = dict(device="gpu", gpu_ids=(0,), max_batch_size=16, max_num_tokens=512, max_input_length=512,
                  max_output_len=64, num_kv_blocks=256, cuda_graphs=True, async_scheduling=True,
                  kv_cache_dtype="fp8")
    values.update(overrides)
    return EngineConfig(**values)


def make_prompts(count, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 33, 64, 9, 120, 47, 250]
    return [torch.randint(10, vocab, (lengths[i % len(lengths)],), generator=generator).tolist() for i in range(count)]


@pytest.fixture(scope="module")
def fp32_fp8_engine():
    from inflightllm.engine import Engine
    from inflightllm.model_source import ModelSpec

    spec = ModelSpec(source="random", shape="smollm2-135m", seed=0, dtype="float32")
    return Engine(spec, gpu_config(), sampler_seed=0)


def generate(engine, prompts, max_tokens, arrivals=None):
    from inflightllm.llm import LLM
    from inflightllm.sampling_params import SamplingParams

    llm = LLM(engine.model_spec, engine=engine, load_tokenizer_too=False)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [r.token_ids for r in llm.generate(prompts, params, arrival_steps=arrivals)]


def test_engine_fp8_kv_greedy_fp32(fp32_fp8_engine):
    """The GPU engine with kv_cache_dtype fp8 (float32 random SmolLM2-shaped Llama: 9 heads,
    3 KV heads, d=64): in-flight batches with staggered arrivals and CUDA-graph decodes give
    the greedy ids of the same model over the FP8 torch reference cache."""
    engine = fp32_fp8_engine
    runner = engine.runner
    attention = runner.attention
    assert attention.kv_cache_dtype == "fp8" and attention.kv_cache.dtype == torch.uint8
    assert attention.dtype != engine.loaded.dtype  # the small-batch qkv kernel leaves the write to forward
    assert runner.kv_cache_bytes == attention.kv_cache_bytes  # 1 byte an element
    prompts = make_prompts(8, engine.vocab_size, seed=0)
    max_tokens = [24, 8, 40, 16, 12, 32, 20, 28]
    ids = generate(engine, prompts, max_tokens, [0, 0, 1, 2, 3, 3, 5, 8])
    assert runner.graphs, "decode steps should have CUDA graphs"
    assert attention.kv_cache.any(), "the FP8 cache was never written"
    for i, (prompt, n, got) in enumerate(zip(prompts, max_tokens, ids)):
        want, logits = reference_greedy(engine.loaded, prompt, n)
        assert_greedy_matches(got, want, logits, 0.01, f"prompt {i}")


def test_engine_fp8_kv_chunked_and_swapped(fp32_fp8_engine):
    """Chunked prefills (earlier chunks read back through gather_kv_fp8 into prefill_fma's
    scratch cache) and swap preemption (the FP8 byte blocks to host memory and back) keep the
    reference's greedy ids."""
    from inflightllm.engine import Engine

    base = fp32_fp8_engine
    prompts = make_prompts(8, base.vocab_size, seed=2)
    max_tokens = [40] * 8
    schedules = {
        "chunked": dict(max_num_tokens=40, max_batch_size=8),
        "swapped": dict(num_kv_blocks=40, max_batch_size=8, preemption_mode="swap", swap_space_blocks=200),
    }
    for name, overrides in schedules.items():
        engine = Engine(base.model_spec, gpu_config(**overrides), sampler_seed=0, loaded=base.loaded)
        ids = generate(engine, prompts, max_tokens, [0, 0, 0, 1, 1, 2, 3, 4] if name == "chunked" else None)
        if name == "swapped":
            assert engine.stats().num_swapped_out_total > 0, "the schedule should have swapped requests out"
        for i, (prompt, n, got) in enumerate(zip(prompts, max_tokens, ids)):
            want, logits = reference_greedy(base.loaded, prompt, n)
            assert_greedy_matches(got, want, logits, 0.01, f"{name}: prompt {i}")


def test_engine_fp8_kv_bf16_small_batch_kernels(monkeypatch):
    """bf16 with the fused small-batch kernels on (batch-1 decodes): the qkv kernel does not
    write the FP8 cache itself (attention.dtype is uint8), forward quantizes; ids follow the
    reference to within bf16's ties (top-5 at the first divergence, as the bf16 engine test)."""
    from inflightllm.engine import Engine
    from inflightllm.model_source import ModelSpec

    monkeypatch.setenv("INFLIGHTLLM_SMALL_BATCH_KERNELS", "on")
    spec = ModelSpec(source="random", shape="smollm2-135m", seed=0, dtype="bfloat16")
    engine = Engine(spec, gpu_config(), sampler_seed=0)
    assert engine.runner.attention.dtype == torch.uint8
    prompts = make_prompts(3, engine.vocab_size, seed=4)
    for prompt in prompts:  # one at a time: batch-1 decode steps take the small-batch kernels
        got = generate(engine, [prompt], [24])[0]
        want, logits = reference_greedy(engine.loaded, prompt, 24)
        if got != want:
            i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            assert got[i] in torch.topk(logits[i], 5).indices.tolist(), (i, got, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_fp8_kv_follows_tp1():
    """Tensor parallelism: every rank's runner builds its FP8 cache from the same config (the
    workers get kv_cache_dtype with the rest of it); TP=2 greedy ids follow TP=1's with FP8
    KV on both (fp32; a K value rounded to the other e4m3 neighbour by the sharded GEMMs may
    move one late token, so at most one of the prompts may differ, and not in its first 8)."""
    from inflightllm.engine import Engine
    from inflightllm.model_source import ModelSpec
    from perf.bench_tp import exact_folder, prompts_of, release

    spec = ModelSpec(source="hf_folder", path=str(exact_folder()), dtype="float32")
    prompts = [prompts_of(1, n, 49152, seed=n)[0] for n in (5, 300, 17, 64, 9, 700)]
    outputs = {}
    for tp in (1, 2):
        engine = Engine(spec, gpu_config(gpu_ids=tuple(range(tp)), tensor_parallel_size=tp, max_input_length=1024,
                                         max_num_tokens=256),
                        sampler_seed=0)
        try:
            outputs[tp] = generate(engine, prompts, [24] * len(prompts), [0, 0, 1, 2, 4, 7])
        finally:
            getattr(engine.runner, "shutdown", lambda: None)()
        engine = None
        release()
    differ = [i for i in range(len(prompts)) if outputs[1][i] != outputs[2][i]]
    assert len(differ) <= 1, differ
    for i in differ:
        assert outputs[1][i][:8] == outputs[2][i][:8], i


def test_fp8_decode_timings():
    """Decode step time (graph replay of one forward: cache write + decode + reduce) with an
    FP8 and a bf16 cache, Llama-3-8B attention shape (32 heads, 8 kv heads, d=128, block 16):
    bf16 (auto: v4 / v2), FP8 on CUDA cores (v4 where unsplit, else v2), FP8 on tensor cores
    (v5; v6, pages by TMA) and FP8 auto (v5 below 8 decodes, v6 from them). The FP8 cache moves
    half the bytes: at a large batch, where decode is bound by them, auto must not be slower
    than bf16's. Printed, and written to $OUT/fp8-kv-timings.md
    when set."""
    import os
    import statistics

    from perf.bench_decode_attention import decode_layer_us

    h, kvh, d, bs = 32, 8, 128, 16
    max_model_len = 8192
    num_blocks = 256 * 2048 // bs + 64
    rows, times = [], {}
    cases = (("auto", "auto"), ("fp8", "cuda-cores"), ("fp8", "v5 1 kv head"), ("fp8", "v5"),  # v5: 4 kv heads a block
             ("fp8", "v6"), ("fp8", "auto"))  # fp8 auto: v5 at batch 1, v6 from 8 decodes
    for kind, decode in cases:
        backend = CudaPagedAttention(h, kvh, d, max_model_len=max_model_len, kv_cache_dtype=kind)
        if decode == "v5 1 kv head":
            backend.v5_kv_heads = 1
        if decode in ("v5 1 kv head", "v5", "v6"):
            backend.decode_impl = decode[:2]
        backend.allocate_kv_cache(num_blocks, bs, 1, kvh, d, torch.bfloat16, DEV)
        if kind == "fp8":
            backend.kv_cache.copy_(quantize_with_scale(torch.randn(backend.kv_cache.shape, device=DEV), 1.0).view(torch.uint8))
        else:
            backend.kv_cache.normal_()
        for batch, ctx in ((1, 8192), (32, 2048), (256, 2048)):
            if decode == "cuda-cores":
                backend.decode_impl = "v4" if backend.decode_splits(batch) == 1 else "v2"
            us = statistics.median(decode_layer_us(backend, batch, ctx, num_blocks, max_model_len, 30, DEV))
            impl, splits = backend.decode_kernel(batch)
            times[(kind, decode, batch)] = us
            rows.append(f"| {kind} | {batch} x {ctx} | {impl}, {splits} splits ({decode}) | {us:.1f} |")
        del backend
    lines = ["| cache | case | kernel | median µs |", "| --- | --- | --- | ---: |", *rows]
    print("\n" + "\n".join(lines))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8-kv-timings.md"), "w") as handle:
            handle.write("\n".join(lines) + "\n")
    for batch in (1, 32, 256):
        bf16 = times[("auto", "auto", batch)]
        print(f"fp8 decode at {batch}: CUDA cores {times[('fp8', 'cuda-cores', batch)] / bf16:.2f}x bf16's time, "
              f"v5 {times[('fp8', 'v5', batch)] / bf16:.2f}x, v6 {times[('fp8', 'v6', batch)] / bf16:.2f}x, "
              f"auto {times[('fp8', 'auto', batch)] / bf16:.2f}x")
    assert times[("fp8", "auto", 256)] <= times[("auto", "auto", 256)], "auto over FP8 slower than bf16 at 256 x 2048"
