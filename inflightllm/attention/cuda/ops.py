"""Launch wrappers for the CUDA kernels in kernels.cu (compiled by CuPy RawModule / NVRTC).

CuPy is imported lazily, inside functions, so importing this module needs neither CuPy nor
a GPU. Every launch goes on torch's current stream (captured by torch CUDA graphs), takes
only host ints and device pointers, does no host synchronisation and allocates nothing.
Kernel arguments are passed as NumPy scalars of the exact C type.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
from pathlib import Path

import numpy as np
import torch

KERNEL_SOURCE = Path(__file__).with_name("kernels.cu")
COMPILE_OPTIONS = ("-std=c++17",)

CTYPE = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
DECODE_MAXG = (
    1,
    2,
    4,
    8,
)  # query heads per decode block (a GQA group is split into chunks of these)
HEAD_DIMS = (64, 128)
DECODE_KERNELS = {"v1": "paged_decode", "v2": "paged_decode_v2", "v4": "paged_decode_v4"}  # docs/CUDA-KERNELS.md
DECODE_REDUCE_KERNELS = {"v1": "decode_reduce_v1", "v2": "decode_reduce", "v4": "decode_reduce", "v5": "decode_reduce",
                         "v6": "decode_reduce"}
# paged_decode_v4: tiles in its shared-memory ring (loads in flight: STAGES - 1 tiles ahead of
# the one scored). INFLIGHTLLM_DECODE_STAGES overrides it (benchmarks): 2, 3 or 4.
DECODE_STAGES = 3
MAX_SPLITS = 1024  # RED_MAXZ in kernels.cu
# paged_decode_v2: the fewest tokens a split of a decode's context takes (a multiple of 32).
# INFLIGHTLLM_DECODE_MIN_SPLIT overrides it (benchmarks). See docs/CUDA-KERNELS.md.
DECODE_MIN_SPLIT_TOKENS = 32
DECODE_THREADS = 128
PREFILL_MMA_M = 64
# cascade_prefix_mma: resident blocks of 128 threads a SM (~160 registers x 128 threads: 3 fit
# a SM's 64k registers; an estimate from the kernel's arrays, not a measured occupancy; blocks
# of 64 threads: twice as many) and most splits.
CASCADE_PREFIX_BLOCKS_PER_SM = 3
CASCADE_PREFIX_MAX_SPLITS = 4
PREFILL_FMA_M = 16
_RESHAPE_VT = {16: "uint4", 4: "unsigned int", 2: "unsigned short"}
# FP8 KV cache (kv_cache_dtype "fp8"): the cache's element type in kernels.cu (e4m3 bytes), the
# decode kernels that read it (v1 does not) and the elements reshape_and_cache_fp8 takes a thread.
FP8_CTYPE = "fp8e4m3"
FP8_DECODE_KERNELS = ("v2", "v4", "v5", "v6")
# paged_decode_v5 (an FP8 cache, 16-bit queries, tensor cores): query heads a block (larger GQA
# groups take several blocks) and resident blocks a SM (its __launch_bounds__ minimum).
DECODE_V5_HEADS = 8
DECODE_V5_BLOCKS_PER_SM = 3
# paged_decode_v5's kv heads a block (HW: 1, 2 or 4; its 4 warps split the keys of each):
# with 4, a block's loads are the 4 heads' rows of the same tokens, 512 contiguous bytes of
# each token's row. INFLIGHTLLM_DECODE_V5_KV_HEADS overrides it (benchmarks).
DECODE_V5_KV_HEADS = 4
# paged_decode_v5's splits (backend.decode_splits, wave_splits): each split costs this share of
# a block more, and a split takes at least this many tokens (shorter contexts split less, in the
# kernel). Measured on an H100 (perf/bench_decode_attention.py, 2026-12-06): 1,024 decodes of 192
# tokens 267 -> 206 µs a layer unsplit instead of 2 splits, 512 of 1,152 507 -> 480; 256 of
# 2,048 keep 3 splits (421 µs; 1 split: 495). INFLIGHTLLM_DECODE_V5_SPLIT_COST and
# INFLIGHTLLM_DECODE_MIN_SPLIT override them (benchmarks).
DECODE_V5_SPLIT_COST = 0.10
DECODE_V5_MIN_SPLIT_TOKENS = 256
DECODE_V5_KV_HEAD_CHOICES = (1, 2, 4)
# paged_decode_v6 (kernels.cu: V6_WARPS, V6_STAGES): threads a block (a warp a kv head, every
# kv head of the model in one block: at most 8), pages of the ring, the most dynamic shared
# memory a block may take (Hopper: 227 KiB) and the resident blocks its registers allow.
DECODE_V6_THREADS = 256
DECODE_V6_MAX_KV_HEADS = 8
DECODE_V6_STAGES = 3
DECODE_V6_MAX_SMEM = 227 * 1024
DECODE_V6_MAX_BLOCKS_PER_SM = 2
# "auto" takes v6 from this many decodes (fewer: v5's blocks of one kv head are more blocks in
# flight). Measured on an H100 (perf/bench_decode_attention.py, 2026-12-06, µs a layer, v5 ->
# v6): 1,024 x 192 205 -> 160, 512 x 1,152 481 -> 410, 256 x 2,048 427 -> 363 (Nsight Compute:
# DRAM 91 % busy), 256 x 3,072 615 -> 528, 32 x 2,048 73 -> 66; 1 x 8,192 18 -> 29.
DECODE_V6_MIN_DECODES = 8


def _ring_stages(env: str, default: int, what: str) -> int:
    """A decode kernel's ring size: `default`, or the environment variable `env` (benchmarks):
    2, 3 or 4 (`what` names them in the refusal)."""
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    if text not in ("2", "3", "4"):
        raise ValueError(f"{env}={text!r}: 2, 3 or 4 ({what})")
    return int(text)


@functools.cache
def decode_v6_stages() -> int:
    """Pages in paged_decode_v6's ring (kernels.cu V6_STAGES): DECODE_V6_STAGES, or
    INFLIGHTLLM_DECODE_V6_STAGES (benchmarks): 2, 3 or 4."""
    return _ring_stages("INFLIGHTLLM_DECODE_V6_STAGES", DECODE_V6_STAGES, "pages in paged_decode_v6's ring")


def decode_v6_smem(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """paged_decode_v6's dynamic shared memory: its ring's pages (decode_v6_stages) of K and of
    V (FP8)."""
    return decode_v6_stages() * 2 * block_size * num_kv_heads * head_dim


def decode_v6_fits(num_kv_heads: int, block_size: int, head_dim: int) -> bool:
    """Whether paged_decode_v6 can serve a cache: every kv head in one block (at most
    DECODE_V6_MAX_KV_HEADS) and its ring within a block's shared memory (DECODE_V6_MAX_SMEM)."""
    return (num_kv_heads <= DECODE_V6_MAX_KV_HEADS
            and decode_v6_smem(block_size, num_kv_heads, head_dim) <= DECODE_V6_MAX_SMEM)


