"""CUDA paged attention (inflightllm.attention.cuda) against the exact torch reference.

The oracle is `TorchReferenceAttention` run on the GPU in float64 over the same cache
contents (the CUDA cache upcast) and the same new K/V. Inputs are random (never zeros),
outputs are poisoned with NaN first, and every output row of every sequence is checked by
its own relative error ||out - ref|| / ||ref||: < 1e-5 for fp32, < 2e-2 for bf16.

Run on a GPU machine:
    PYTHONUNBUFFERED=1 python3 -m pytest -m gpu tests/gpu -x -q
The last test prints a timing table (8B shape: 32 heads, 8 kv heads, d=128, bf16) and, when
$OUT is set, writes it to $OUT/timings.md. CuPy is imported by the backend lazily.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time

import pytest
import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.cuda import CudaAttentionMetadata, CudaPagedAttention, ops
from inflightllm.attention.torch_ref import TorchReferenceAttention
from perf.bench_decode_attention import forward_graph

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LOG: list[str] = []  # one line per checked case, printed at the end


def _report(line: str) -> None:
    LOG.append(line)


def ref_metadata(ref: TorchReferenceAttention, sequences):
    """The reference's metadata on the GPU. (Its build_metadata leaves the boolean masks of
    non-decode sequences on the CPU; they are moved here.)"""
    md = ref.build_metadata(sequences, DEV)
    md.backend_data["others"] = [
        (index, gather, mask if isinstance(mask, str) else mask.to(DEV))
        for index, gather, mask in md.backend_data["others"]
    ]
    return md


class Case:
    """A packed step: `specs` = [(query_len, context_len), ...], decodes (query_len 1) first.
    A CUDA backend and a float64 reference share the same (random) cache contents."""

    def __init__(
        self,
        specs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        window=None,
        seed=0,
        max_model_len=None,
        fused=True,
    ):
        torch.manual_seed(seed)
        self.dtype = dtype
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        needed = [math.ceil(ctx / block_size) for _, ctx in specs]
        num_blocks = sum(needed) + 8
        perm = torch.randperm(num_blocks).tolist()
        self.sequences = []
        start, used = 0, 0
        for (ql, ctx), nb in zip(specs, needed):
            junk = torch.randint(0, num_blocks, (3,)).tolist()  # arbitrary unused entries
            table = tuple(perm[used : used + nb] + junk)
            used += nb
            self.sequences.append(SequenceSlice(start, ql, ctx, table))
            start += ql
        self.num_tokens = start
        longest = max(ctx for _, ctx in specs)
        self.backend = CudaPagedAttention(
            num_heads,
            num_kv_heads,
            head_dim,
            window,
            max_model_len=max_model_len or max(longest, 1024),
        )
        self.backend.allocate_kv_cache(
            num_blocks, block_size, 1, num_kv_heads, head_dim, dtype, DEV
        )
        self.backend.kv_cache.copy_(torch.randn(self.backend.kv_cache.shape, device=DEV))
        self.ref = TorchReferenceAttention(num_heads, num_kv_heads, head_dim, window)
        self.ref.allocate_kv_cache(
            num_blocks, block_size, 1, num_kv_heads, head_dim, torch.float64, DEV
        )
        self.ref.key_cache[0].copy_(
            self.backend.key_cache[0].reshape(-1, num_kv_heads, head_dim).double()
        )
        self.ref.value_cache[0].copy_(
            self.backend.value_cache[0].reshape(-1, num_kv_heads, head_dim).double()
        )
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
        out = torch.full(
            (self.num_tokens, self.h, self.d), float("nan"), dtype=self.dtype, device=DEV
        )
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
            assert rel < TOL[self.dtype], (
                f"{label}: seq q={seq.query_len} ctx={seq.context_len} rel {rel:.3e}"
            )
        # the new K/V landed in their slots, bit for bit
        slots = self.metadata.slot_mapping
        kc = self.backend.key_cache[0].reshape(-1, self.kvh, self.d)
        vc = self.backend.value_cache[0].reshape(-1, self.kvh, self.d)
        assert torch.equal(kc[slots], self.k) and torch.equal(vc[slots], self.v), (
            f"{label}: cache write"
        )
        _report(f"{label}: max rel err {worst:.2e}")
        return worst


def check_v4(case: Case, v2: torch.Tensor, label: str, impl: str | None = None) -> None:
    """paged_decode_v4 (v2 with its loads pipelined through shared memory) within tolerance,
    and with v2's bits: the scoring is the same code, only where the K/V slices come from differs."""
    v2 = v2.clone()
    v4 = case.run(impl, decode="v4")
    case.check(v4, label + " decode v4")
    assert torch.equal(v4, v2), f"{label}: decode v4 differs from v2 in {(v4 != v2).sum().item()} elements"


MIXED = [
    (1, 1),
    (1, 17),
    (1, 300),
    (1, 1000),
    (1, 2500),  # decodes
    (100, 100),  # a whole prompt
    (1, 50),  # a one-token chunk
    (200, 1200),  # a chunk after earlier chunks
    (64, 64),
    (333, 900),  # a prompt after a prefix-cache hit
    (7, 7),
]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_batch(dtype, head_dim, block_size, group):
    kvh = 3 if group == 3 else 2  # group 3 with 3 kv heads: SmolLM2's 9/3 heads
    case = Case(MIXED, kvh * group, kvh, head_dim, block_size, dtype, seed=group * 7 + block_size)
    label = f"mixed {str(dtype)[6:]} d={head_dim} bs={block_size} gqa={group}"
    if dtype == torch.float32:
        case.check(case.run(decode="v1"), label + " decode v1")
        case.check(v2 := case.run(decode="v2"), label + " decode v2")
        check_v4(case, v2, label)
    else:
        case.check(case.run("mma", decode="v1"), label + " mma, decode v1")
        case.check(v2 := case.run("flash", decode="v2"), label + " flash, decode v2")
        check_v4(case, v2, label + " flash,", "flash")
        if case.backend._flash_error:
            _report(f"{label}: FLASH FELL BACK TO MMA: {case.backend._flash_error}")