def decode_v6_blocks_per_sm(smem: int, sm_smem: int = 228 * 1024) -> int:
    """paged_decode_v6's resident blocks a SM: as many as its ring lets a SM's shared memory hold
    (1 KiB a block reserved), at most DECODE_V6_MAX_BLOCKS_PER_SM (its register budget)."""
    return max(1, min(DECODE_V6_MAX_BLOCKS_PER_SM, sm_smem // (smem + 1024)))


def v5_kv_heads(num_kv_heads: int, wanted: int = DECODE_V5_KV_HEADS) -> int:
    """paged_decode_v5's kv heads a block for a model of `num_kv_heads`: `wanted`, or the
    largest choice that is not more than the model has (3 kv heads: blocks of 2, the last
    with 2 spare warps)."""
    return max(h for h in DECODE_V5_KV_HEAD_CHOICES if h <= max(1, min(wanted, num_kv_heads)))
_FP8_RESHAPE_N = (8, 1)


@functools.cache
def decode_stages() -> int:
    return _ring_stages("INFLIGHTLLM_DECODE_STAGES", DECODE_STAGES, "tiles in paged_decode_v4's ring")


def decode_kernel_name(variant: str, ctype: str, head_dim: int, maxg: int, cache_ctype: str | None = None,
                       kv_heads: int = 1) -> str:
    """The kernel's name expression; `cache_ctype` (FP8_CTYPE) for one that reads an FP8
    cache (its last template argument, which defaults to `ctype`); `kv_heads`: v5's a block."""
    cache = f",{cache_ctype}" if cache_ctype and cache_ctype != ctype else ""
    if cache and variant not in FP8_DECODE_KERNELS:
        raise ValueError(f"decode kernel {variant!r} does not read an FP8 cache (those that do: {FP8_DECODE_KERNELS})")
    if variant == "v6":
        if not cache or ctype == "float":
            raise ValueError("decode kernel 'v6' reads only an FP8 cache, with fp16 / bf16 queries")
        return f"paged_decode_v6<{ctype},{head_dim}{cache}>"  # 8 query heads a warp, whatever maxg
    if variant == "v5":
        if not cache or ctype == "float":
            raise ValueError("decode kernel 'v5' reads only an FP8 cache, with fp16 / bf16 queries")
        if kv_heads not in DECODE_V5_KV_HEAD_CHOICES:
            raise ValueError(f"decode kernel 'v5': {kv_heads} kv heads a block (allowed: {DECODE_V5_KV_HEAD_CHOICES})")
        return f"paged_decode_v5<{ctype},{head_dim},{kv_heads}{cache}>"  # DECODE_V5_HEADS a warp, whatever maxg
    if variant == "v4":
        return f"paged_decode_v4<{ctype},{head_dim},{maxg},{decode_stages()}{cache}>"
    return f"{DECODE_KERNELS[variant]}<{ctype},{head_dim},{maxg}{cache}>"


def decode_dynamic_smem(variant: str, maxg: int, slice_bytes: int = 16) -> int:
    """paged_decode_v4's dynamic shared memory: its ring of tiles (every thread's 2U K/V slices
    per tile, U = decode_u in kernels.cu, of `slice_bytes` each: 16, or 16 / the query's element
    size for an FP8 cache), or the warps' merge buffers (s_red and s_ml) that overlay it
    afterwards, whichever is larger. The other kernels take none."""
    if variant != "v4":
        return 0
    u = 2 if maxg >= 8 else 4
    ring = decode_stages() * 2 * u * DECODE_THREADS * slice_bytes
    merge = (DECODE_THREADS // 32) * maxg * (max(HEAD_DIMS) + 2) * 4
    return max(ring, merge)


@functools.cache
def _source() -> str:
    from inflightllm.gpu.pdl import with_pdl

    return with_pdl(KERNEL_SOURCE.read_text(encoding="utf-8"))


def _raw_module(names: tuple[str, ...], options: tuple[str, ...] = ()):
    import cupy

    return cupy.RawModule(code=_source(), options=(*COMPILE_OPTIONS, *options), name_expressions=names)


class _Functions:
    """One compiled module and its kernels, fetched once, loaded on one GPU: a CuPy module
    is loaded on the device current at its first use, so each GPU of the process has its own
    (two engines on two GPUs in one process)."""

    def __init__(self, names: tuple[str, ...], device: int, options: tuple[str, ...] = ()):
        self.module = _raw_module(names, options)
        self.device = device
        self._cache: dict[str, object] = {}
        self._smem: dict[str, int] = {}

    def __getitem__(self, name: str):
        return self.get(name)

    def get(self, name: str, dynamic_smem: int = 0):
        """The kernel `name`; one that launches with dynamic shared memory gets the attribute
        that allows `dynamic_smem` bytes of it (needed above 48 KiB in all), raised when a later
        launch needs more (paged_decode_v6's ring depends on the cache's block size)."""
        fn = self._cache.get(name)
        if fn is None or dynamic_smem > self._smem.get(name, 0):
            import cupy

            with cupy.cuda.Device(self.device):
                if fn is None:
                    fn = self.module.get_function(name)
                if dynamic_smem:  # static + dynamic above 48 KiB needs the opt-in
                    fn.max_dynamic_shared_size_bytes = dynamic_smem
                    self._smem[name] = dynamic_smem
            self._cache[name] = fn
        return fn


def _release_modules() -> None:
    """Unload the compiled modules before interpreter teardown (CuPy's driver bindings may be
    gone by the time the cached modules would be collected)."""
    common_module.cache_clear()
    dtype_module.cache_clear()
    fp8_module.cache_clear()


atexit.register(_release_modules)


@functools.cache
def common_module(device: int = 0) -> _Functions:
    names = tuple(f"reshape_and_cache<{vt}>" for vt in _RESHAPE_VT.values()) + ("gather_kv",)
    return _Functions(names, device)


@functools.cache
def dtype_module(dtype: torch.dtype, head_dim: int, device: int = 0) -> _Functions:
    """Decode, reduce and prefill kernels for one (dtype, head_dim); compiled on first use."""
    if dtype not in CTYPE:
        raise ValueError(f"unsupported dtype {dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {head_dim} (supported: {HEAD_DIMS})")
    t = CTYPE[dtype]
    names = [decode_kernel_name(variant, t, head_dim, g) for variant in DECODE_KERNELS for g in DECODE_MAXG]
    names += [f"{k}<{t},{head_dim}>" for k in DECODE_REDUCE_KERNELS.values()]
    names.append(f"prefill_fma<{t},{head_dim}>")
    names.append(f"cascade_merge<{t},{head_dim}>")
    if dtype != torch.float32:
        names.append(f"prefill_mma<{t},{head_dim}>")
        names.append(f"cascade_prefix_mma<{t},{head_dim}>")
    return _Functions(tuple(names), device)


@functools.cache
def fp8_module(dtype: torch.dtype, head_dim: int, device: int = 0) -> _Functions:
    """The kernels of an FP8 KV cache for queries of `dtype`: its cache write, its gather
    (dequantizing) and the decode kernels that read it; compiled on first use, apart from
    dtype_module so that an unquantized cache compiles nothing more."""
    if dtype not in CTYPE:
        raise ValueError(f"unsupported dtype {dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {head_dim} (supported: {HEAD_DIMS})")
    t = CTYPE[dtype]
    names = [
        decode_kernel_name(variant, t, head_dim, g, FP8_CTYPE) for variant in ("v2", "v4") for g in DECODE_MAXG
    ]
    if dtype != torch.float32:
        names += [decode_kernel_name("v5", t, head_dim, DECODE_V5_HEADS, FP8_CTYPE, hw) for hw in DECODE_V5_KV_HEAD_CHOICES]
        names.append(decode_kernel_name("v6", t, head_dim, DECODE_V5_HEADS, FP8_CTYPE))
    names += [f"reshape_and_cache_fp8<{t},{n}>" for n in _FP8_RESHAPE_N]
    names.append(f"gather_kv_fp8<{t}>")
    return _Functions(tuple(names), device, (f"-DV6_STAGES={decode_v6_stages()}",))


def fp8_slice_bytes(dtype: torch.dtype) -> int:
    """Bytes of a decode thread's K or V slice in an FP8 cache: one e4m3 byte for each of the
    16 / element-size query elements it covers (a 16-bit cache's slice is 16 bytes)."""
    return 16 // torch.empty(0, dtype=dtype).element_size()


class _StreamRef:
    """What CuPy's launch reads from a stream object: its handle."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def current_stream() -> _StreamRef:
    return _StreamRef(torch.cuda.current_stream().cuda_stream)


_STREAM_KWARG = [True]  # CuPy's kernel call takes stream=<object with .ptr>; else a stream context


def _launch(fn, grid, block, args, stream: _StreamRef, pdl_device: int | None = None, shared_mem: int = 0) -> None:
    """Launch on `stream`; with `pdl_device` (the decode kernels, which call pdl_trigger and
    pdl_wait), by programmatic dependent launch where that GPU has it (inflightllm/gpu/pdl.py)."""
    grid = tuple(int(x) for x in grid)
    assert min(grid) > 0, grid  # CuPy would round a zero grid up to one block
    if pdl_device is not None:
        from inflightllm.gpu import pdl

        pdl.launch_on(fn, grid, (int(block),), args, shared_mem, stream.ptr, pdl_device)
        return
    assert shared_mem == 0
    if _STREAM_KWARG[0]:
        try:
            fn(grid, (int(block),), args, stream=stream)
            return
        except (TypeError, AttributeError):
            _STREAM_KWARG[0] = False
    import cupy

    from inflightllm.gpu import pdl

    with pdl.external_stream(stream.ptr, cupy.cuda.runtime.getDevice()):  # on the current device, as before
        fn(grid, (int(block),), args)


def _p(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _i32(x: int) -> np.int32:
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


def decode_group_split(group: int, variant: str | None = None) -> tuple[int, int]:
    """(MAXG, blocks per kv head) for a GQA group of `group` query heads (variant "v5": its
    DECODE_V5_HEADS a block)."""
    if variant in ("v5", "v6"):
        return DECODE_V5_HEADS, -(-group // DECODE_V5_HEADS)
    for maxg in DECODE_MAXG:
        if group <= maxg:
            return maxg, 1
    maxg = DECODE_MAXG[-1]
    return maxg, -(-group // maxg)


def aligned16(t: torch.Tensor) -> bool:
    """Last dim contiguous, base and the other strides on 16 bytes (for 16-byte vector loads)."""
    esz = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all((s * esz) % 16 == 0 for s in t.stride()[:-1])
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, stream) -> None:
    """key/value [num_tokens, kvh, D] (any strides, last dim contiguous) -> cache slots."""
    num_tokens, kvh, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    esz = key.element_size()
    vec = 16 if (aligned16(key) and aligned16(value)) else esz
    if (head_dim * esz) % vec:
        vec = esz
    ratio = vec // esz  # elements per vector
    fn = common_module(key.device.index)[f"reshape_and_cache<{_RESHAPE_VT[vec]}>"]
    args = (
        _p(key),
        _p(value),
        _p(key_cache),
        _p(value_cache),
        _p(slot_mapping),
        _i64(key.stride(0) // ratio),
        _i64(key.stride(1) // ratio),
        _i64(value.stride(0) // ratio),
        _i64(value.stride(1) // ratio),
        _i32(kvh),
        _i32(head_dim // ratio),
    )
    _launch(fn, (num_tokens,), 128, args, stream)


def reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, stream) -> None:
    """key/value [num_tokens, kvh, D] (any strides, last dim contiguous) -> e4m3 bytes of
    key / k_scale and value / v_scale in the (uint8) cache slots."""
    num_tokens, kvh, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    n = 8 if (aligned16(key) and aligned16(value) and head_dim % 8 == 0) else 1
    fn = fp8_module(key.dtype, head_dim, key.device.index)[f"reshape_and_cache_fp8<{CTYPE[key.dtype]},{n}>"]
    args = (
        _p(key),
        _p(value),
        _p(key_cache),
        _p(value_cache),
        _p(slot_mapping),
        _i64(key.stride(0)),
        _i64(key.stride(1)),
        _i64(value.stride(0)),
        _i64(value.stride(1)),
        _i32(kvh),
        _i32(head_dim),
        np.float32(k_scale),
        np.float32(v_scale),
    )
    _launch(fn, (num_tokens,), 128, args, stream)


def decode_grid_x(num_kv_heads: int, per_kv: int, kv_heads: int = 1) -> int:
    """The decode kernels' blocks a sequence and split (grid x): `per_kv` blocks for each group
    of `kv_heads` kv heads (paged_decode_v5's kv heads a block; 1 for every other kernel)."""
    return -(-num_kv_heads // kv_heads) * per_kv


def decode_blocks_per_sm(maxg: int, variant: str | None = None) -> int:
    """Resident decode blocks per SM (the kernels' __launch_bounds__ minimum)."""
    if variant == "v5":
        return DECODE_V5_BLOCKS_PER_SM
    return 3 if maxg >= 8 else 4


def _decode_function(query, head_dim, variant, maxg, scale, kv_scales, kv_heads=1, v6_smem=0):
    """The flash-decoding kernel of `variant` for `maxg` query heads a block, with its dynamic
    shared memory, the query scale in log2 units and the output's value scale: the kernel
    reading the query's dtype, or, with `kv_scales` (an FP8 cache), the FP8 one, k_scale
    folded into the query scale and v_scale into the output (v6: its ring's `v6_smem` bytes)."""
    scale_log2 = scale * np.log2(np.e)
    if variant == "v6":
        name = decode_kernel_name(variant, CTYPE[query.dtype], head_dim, maxg, FP8_CTYPE)
        fn = fp8_module(query.dtype, head_dim, query.device.index).get(name, v6_smem)
        return fn, v6_smem, scale_log2 * kv_scales[0], kv_scales[1]
    if kv_scales is None:
        smem = decode_dynamic_smem(variant, maxg)
        fn = dtype_module(query.dtype, head_dim, query.device.index).get(
            decode_kernel_name(variant, CTYPE[query.dtype], head_dim, maxg), smem)
        return fn, smem, scale_log2, 1.0
    smem = decode_dynamic_smem(variant, maxg, fp8_slice_bytes(query.dtype))
    name = decode_kernel_name(variant, CTYPE[query.dtype], head_dim, maxg, FP8_CTYPE, kv_heads)
    fn = fp8_module(query.dtype, head_dim, query.device.index).get(name, smem)
    return fn, smem, scale_log2 * kv_scales[0], kv_scales[1]


def paged_decode(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    out,
    num_decodes,
    num_splits,
    num_heads,
    num_kv_heads,
    head_dim,
    bs_shift,
    window,
    scale,
    stream,
    variant="v2",
    min_split=DECODE_MIN_SPLIT_TOKENS,
    kv_scales=None,
    kv_heads=1,
    block_size=0,
) -> None:
    """Decode attention for tokens/sequences 0..num_decodes-1 into out[:num_decodes].
    kv_heads: v5's kv heads a block (v5_kv_heads); block_size: the cache's (v6's pages).

    num_splits (Z) must depend only on host ints fixed for a CUDA-graph bucket. With v2 a
    context of n tokens uses only ceil(n / per) of them, per = max(ceil(n / Z) rounded up to
    32, min_split) (kernels.cu, decode_split_tokens), and its decode_reduce merges only those.
    kv_scales: (k_scale, v_scale) of an FP8 (uint8) cache (v2, v4, v5, v6), else None: k_scale
    goes into the query's scale, v_scale into the kernel's output."""
    group = num_heads // num_kv_heads
    maxg, per_kv = decode_group_split(group, variant)
    mod = dtype_module(query.dtype, head_dim, query.device.index)
    assert 1 <= num_splits <= MAX_SPLITS
    v6_smem = decode_v6_smem(block_size, num_kv_heads, head_dim) if variant == "v6" else 0
    if variant == "v6" and not decode_v6_fits(num_kv_heads, block_size, head_dim):
        raise ValueError(f"decode kernel 'v6': {num_kv_heads} kv heads of {head_dim} in blocks of {block_size} tokens "
                         f"(at most {DECODE_V6_MAX_KV_HEADS} kv heads and {DECODE_V6_MAX_SMEM} bytes of ring)")
    fn, smem, scale_log2, v_scale = _decode_function(query, head_dim, variant, maxg, scale, kv_scales, kv_heads,
                                                     v6_smem)
    if num_splits > 1:
        part_out = torch.empty(
            (num_decodes, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device
        )
        part_ml = torch.empty(
            (2, num_decodes, num_heads, num_splits), dtype=torch.float32, device=out.device
        )
        pm, pl = part_ml[0], part_ml[1]
    else:
        part_out = pm = pl = out  # unused
    args = (
        _p(query),
        _i64(query.stride(0)),
        _i64(query.stride(1)),
        _p(key_cache),
        _p(value_cache),
        _p(block_tables),
        _i32(block_tables.stride(0)),
        _p(context_lens),
        _p(out),
        _p(part_out),
        _p(pm),
        _p(pl),
        _i32(num_heads),
        _i32(num_kv_heads),
        _i32(group),
        _i32(per_kv),
        _i32(bs_shift),
        _i32(window or 0),
        np.float32(scale_log2),
    )
    if variant != "v1":
        args += (_i32(min_split), np.float32(v_scale))
    device = query.device.index
    if variant == "v6":  # every kv head in one block: grid x is the head groups of 8
        _launch(fn, (per_kv, num_decodes, num_splits), DECODE_V6_THREADS, args, stream, device, smem)
    else:
        blocks_x = decode_grid_x(num_kv_heads, per_kv, kv_heads if variant == "v5" else 1)
        _launch(fn, (blocks_x, num_decodes, num_splits), DECODE_THREADS, args, stream, device, smem)
    if num_splits > 1:
        red = mod[f"{DECODE_REDUCE_KERNELS[variant]}<{CTYPE[query.dtype]},{head_dim}>"]
        args = (_p(part_out), _p(pm), _p(pl), _p(out), _i32(num_heads), _i32(num_splits))
        if variant != "v1":
            args += (_p(context_lens), _i32(window or 0), _i32(min_split))
        _launch(red, (num_heads, num_decodes), head_dim, args, stream, device)


def paged_decode_partials(query, key_cache, value_cache, block_tables, context_lens, num_decodes, num_splits,
                          num_heads, num_kv_heads, head_dim, bs_shift, scale, stream, variant="v2",
                          min_split=DECODE_MIN_SPLIT_TOKENS, kv_scales=None):
    """paged_decode's flash-decoding kernel (v2 / v4) without its reduce: the partials of every
    split, also when a context has one split. Returns (part_out [num_decodes, num_heads, Z, D]
    float32, unnormalised, v_scale applied; part_m [.., Z] running max in log2 units; part_l
    [.., Z] sum of weights). A split with no tokens (or an empty context) keeps (0, -inf, 0),
    which a merge weighs as nothing. Cascade decode (backend.CudaPagedAttention) merges a
    group's shared-prefix partials with each sequence's own (suffix) partials. No window."""
    assert variant in ("v2", "v4") and 1 <= num_splits <= MAX_SPLITS
    group = num_heads // num_kv_heads
    maxg, per_kv = decode_group_split(group)
    fn, smem, scale_log2, v_scale = _decode_function(query, head_dim, variant, maxg, scale, kv_scales)
    device = query.device
    part_out = torch.zeros((num_decodes, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    part_m = torch.full((num_decodes, num_heads, num_splits), float("-inf"), dtype=torch.float32, device=device)
    part_l = torch.zeros((num_decodes, num_heads, num_splits), dtype=torch.float32, device=device)
    args = (
        _p(query), _i64(query.stride(0)), _i64(query.stride(1)), _p(key_cache), _p(value_cache),
        _p(block_tables), _i32(block_tables.stride(0)), _p(context_lens),
        _p(part_out),  # `out`: never written in partials mode
        _p(part_out), _p(part_m), _p(part_l),
        _i32(num_heads), _i32(num_kv_heads), _i32(group), _i32(per_kv), _i32(bs_shift), _i32(0),
        np.float32(scale_log2), _i32(-int(min_split)), np.float32(v_scale),
    )
    _launch(fn, (decode_grid_x(num_kv_heads, per_kv), num_decodes, num_splits), DECODE_THREADS, args, stream,
            device.index, smem)
    return part_out, part_m, part_l


def cascade_prefix_threads(rows: int) -> int:
    """cascade_prefix_mma's block: 2 warps (32 query rows) when the rows fit, else 4 (64)."""
    return 64 if rows <= 32 else 128


def cascade_prefix_mma(packed, key_cache, value_cache, prefix_tables, prefix_lens, bs_shift, scale, stream,
                       splits: int = 1):
    """Cascade decode's shared-prefix pass on tensor cores (kernels.cu cascade_prefix_mma; a
    16-bit cache). packed [G, kvh, R, D] contiguous: the R = width x group query heads of each
    kv head of each group's sequences. Each group's prefix (prefix_tables [G, blocks] int32,
    prefix_lens [G] int32 tokens) is cut into `splits` runs of whole 64-key tiles, a block
    each. Returns (output [G, kvh, splits, R, D] float32, normalised; log-sum-exp [G, kvh,
    splits, R] float32 in log2 units of the scaled scores; an empty split: 0 and -inf)."""
    groups, kv_heads, rows, head_dim = packed.shape
    assert packed.is_contiguous() and prefix_tables.is_contiguous() and splits >= 1
    fn = dtype_module(packed.dtype, head_dim, packed.device.index)[
        f"cascade_prefix_mma<{CTYPE[packed.dtype]},{head_dim}>"]
    out = torch.empty((groups, kv_heads, splits, rows, head_dim), dtype=torch.float32, device=packed.device)
    lse = torch.empty((groups, kv_heads, splits, rows), dtype=torch.float32, device=packed.device)
    args = (_p(packed), _p(key_cache), _p(value_cache), _p(prefix_tables), _i32(prefix_tables.stride(0)),
            _p(prefix_lens), _p(out), _p(lse), _i32(rows), _i32(kv_heads), _i32(bs_shift),
            np.float32(scale * np.log2(np.e)), _i32(splits))
    threads = cascade_prefix_threads(rows)
    _launch(fn, (-(-rows // (threads // 32 * 16)), kv_heads, groups * splits), threads, args, stream)
    return out, lse


def wave_splits(blocks: int, slots: int, most: int, split_cost: float = 0.05) -> int:
    """Splits (1..most) of each of `blocks` decode blocks on a GPU with `slots` resident
    blocks: the count whose waves come closest to full, each split costing `split_cost` of a
    block more (its partials, the reduce). Host ints only (graph-safe). paged_decode_v5 with 4
    kv heads a block on 132 SMs (396 slots), 8 kv heads: 256 decodes 3 splits (4 waves of 1,536
    blocks, the last 88 % full, instead of 2 of 512, the last 29 %), 1 decode 64 (capped)."""

    def cost(splits: int) -> float:
        return math.ceil(blocks * splits / slots) / splits * (1 + split_cost * (splits - 1))

    return min(range(1, max(1, most) + 1), key=cost)


def cascade_prefix_splits(blocks: int, num_sms: int, threads: int = 128, most: int = CASCADE_PREFIX_MAX_SPLITS) -> int:
    """Splits of cascade_prefix_mma's prefixes for `blocks` = tiles x kv heads x groups
    blocks of `threads` without splits: the count (1..most) whose waves of resident blocks
    (CASCADE_PREFIX_BLOCKS_PER_SM a SM at 128 threads, twice that at 64) come closest to
    full, each split costing a little (its partials, merged after). Host ints only
    (graph-safe). 512 blocks of 128 threads on 132 SMs: 3 splits, 3.9 waves instead of 1.3."""
    return wave_splits(blocks, CASCADE_PREFIX_BLOCKS_PER_SM * (128 // threads) * num_sms, most)


def cascade_merge(prefix, prefix_layout, prefix_slot, none_slot, width, group, num_kv_heads, suffix, out, stream):
    """Cascade decode's merge (kernels.cu cascade_merge): out [nd, H, D] (contiguous) from
    each decode's prefix partials (prefix = (o, m, l or None when normalised), of its member
    slot, none for slot none_slot) and its own suffix partials (o [nd, H, Z, D], m, l).
    prefix_layout: "mma" (cascade_prefix_mma's [G, kvh, S, R]) or "decode"
    (paged_decode_partials' [G, kvh * R, S])."""
    p_o, p_m, p_l = prefix
    s_o, s_m, s_l = suffix
    nd, num_heads, s_splits, head_dim = s_o.shape
    rows = width * group
    if prefix_layout == "mma":
        p_splits = p_m.shape[2]
        row_stride, split_stride = 1, rows
    else:
        p_splits = p_m.shape[-1]
        row_stride, split_stride = p_splits, 1
    assert out.is_contiguous() and out.shape == (nd, num_heads, head_dim)
    for tensor in (p_o, p_m, s_o, s_m, s_l, prefix_slot) + ((p_l,) if p_l is not None else ()):
        assert tensor.is_contiguous()
    fn = dtype_module(out.dtype, head_dim, out.device.index)[f"cascade_merge<{CTYPE[out.dtype]},{head_dim}>"]
    args = (_p(p_o), _p(p_m), np.uint64(0) if p_l is None else _p(p_l), _i32(p_splits), _i32(row_stride),
            _i32(split_stride), _p(prefix_slot), _i64(none_slot), _i32(width), _i32(group), _i32(num_kv_heads),
            _p(s_o), _p(s_m), _p(s_l), _i32(s_splits), _p(out), _i32(num_heads))
    _launch(fn, (num_heads, nd), head_dim, args, stream)


def merge_partials(part_out, part_m, part_l, dtype):
    """[n, H, Z, D], [n, H, Z], [n, H, Z] partials (paged_decode_partials' convention) ->
    the attention output [n, H, D] in `dtype`, as decode_reduce merges them. In torch ops:
    the reference of cascade_merge (tests/test_cascade_plan.py checks it against softmax
    attention, tests/gpu/test_cascade_decode.py the kernel against it)."""
    m_max = part_m.amax(dim=-1, keepdim=True)
    m_use = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    weight = torch.where(part_l > 0, torch.exp2(part_m - m_use), torch.zeros_like(part_m))
    total = (weight * part_l).sum(dim=-1, keepdim=True)
    merged = (weight.unsqueeze(-1) * part_out).sum(dim=-2)
    return torch.where(total > 0, merged / total.clamp_min(1e-30), torch.zeros_like(merged)).to(dtype)


def prefill(
    kind,
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    query_start_loc,
    out,
    num_decodes,
    num_prefills,
    max_query_len,
    num_heads,
    num_kv_heads,
    head_dim,
    bs_shift,
    window,
    scale,
    stream,
) -> None:
    """Prefill / chunked-prefill attention of sequences num_decodes.. (kind 'mma' or 'fma')."""
    if num_prefills == 0 or max_query_len == 0:
        return
    mod = dtype_module(query.dtype, head_dim, query.device.index)
    fn = mod[f"prefill_{kind}<{CTYPE[query.dtype]},{head_dim}>"]
    tile = PREFILL_MMA_M if kind == "mma" else PREFILL_FMA_M
    args = (
        _p(query),
        _i64(query.stride(0)),
        _i64(query.stride(1)),
        _p(key_cache),
        _p(value_cache),
        _p(block_tables),
        _i32(block_tables.stride(0)),
        _p(context_lens),
        _p(query_start_loc),
        _p(out),
        _i32(num_decodes),
        _i32(num_heads),
        _i32(num_kv_heads),
        _i32(bs_shift),
        _i32(window or 0),
        np.float32(scale * np.log2(np.e)),
    )
    grid = (-(-max_query_len // tile), num_heads, num_prefills)
    _launch(fn, grid, 128, args, stream)


def gather_kv(
    key_cache,
    value_cache,
    key_out,
    value_out,
    block_tables,
    context_lens,
    cu_k,
    num_decodes,
    num_prefills,
    max_context_len,
    bs_shift,
    stream,
    kv_scales=None,
) -> None:
    """Rows 0..ctx-1 of each prefill sequence's K/V -> packed [cu_k[p] + row] (16-byte rows).
    kv_scales: (k_scale, v_scale) of an FP8 (uint8) cache, whose values are dequantized into
    key_out / value_out (their dtype) on the way."""
    if num_prefills == 0 or max_context_len == 0:
        return
    if kv_scales is None:  # rows copied in 16-byte pieces
        row_bytes = key_cache.shape[-2] * key_cache.shape[-1] * key_cache.element_size()
        assert row_bytes % 16 == 0
        fn = common_module(key_cache.device.index)["gather_kv"]
        pieces, scales = row_bytes // 16, ()
    else:  # an FP8 cache: 8-byte pieces, dequantized into key_out's dtype
        assert key_cache.dtype == torch.uint8 and key_out.dtype in CTYPE
        row_elems = key_cache.shape[-2] * key_cache.shape[-1]
        assert row_elems % 8 == 0
        fn = fp8_module(key_out.dtype, key_cache.shape[-1], key_cache.device.index)[
            f"gather_kv_fp8<{CTYPE[key_out.dtype]}>"]
        pieces, scales = row_elems // 8, (np.float32(kv_scales[0]), np.float32(kv_scales[1]))
    args = (
        _p(key_cache),
        _p(value_cache),
        _p(key_out),
        _p(value_out),
        _p(block_tables),
        _i32(block_tables.stride(0)),
        _p(context_lens),
        _p(cu_k),
        _i32(num_decodes),
        _i32(bs_shift),
        _i32(pieces),
        *scales,
    )
    _launch(fn, (-(-max_context_len // 32), num_prefills), 128, args, stream)