def test_fp16():
    case = Case(MIXED, 8, 2, 128, 16, torch.float16, seed=3)
    case.check(case.run("mma", decode="v1"), "mixed fp16 d=128 gqa=4 mma, decode v1")
    case.check(v2 := case.run("flash", decode="v2"), "mixed fp16 d=128 gqa=4 flash, decode v2")
    check_v4(case, v2, "mixed fp16 d=128 gqa=4 flash,", "flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sliding_window(dtype):
    specs = [(1, 100), (1, 256), (1, 257), (1, 3000), (600, 600), (100, 2000), (1, 700), (300, 300)]
    case = Case(specs, 8, 2, 128, 16, dtype, window=256, seed=11)
    if dtype == torch.float32:
        case.check(case.run(decode="v1"), "window=256 fp32 decode v1")
        case.check(v2 := case.run(decode="v2"), "window=256 fp32 decode v2")
        check_v4(case, v2, "window=256 fp32")
    else:
        case.check(case.run("mma", decode="v1"), "window=256 bf16 mma, decode v1")
        case.check(v2 := case.run("flash", decode="v2"), "window=256 bf16 flash, decode v2")
        check_v4(case, v2, "window=256 bf16 flash,", "flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_context(dtype):
    specs = [(1, 32768), (1, 20001), (1, 5), (128, 32768), (1000, 1000)]
    case = Case(specs, 8, 2, 128, 32, dtype, seed=5, max_model_len=32768)
    if dtype == torch.float32:
        case.check(case.run(decode="v1"), "32k fp32 decode v1")
        case.check(v2 := case.run(decode="v2"), "32k fp32 decode v2")
        check_v4(case, v2, "32k fp32")
    else:
        case.check(case.run("mma", decode="v1"), "32k bf16 mma, decode v1")
        case.check(v2 := case.run("flash", decode="v2"), "32k bf16 flash, decode v2")
        check_v4(case, v2, "32k bf16 flash,", "flash")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_decodes_unsplit(dtype):
    """Enough decodes that the context is not split (direct write, no reduce kernel)."""
    gen = torch.Generator().manual_seed(9)
    specs = [(1, int(c)) for c in torch.randint(1, 1500, (300,), generator=gen)]
    case = Case(specs, 8, 2, 64, 16, dtype, seed=9)
    assert case.backend.decode_splits(300) == 1
    for decode in ("v1", "v2"):
        case.check(case.run(decode=decode), f"300 decodes unsplit {str(dtype)[6:]} decode {decode}")
    check_v4(case, case.run(decode="v2"), f"300 decodes unsplit {str(dtype)[6:]}")


@pytest.mark.parametrize("min_split", [64, 128, 512])
def test_decode_min_split_tokens(min_split):
    """paged_decode_v2 with other fewest-tokens-per-split values (INFLIGHTLLM_DECODE_MIN_SPLIT):
    contexts of one split (written directly), a few and many, around the split sizes."""
    specs = [(1, n) for n in (1, 31, 32, 33, 150, 511, 513, 1000, 4097, 9000)]
    case = Case(specs, 32, 8, 128, 16, torch.bfloat16, seed=21, max_model_len=16384)
    case.backend.decode_min_split = min_split
    case.check(v2 := case.run("flash", decode="v2"), f"min split {min_split} bf16 decode v2")
    check_v4(case, v2, f"min split {min_split} bf16 flash,", "flash")


def test_prefill_8b_shape():
    case = Case([(4096, 4096)], 32, 8, 128, 16, torch.bfloat16, seed=2, fused=False)
    a = case.run("mma")
    case.check(a, "8B 1x4096 prompt bf16 mma")
    b = case.run("flash")
    case.check(b, "8B 1x4096 prompt bf16 flash")


# Runs of whole prompts of one length from 512 tokens, multiples of 128 (cuDNN, dense) among
# chunks, prefix hits, short or unaligned prompts and decodes (flash varlen / decode kernels):
# backend.plan_prefill_segments.
DENSE = [(1, 40), (1, 3000), (640, 640), (640, 640), (640, 640), (200, 1200), (1024, 1024), (512, 512), (512, 512),
         (100, 100), (333, 900), (768, 768), (600, 600)]
DENSE_CALLS = [(3, 640), (1, 1024), (2, 512), (1, 768)]


def count_dense_calls(backend) -> list:
    calls = []
    dense = backend._dense

    def counting(q, k, v, prompts, length, out):
        calls.append((prompts, length))
        return dense(q, k, v, prompts, length, out)

    backend._dense = counting
    return calls


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "packed"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64)], ids=["gqa4-d128", "mha-d64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cudnn_dense_prefill_segments(dtype, heads, fused):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN dense prefill attention is taken on Hopper or later")
    h, kvh, d = heads
    case = Case(DENSE, h, kvh, d, 16, dtype, seed=5, fused=fused)
    label = f"cudnn dense {dtype} {h}/{kvh} d={d} {'fused' if fused else 'packed'}"
    calls = count_dense_calls(case.backend)
    case.check(dense := case.run("flash"), label)
    assert case.backend._cudnn_error is None, case.backend._cudnn_error
    assert calls == DENSE_CALLS
    dense = dense.clone()
    case.backend.prefill_cudnn_min_len = 0  # every prefill on flash varlen
    case.check(varlen := case.run("flash"), label + ", min len 0 (flash varlen only)")
    assert calls == DENSE_CALLS
    diff = float((dense.float() - varlen.float()).norm() / varlen.float().norm())
    _report(f"{label}: cuDNN vs flash varlen rel diff {diff:.2e}, strided query packed: {case.backend._cudnn_packed_q}")


@pytest.mark.parametrize("pad", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cudnn_padded_unaligned_whole_prompts(dtype, pad):
    # prefill_cudnn_pad: the unaligned whole prompt (600 tokens) goes to cuDNN alone, padded with
    # zero rows to the next multiple of `pad`; every output row against the float64 reference.
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN dense prefill attention is taken on Hopper or later")
    case = Case(DENSE, 32, 8, 128, 16, dtype, seed=6, fused=True)
    case.backend.prefill_cudnn_pad = pad
    calls = count_dense_calls(case.backend)
    label = f"cudnn padded {dtype} pad {pad}"
    case.check(padded := case.run("flash"), label)
    assert case.backend._cudnn_error is None, case.backend._cudnn_error
    assert calls == DENSE_CALLS + [(1, -(-600 // pad) * pad)]
    padded = padded.clone()
    case.backend.prefill_cudnn_pad = 0
    case.check(unpadded := case.run("flash"), label + ", pad 0")
    diff = float((padded.float() - unpadded.float()).norm() / unpadded.float().norm())
    _report(f"{label}: padded cuDNN vs flash varlen for the unaligned prompt, rel diff {diff:.2e}")


def test_padding_and_unaligned_inputs():
    """Slot -1 tokens are not written, a context_len 0 row yields zeros, and misaligned
    (non-16-byte) inputs take the scalar copy / .contiguous() paths."""
    torch.manual_seed(4)
    h, kvh, d, bs = 8, 2, 64, 16
    backend = CudaPagedAttention(h, kvh, d, max_model_len=2048)
    backend.allocate_kv_cache(64, bs, 1, kvh, d, torch.bfloat16, DEV)
    backend.kv_cache.copy_(torch.randn(backend.kv_cache.shape, device=DEV))
    ref = TorchReferenceAttention(h, kvh, d)
    ref.allocate_kv_cache(64, bs, 1, kvh, d, torch.float64, DEV)
    ref.key_cache[0].copy_(backend.key_cache[0].reshape(-1, kvh, d).double())
    ref.value_cache[0].copy_(backend.value_cache[0].reshape(-1, kvh, d).double())
    seqs = [SequenceSlice(0, 1, 40, (5, 9, 11)), SequenceSlice(1, 1, 300, tuple(range(20, 39)))]
    md = backend.build_metadata(seqs, DEV)
    # a graph bucket of 3: one padding decode (context 0, slot -1)
    pad = CudaAttentionMetadata(
        num_decodes=3,
        num_prefills=0,
        num_decode_tokens=3,
        max_query_len=0,
        max_context_len=2048,
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
    before = backend.kv_cache.clone()
    expected = ref.forward(
        0, q[:2].double(), k[:2].double(), v[:2].double(), ref_metadata(ref, seqs)
    )
    for decode in ("v1", "v2", "v4"):
        backend.decode_impl = decode
        out = torch.full((3, h, d), float("nan"), dtype=torch.bfloat16, device=DEV)
        backend.forward(0, q, k, v, pad, out=out)
        torch.cuda.synchronize()
        rel = float((out[:2].double() - expected).norm() / expected.norm())
        assert rel < 2e-2, rel
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        changed = (
            (backend.kv_cache != before).reshape(2, -1, kvh * d).any(-1).any(0).nonzero().flatten()
        )
        assert sorted(changed.tolist()) == sorted(md.slot_mapping.tolist())
        _report(f"padding + unaligned bf16, decode {decode}: rel err {rel:.2e}")


@pytest.mark.parametrize("maxg", ops.DECODE_MAXG)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_v4_keeps_the_blocks_per_sm(dtype, maxg):
    """paged_decode_v4's ring (dynamic shared memory) leaves as many resident blocks per SM as
    its launch bounds promise, which decode_splits counts on (ops.decode_blocks_per_sm)."""
    import ctypes

    from inflightllm.gpu import pdl

    smem = ops.decode_dynamic_smem("v4", maxg)
    for head_dim in ops.HEAD_DIMS:
        mod = ops.dtype_module(dtype, head_dim, torch.cuda.current_device())
        fn = mod.get(ops.decode_kernel_name("v4", ops.CTYPE[dtype], head_dim, maxg), smem)
        blocks = ctypes.c_int()
        status = pdl._driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), ctypes.c_void_p(fn.kernel.ptr), ctypes.c_int(ops.DECODE_THREADS),
            ctypes.c_size_t(smem))
        assert status == 0, status
        _report(f"decode v4 {str(dtype)[6:]} d={head_dim} maxg={maxg} stages={ops.decode_stages()}: "
                f"{smem} B dynamic shared memory, {blocks.value} blocks per SM")
        assert blocks.value >= ops.decode_blocks_per_sm(maxg)


def _random_tables(specs, block_size, num_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, start, used = [], 0, 0
    for ql, ctx in specs:
        nb = math.ceil(ctx / block_size)
        seqs.append(SequenceSlice(start, ql, ctx, tuple(perm[used : used + nb])))
        used += nb
        start += ql
    assert used <= num_blocks
    return seqs


@pytest.mark.parametrize("decode", ["v1", "v2", "v4"])
def test_cuda_graph_decode(decode):
    """Capture one decode step, then change contexts, block tables and inputs in the static
    buffers and replay: the result must match the reference on the new data."""
    h, kvh, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    max_model_len, nd = 4096, 8
    width = max_model_len // bs
    num_blocks = nd * width + 8
    backend = CudaPagedAttention(h, kvh, d, max_model_len=max_model_len, prefill_impl="mma")
    backend.decode_impl = decode
    backend.allocate_kv_cache(num_blocks, bs, 1, kvh, d, dtype, DEV)
    backend.kv_cache.copy_(torch.randn(backend.kv_cache.shape, device=DEV))

    def static_from(seqs):
        md = backend.build_metadata(seqs, DEV)
        table = torch.zeros((nd, width), dtype=torch.int32, device=DEV)
        table[:, : md.block_tables.shape[1]] = md.block_tables
        return md, table

    seqs_a = _random_tables([(1, c) for c in (5, 100, 17, 1, 600, 33, 2000, 64)], bs, num_blocks, 1)
    md_a, table_a = static_from(seqs_a)
    static = CudaAttentionMetadata(
        num_decodes=nd,
        num_prefills=0,
        num_decode_tokens=nd,
        max_query_len=0,
        max_context_len=max_model_len,
        slot_mapping=md_a.slot_mapping.clone(),
        positions=md_a.positions.clone(),
        block_tables=table_a,
        context_lens=md_a.context_lens.clone(),
        query_start_loc=md_a.query_start_loc.clone(),
    )
    graph, q, k, v, out = forward_graph(backend, static, nd, dtype, DEV, warmups=2)

    seqs_b = _random_tables(
        [(1, c) for c in (4096, 3000, 1, 2500, 700, 4000, 129, 1024)], bs, num_blocks, 2
    )
    md_b, table_b = static_from(seqs_b)
    static.block_tables.copy_(table_b)
    static.context_lens.copy_(md_b.context_lens)
    static.slot_mapping.copy_(md_b.slot_mapping)
    q.copy_(torch.randn(nd, h, d, device=DEV))
    k.copy_(torch.randn(nd, kvh, d, device=DEV))
    v.copy_(torch.randn(nd, kvh, d, device=DEV))
    ref = TorchReferenceAttention(h, kvh, d)
    ref.allocate_kv_cache(num_blocks, bs, 1, kvh, d, torch.float64, DEV)
    ref.key_cache[0].copy_(backend.key_cache[0].reshape(-1, kvh, d).double())
    ref.value_cache[0].copy_(backend.value_cache[0].reshape(-1, kvh, d).double())
    out.fill_(float("nan"))
    graph.replay()
    expected = ref.forward(0, q.double(), k.double(), v.double(), ref_metadata(ref, seqs_b))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    for i in range(nd):
        rel = float((out[i].double() - expected[i]).norm() / expected[i].norm())
        assert rel < 2e-2, (i, rel)
    _report(f"cuda graph decode {decode} replay on new contexts: ok")


# ------------------------------------------------------------------------------ timings
def _bench_us(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def test_timings(capsys):
    """Decode (graph replay of one forward: cache write + attention) and prefill (eager),
    Llama-3-8B attention shape: 32 heads, 8 kv heads, d=128, bf16, block 16."""
    from perf.bench_decode_attention import decode_layer_us

    h, kvh, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    max_model_len = 32768
    num_blocks = 256 * 2048 // bs + 64
    backend = CudaPagedAttention(h, kvh, d, max_model_len=max_model_len)
    backend.allocate_kv_cache(num_blocks, bs, 1, kvh, d, dtype, DEV)
    backend.kv_cache.normal_()
    rows = []
    kv_row_bytes = 2 * kvh * d * 2  # K and V of one token, bf16

    default_min_split = backend.decode_min_split
    cases = list(itertools.product(
        [(1, 32768), (32, 2048), (256, 2048), (256, 192), (1024, 192), (64, 8192), (1, 2048), (1, 160)],
        ("v1", "v2", "v4"),
    ))
    # v2's fewest tokens per split, swept where it matters (short contexts, few sequences)
    cases += [((batch, ctx), f"v2 min split {m}") for batch, ctx in [(1, 160), (1, 600), (8, 300), (32, 192)]
              for m in (32, 64, 128, 256, 512)]
    for (batch, ctx), decode in cases:
        backend.decode_impl = decode.split()[0]
        backend.decode_min_split = int(decode.split()[-1]) if "min split" in decode else default_min_split
        # (the tables _random_tables([(1, ctx)] * batch, bs, num_blocks, batch) would give)
        us = statistics.median(decode_layer_us(backend, batch, ctx, num_blocks, max_model_len, 50, DEV, dtype))
        gbs = batch * ctx * kv_row_bytes / us / 1e3
        rows.append(
            (
                f"decode {decode}",
                f"{batch} x {ctx}",
                f"splits {backend.decode_splits(batch)}",
                us,
                f"{gbs:.0f} GB/s",
            )
        )

    prefill_cases = [
        ("8 x 4096 prompts", [(4096, 4096)] * 8, 10),
        ("1 x 32768 prompt", [(32768, 32768)], 3),
        ("4 x 512-token chunks at 8k", [(512, 8192)] * 4, 10),
    ]
    best = {}
    for name, specs, iters in prefill_cases:
        seqs = _random_tables(specs, bs, num_blocks, 7)
        md = backend.build_metadata(seqs, DEV)
        t = sum(ql for ql, _ in specs)
        q = torch.randn(t, h, d, device=DEV).to(dtype)
        k = torch.randn(t, kvh, d, device=DEV).to(dtype)
        v = torch.randn(t, kvh, d, device=DEV).to(dtype)
        flops = sum(4 * h * d * sum(ctx - ql + i + 1 for i in range(ql)) for ql, ctx in specs)
        outs = {}
        for impl in ("mma", "flash"):
            backend.prefill_impl = impl
            out = torch.empty(t, h, d, dtype=dtype, device=DEV)
            us = _bench_us(
                lambda q=q, k=k, v=v, md=md, out=out: backend.forward(0, q, k, v, md, out=out),
                iters,
                warmup=1,
            )
            outs[impl] = out
            rows.append((f"prefill {impl}", name, "", us, f"{flops / us / 1e6:.0f} TFLOP/s"))
            best.setdefault(name, []).append((us, impl))
        diff = float(
            (outs["mma"].float() - outs["flash"].float()).norm() / outs["flash"].float().norm()
        )
        _report(f"prefill {name}: mma vs flash rel diff {diff:.2e}")
        assert diff < 2e-2

    lines = [
        f"# CUDA attention timings, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{torch.cuda.get_device_name()}, 32 heads / 8 kv heads / d=128 / bf16 / block 16",
        "",
        "| kind | case | note | median us | rate |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    lines += [f"| {a} | {b} | {c} | {us:.1f} | {r} |" for a, b, c, us, r in rows]
    lines.append("")
    for name, results in best.items():
        lines.append(f"faster prefill for {name}: {min(results)[1]}")
    if backend._flash_error:
        lines.append(f"flash error: {backend._flash_error}")
    lines.append("")
    lines += LOG
    lines.append(f"flash op schema: {torch.ops.aten._flash_attention_forward.default._schema}")
    text = "\n".join(lines)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "timings.md"), "w") as f:
            f.write(text + "\n")
    with capsys.disabled():
        print("\n" + text)
