"""Launchers for the fused layer kernels in `layers.cu` (CuPy RawModule, NVRTC).

CuPy is imported lazily: this module imports on a machine without it. Kernels launch on
CuPy's current stream; the runner makes that torch's current stream for the whole model
step (`torch_stream`), so torch and CuPy work share one stream and a torch CUDA graph
captures both. Tensors are passed as raw device pointers (no copies, no host syncs).
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import numpy as np
import torch

from inflightllm.env_settings import env_number, env_switch

CUDA_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
KERNELS = (
    "rms_norm", "add_rms_norm", "add_rms_norm_vec", "rotary", "rotary_vec", "silu_and_mul", "silu_and_mul_vec",
    "quant_rows_fp8", "add_rms_norm_fp8", "silu_and_mul_fp8",
)
# 16-byte variants of the FP8 quantizing kernels: 2-byte types only (8 values a chunk).
FP8_VEC_KERNELS = ("quant_rows_fp8_vec", "add_rms_norm_fp8_vec", "silu_and_mul_fp8_vec")
# Version 2 of the FP8 quantizing kernels (layers.cu: every load issued before any is used),
# for rows of at most FP8_V2_NPT chunks a thread; INFLIGHTLLM_FP8_QUANT_V2=0 keeps the _vec ones.
FP8_V2_KERNELS = ("quant_rows_fp8_v2", "add_rms_norm_fp8_v2", "silu_and_mul_fp8_v2")
FP8_V2_NPT = 4
_FP8_NPT = 8  # FP8_NPT in layers.cu: 16-byte chunks a thread holds
_ADD_NORM_NPT = 4  # ADD_NORM_NPT in layers.cu: 16-byte chunks a thread of add_rms_norm_vec holds


@functools.cache
def vector_kernels() -> bool:
    """Whether add_rms_norm and rotary take their 16-byte kernels where the rows allow them
    (INFLIGHTLLM_VECTOR_KERNELS=0 keeps the scalar ones, for comparisons)."""
    return os.environ.get("INFLIGHTLLM_VECTOR_KERNELS", "1").strip() != "0"


SOURCE = Path(__file__).with_name("layers.cu")


@functools.cache
def _source() -> str:
    from inflightllm.gpu.pdl import with_pdl

    return with_pdl(SOURCE.read_text(encoding="utf-8"))


@functools.cache
def _module(device: int):
    """The compiled kernels, loaded on GPU `device`: a CuPy module is loaded on the device
    current when it is first used, so each GPU of the process gets its own (two engines on
    two GPUs in one process, e.g. data-parallel engines driven from one program)."""
    import cupy

    names = [f"{kernel}<{ctype}>" for kernel in KERNELS for ctype in CUDA_TYPES.values()]
    names += [f"{kernel}<{ctype}>" for kernel in FP8_VEC_KERNELS for ctype in ("__half", "__nv_bfloat16")]
    names += [f"{kernel}<{ctype},{FP8_V2_NPT}>" for kernel in FP8_V2_KERNELS for ctype in ("__half", "__nv_bfloat16")]
    names += [f"silu_and_mul_fp8_tma<{ctype}>" for ctype in ("__half", "__nv_bfloat16")]
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=_source(), options=("-std=c++17",), name_expressions=names)
        module.compile()
    return module


@functools.cache
def _kernel(name: str, dtype: torch.dtype, device: int | None = None, more_args: str = ""):
    """The kernel `name`<dtype> of the module on `device`; `more_args` appends template arguments (",4")."""
    if device is None:
        device = torch.cuda.current_device()
    with _cupy_device(device):
        return _module(device).get_function(f"{name}<{CUDA_TYPES[dtype]}{more_args}>")


def _cupy_device(device: int):
    import cupy

    return cupy.cuda.Device(device)


@contextlib.contextmanager
def torch_stream():
    """Make torch's current CUDA stream CuPy's current stream (and device) too."""
    import cupy

    from inflightllm.gpu import pdl

    stream = torch.cuda.current_stream()
    device = stream.device.index
    with cupy.cuda.Device(device), pdl.external_stream(stream.cuda_stream, device):
        yield


def _ptr(tensor: torch.Tensor) -> np.uintp:
    return np.uintp(tensor.data_ptr())


def _aligned16(*tensors: torch.Tensor) -> bool:
    """Contiguous rows starting on 16-byte boundaries (for 16-byte vector loads and stores)."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def _threads(width: int) -> int:
    return max(32, min(1024, 32 * ((width + 31) // 32)))


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out[t] = weight * rmsnorm(x[t]); x, out: [num_tokens, hidden] contiguous."""
    tokens, hidden = x.shape
    if tokens:
        _kernel("rms_norm", x.dtype, x.device.index)(
            (tokens,), (_threads(min(hidden, 1024)),), (_ptr(out), _ptr(x), _ptr(weight), np.float32(eps), np.int32(hidden))
        )
    return out


def add_norm_vector_ok(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether add_rms_norm_vec takes these rows: contiguous, 16-byte aligned, whole 16-byte
    chunks, at most ADD_NORM_NPT chunks a thread of 1,024."""
    width = hidden.shape[-1]
    vec = 16 // hidden.element_size()
    return width % vec == 0 and width // vec <= 1024 * _ADD_NORM_NPT and _aligned16(hidden, residual, weight)


def rotary_vector_ok(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_dim: int) -> bool:
    """Whether rotary_vec takes these rows: each half head a whole number of 16-byte chunks,
    rows (and q, k, the table) starting on 16 bytes."""
    esz = q.element_size()
    return ((head_dim // 2) % (16 // esz) == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
            and all(t.data_ptr() % 16 == 0 for t in (q, k, cos_sin))
            and (q.stride(0) * esz) % 16 == 0 and (k.stride(0) * esz) % 16 == 0 and cos_sin.is_contiguous())


def add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 vector: bool | None = None) -> None:
    """In place: residual += hidden; hidden = weight * rmsnorm(residual). 16-byte loads and
    stores (add_rms_norm_vec) where the rows allow them, unless `vector` is False (None:
    vector_kernels())."""
    vector = vector_kernels() if vector is None else vector
    tokens, width = hidden.shape
    vec = 16 // hidden.element_size()
    chunks = width // vec
    if tokens and vector and add_norm_vector_ok(hidden, residual, weight):
        device = hidden.device.index
        threads = _threads(-(-chunks // 2))  # two chunks a thread (at most 1024 threads: up to four)
        _launch_small(
            _kernel("add_rms_norm_vec", hidden.dtype, device),
            (tokens,), (threads,),
            (_ptr(hidden), _ptr(residual), _ptr(weight), np.float32(eps), np.int32(width)),
            device,
        )
    elif tokens:
        device = hidden.device.index
        _launch_small(
            _kernel("add_rms_norm", hidden.dtype, device),
            (tokens,),
            (_threads(min(width, 1024)),),
            (_ptr(hidden), _ptr(residual), _ptr(weight), np.float32(eps), np.int32(width)),
            device, 4 * width,
        )


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
           num_heads: int, num_kv_heads: int, head_dim: int, vector: bool | None = None) -> None:
    """In place RoPE on q [num_tokens, num_heads*head_dim] and k [num_tokens, num_kv_heads*head_dim]
    (row-strided views allowed); positions int64 [num_tokens]; cos_sin [max_pos, head_dim].
    16-byte loads and stores (rotary_vec) where the rows allow them, unless `vector` is False
    (None: vector_kernels())."""
    vector = vector_kernels() if vector is None else vector
    tokens = q.shape[0]
    if tokens and vector and rotary_vector_ok(q, k, cos_sin, head_dim):
        items = (num_heads + num_kv_heads) * (head_dim // 2) // (16 // q.element_size())
        _kernel("rotary_vec", q.dtype, q.device.index)(
            (tokens,),
            (_threads(min(items, 256)),),
            (_ptr(q), _ptr(k), _ptr(positions), _ptr(cos_sin), np.int32(num_heads), np.int32(num_kv_heads),
             np.int32(head_dim), np.int64(q.stride(0)), np.int64(k.stride(0))),
        )
    elif tokens:
        pairs = (num_heads + num_kv_heads) * head_dim // 2
        _kernel("rotary", q.dtype, q.device.index)(
            (tokens,),
            (_threads(min(pairs, 512)),),
            (_ptr(q), _ptr(k), _ptr(positions), _ptr(cos_sin), np.int32(num_heads), np.int32(num_kv_heads),
             np.int32(head_dim), np.int64(q.stride(0)), np.int64(k.stride(0))),
        )


def silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """out [n, width] = silu(gate_up[:, :width]) * gate_up[:, width:]."""
    tokens, double = gate_up.shape
    width = double // 2
    total = tokens * width
    vec = 16 // gate_up.element_size()
    if total and width % vec == 0 and tokens <= 65535 and _aligned16(gate_up, out):
        threads = 128
        _kernel("silu_and_mul_vec", gate_up.dtype, gate_up.device.index)(
            (-(-width // (threads * vec)), tokens), (threads,), (_ptr(out), _ptr(gate_up), np.int32(width))
        )
    elif total:
        blocks = min((total + 255) // 256, 65535)
        _kernel("silu_and_mul", gate_up.dtype, gate_up.device.index)(
            (blocks,), (256,), (_ptr(out), _ptr(gate_up), np.int32(width), np.int64(total))
        )
    return out


# ---- FP8 activation quantization (layers.cu, "FP8 (e4m3) activation quantization") ------------
# Each writes e4m3 rows `q` [tokens, width] (torch.float8_e4m3fn) and float32 per-row scales
# `scale` [tokens, 1], as inflightllm.quantization.fp8.quantize_per_token would from the rows
# the unfused ops compute, for torch._scaled_mm's row-wise scaling.

def _check_fp8_out(q: torch.Tensor, scale: torch.Tensor, tokens: int, width: int) -> None:
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (tokens, width) or not q.is_contiguous():
        raise ValueError(f"fp8 rows: need a contiguous float8_e4m3fn [{tokens}, {width}], got {q.dtype} {tuple(q.shape)}")
    if scale.dtype != torch.float32 or scale.numel() != tokens or not scale.is_contiguous():
        raise ValueError(f"fp8 scales: need {tokens} contiguous float32, got {scale.dtype} {tuple(scale.shape)}")
    if width % 2:
        raise ValueError(f"fp8 rows: width {width} must be even")


def _fp8_vec_threads(width: int, dtype: torch.dtype, vector: bool | None, *tensors: torch.Tensor) -> int:
    """Threads of a 16-byte FP8 quantizing kernel for rows of `width` (about 4 chunks a thread,
    at most FP8_NPT), or 0 where the scalar kernel must run (4-byte type, rows not whole
    16-byte chunks or not aligned, too wide, or `vector` False / vector_kernels() off)."""
    vector = vector_kernels() if vector is None else vector
    if not vector or dtype.itemsize != 2 or width % 8 or not _aligned16(*tensors):
        return 0
    chunks = width // 8
    threads = _threads(max(-(-chunks // 4), 1))
    return threads if threads * _FP8_NPT >= chunks else 0


@functools.cache
def fp8_quant_v2() -> bool:
    """Whether the FP8 quantizing kernels' version 2 runs where it can (INFLIGHTLLM_FP8_QUANT_V2, default 1)."""
    return env_switch("INFLIGHTLLM_FP8_QUANT_V2")


def _launch_fp8(name: str, rows: torch.Tensor, tokens: int, width: int, vec_threads: int, args: tuple) -> None:
    """One row a block: `name`_v2 with `vec_threads` (not 0) where they hold the row in
    FP8_V2_NPT chunks each, else `name`_vec with them, else the scalar `name`."""
    if not tokens:
        return
    device = rows.device.index
    if vec_threads and vec_threads * FP8_V2_NPT >= width // 8 and fp8_quant_v2():
        _kernel(name + "_v2", rows.dtype, device, f",{FP8_V2_NPT}")((tokens,), (vec_threads,), args)
        return
    kernel, threads = (name + "_vec", vec_threads) if vec_threads else (name, _threads(min(width // 2, 1024)))
    _kernel(kernel, rows.dtype, device)((tokens,), (threads,), args)


def quant_rows_fp8(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, vector: bool | None = None) -> None:
    """q, scale = quantize_per_token(x); x [tokens, width] contiguous."""
    tokens, width = x.shape
    _check_fp8_out(q, scale, tokens, width)
    _launch_fp8("quant_rows_fp8", x, tokens, width, _fp8_vec_threads(width, x.dtype, vector, x),
                (_ptr(q), _ptr(scale), _ptr(x), np.int32(width)))


def add_rms_norm_fp8(q: torch.Tensor, scale: torch.Tensor, delta: torch.Tensor | None, residual: torch.Tensor,
                     weight: torch.Tensor, eps: float, vector: bool | None = None) -> None:
    """residual += delta (unless None); q, scale = quantize_per_token(weight * rmsnorm(residual))."""
    tokens, width = residual.shape
    _check_fp8_out(q, scale, tokens, width)
    if delta is not None and (delta.shape != residual.shape or not delta.is_contiguous()):
        raise ValueError(f"delta: need a contiguous {tuple(residual.shape)}, got {tuple(delta.shape)}")
    threads = _fp8_vec_threads(width, residual.dtype, vector, residual, weight, *([delta] if delta is not None else []))
    _launch_fp8("add_rms_norm_fp8", residual, tokens, width, threads,
                (_ptr(q), _ptr(scale), _ptr_or_null(delta), _ptr(residual), _ptr(weight), np.float32(eps),
                 np.int32(width)))


# silu_and_mul_fp8_tma (Hopper): a row's gate and up halves in a block's shared memory
SILU_TMA_THREADS = 256
SILU_TMA_MAX_SHARED = 227 * 1024 - 1024


@functools.cache
def fp8_silu_tma() -> bool:
    """Whether silu_and_mul_fp8 takes its TMA version on Hopper and later where the row fits
    (INFLIGHTLLM_FP8_SILU_TMA, default 1)."""
    return env_switch("INFLIGHTLLM_FP8_SILU_TMA")


@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _hopper(device: int) -> bool:
    return _capability(device) >= (9, 0)


def silu_tma_shared(width: int, dtype: torch.dtype) -> int:
    """Dynamic shared memory of silu_and_mul_fp8_tma for rows of `width` (gate and up)."""
    return 2 * width * dtype.itemsize


def silu_tma_fits(width: int, dtype: torch.dtype) -> bool:
    """Whether silu_and_mul_fp8_tma can take rows of `width` (16-bit values, whole 16-byte
    chunks, gate and up within a block's shared memory)."""
    return dtype.itemsize == 2 and width % 8 == 0 and silu_tma_shared(width, dtype) <= SILU_TMA_MAX_SHARED


def silu_and_mul_fp8(q: torch.Tensor, scale: torch.Tensor, gate_up: torch.Tensor, vector: bool | None = None,
                     tma: bool | None = None) -> None:
    """q, scale = quantize_per_token(silu(gate_up[:, :width]) * gate_up[:, width:]). On Hopper
    and later, the TMA version where the row fits a block's shared memory (`tma` None:
    fp8_silu_tma(); False: version 2 / the 16-byte / the scalar kernel as `vector` says)."""
    tokens, double = gate_up.shape
    width = double // 2
    _check_fp8_out(q, scale, tokens, width)
    args = (_ptr(q), _ptr(scale), _ptr(gate_up), np.int32(width))
    vec_threads = _fp8_vec_threads(width, gate_up.dtype, vector, gate_up)
    shared = silu_tma_shared(width, gate_up.dtype)
    device = gate_up.device.index
    if (tokens and vec_threads and (fp8_silu_tma() if tma is None else tma) and silu_tma_fits(width, gate_up.dtype)
            and _hopper(device)):
        function = _kernel("silu_and_mul_fp8_tma", gate_up.dtype, device)
        _allow_shared(function, ("silu_and_mul_fp8_tma", gate_up.dtype, device), shared)
        function((tokens,), (min(SILU_TMA_THREADS, _threads(width // 8)),), args, shared_mem=shared)
        return
    _launch_fp8("silu_and_mul_fp8", gate_up, tokens, width, vec_threads, args)


# ---- Small-batch decode kernels (layers.cu, "Small-batch decode kernels") --------------------
SMALL_BATCH_M = (1, 2, 4, 8)  # template sizes; a launch uses the smallest that holds its tokens
MAX_SMALL_BATCH = SMALL_BATCH_M[-1]
SMALL_KERNELS = ("qkv_norm_rope", "gate_up_norm_silu", "small_gemv")
_WARPS_PER_BLOCK = 8
_MAX_SHARED = 227 * 1024  # H100/H200 opt-in shared memory per block


# Weight kinds of the small-batch kernels: "" (the model's dtype), "e4m3" (FP8 weights) and
# "int8" (signed bytes: model.int8_lm_head; small_gemv only).
_BYTE_WEIGHTS = {torch.float8_e4m3fn: "e4m3", torch.int8: "int8"}
_WEIGHT_TYPES = {"e4m3": "unsigned char", "int8": "signed char"}


def _weight_type(dtype: torch.dtype, wkind: str) -> str:
    """The kernels' weight element type: the model's, e4m3 bytes or int8 bytes."""
    return _WEIGHT_TYPES[wkind] if wkind else CUDA_TYPES[dtype]


# The FP8 weight chunks (8 bytes) a lane has in flight, and the resident blocks a SM the
# one-token kernels are built for (their registers: 3 -> at most 85). INFLIGHTLLM_FP8_GEMV_U
# and INFLIGHTLLM_SMALL_BLOCKS override them (perf/bench_small_gemv.py's variants).
FP8_GEMV_U = 8
SMALL_BLOCKS_M1 = 3


def small_gemv_defines() -> tuple[str, ...]:
    """The small-batch kernels' compile-time settings, as nvrtc options."""
    values = {}
    for env, name, default, allowed in (("INFLIGHTLLM_FP8_GEMV_U", "FP8_GEMV_U", FP8_GEMV_U, range(1, 33)),
                                        ("INFLIGHTLLM_SMALL_BLOCKS", "SMALL_BLOCKS_M1", SMALL_BLOCKS_M1, range(1, 9))):
        text = os.environ.get(env, "").strip()
        if text and not (text.isdigit() and int(text) in allowed):
            raise ValueError(f"{env}={text!r}: an integer in {allowed.start}..{allowed.stop - 1}")
        values[name] = int(text) if text else default
    return tuple(f"-D{name}={value}" for name, value in values.items())


@functools.cache
def _small_module(dtype: torch.dtype, device: int, wkind: str = ""):
    import cupy

    ctype, wtype = CUDA_TYPES[dtype], _weight_type(dtype, wkind)
    kernels = ("small_gemv",) if wkind == "int8" else SMALL_KERNELS
    names = [f"{kernel}<{ctype},{wtype},{m}>" for kernel in kernels for m in SMALL_BATCH_M]
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=_source(), options=("-std=c++17", *small_gemv_defines()), name_expressions=names)
        module.compile()
    return module


_shared_set: dict[tuple, int] = {}


def _allow_shared(function, key: tuple, shared: int) -> None:
    """Let `function` (named by `key`) take `shared` bytes of dynamic shared memory: above the
    default 48 KiB the attribute must be raised, once per size that grows."""
    if shared > 48 * 1024 and _shared_set.get(key, 0) < shared:
        function.max_dynamic_shared_size_bytes = shared
        _shared_set[key] = shared


@functools.cache
def _small_function(name: str, dtype: torch.dtype, m: int, device: int, wkind: str = ""):
    with _cupy_device(device):
        return _small_module(dtype, device, wkind).get_function(
            f"{name}<{CUDA_TYPES[dtype]},{_weight_type(dtype, wkind)},{m}>"
        )


def _template_m(tokens: int) -> int:
    """The smallest template size that holds `tokens` rows."""
    return next(size for size in SMALL_BATCH_M if size >= tokens)


def _norm_shared_bytes(rows: torch.Tensor) -> int:
    """Shared memory of a norm kernel: its template's rows of the residual's width."""
    tokens, hidden = rows.shape
    return _template_m(tokens) * hidden * rows.element_size()


def _small_kernel(name: str, dtype: torch.dtype, tokens: int, device: int, shared: int = 0, wkind: str = ""):
    m = _template_m(tokens)
    function = _small_function(name, dtype, m, device, wkind)
    _allow_shared(function, (name, dtype, m, device, wkind), shared)
    return function


def _launch_small(function, grid, block, args, device: int, shared: int = 0) -> None:
    """A launch of a kernel that calls pdl_trigger and pdl_wait (the small-batch kernels and
    add_rms_norm) on CuPy's current stream (torch_stream): pdl.launch_on."""
    import cupy

    from inflightllm.gpu import pdl

    pdl.launch_on(function, grid, block, args, shared, cupy.cuda.get_current_stream().ptr, device)


_NOT_FUSED = (np.uintp(0), np.uintp(0), np.int64(0), np.int32(0), np.int32(0))


def _fused(fused: tuple | None) -> tuple:
    """small_gemv's five fused_* arguments (TensorParallelGroup.fused_all_reduce), or nulls."""
    return _NOT_FUSED if fused is None else fused


def small_batch_ok(tokens: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether the small-batch kernels take `tokens` rows of width `hidden` (their norm
    prologue keeps the rows in shared memory; rows go in 16-byte chunks)."""
    return (
        dtype in CUDA_TYPES and 0 < tokens <= MAX_SMALL_BATCH and hidden % (16 // dtype.itemsize) == 0
        and _template_m(tokens) * hidden * dtype.itemsize <= _MAX_SHARED
    )


def _ptr_or_null(tensor: torch.Tensor | None) -> np.uintp:
    return np.uintp(0) if tensor is None else np.uintp(tensor.data_ptr())


def _weight_args(weight: torch.Tensor, weight_scale: torch.Tensor | None,
                 kernel: str = "small_gemv") -> tuple[str, np.uintp, np.uintp]:
    """(weight kind, weight pointer, scale pointer or null): e4m3 and int8 weights need their
    float32 per-row scales ([N] or [1, N], contiguous); int8 weights go to small_gemv only."""
    wkind = _BYTE_WEIGHTS.get(weight.dtype, "")
    if wkind == "int8" and kernel != "small_gemv":
        raise ValueError(f"small-batch kernel: {kernel} takes 16-bit or FP8 weights; int8 weights go to small_gemv only")
    if wkind and (weight_scale is None or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous()
                  or weight_scale.numel() != weight.shape[0]):
        name = "FP8" if wkind == "e4m3" else "int8"
        raise ValueError(f"small-batch kernel: {name} weights need contiguous float32 scales, one per row")
    return wkind, _ptr(weight), _ptr_or_null(weight_scale if wkind else None)


def _check_rows(**tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and not (tensor.is_contiguous() and tensor.data_ptr() % 16 == 0):
            raise ValueError(f"small-batch kernel: {name} must be contiguous and 16-byte aligned")


def qkv_norm_rope(qkv, residual_in, delta, residual_out, norm_weight, weight, bias, positions, cos_sin,
                  num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                  slot_mapping=None, key_cache=None, value_cache=None, weight_scale=None) -> None:
    """qkv [n, (heads + 2 kv_heads) * head_dim] = RoPE(weight @ rmsnorm(r) + bias) with
    r = residual_in + delta (delta None: r = residual_in), written to residual_out too. With
    slot_mapping (int64 [n], -1 = skip) the k and v rows are also written to the paged caches
    [blocks, block_size, kv_heads, head_dim] (as the attention backend's reshape_and_cache)."""
    if slot_mapping is not None:
        if slot_mapping.dtype != torch.int64 or key_cache.dtype != qkv.dtype or value_cache.dtype != qkv.dtype:
            raise ValueError("small-batch kernel: slot_mapping must be int64 and the caches of the model's dtype")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or key_cache.shape[-2:] != (num_kv_heads, head_dim):
            raise ValueError("small-batch kernel: caches must be contiguous [blocks, block_size, kv_heads, head_dim]")
    tokens, hidden = residual_in.shape
    _check_rows(qkv=qkv, residual_in=residual_in, delta=delta, residual_out=residual_out, weight=weight)
    if positions.dtype != torch.int64:
        raise ValueError("small-batch kernel: positions must be int64")
    units = (num_heads + 2 * num_kv_heads) * (head_dim // 2)
    shared = _norm_shared_bytes(residual_in)
    device = residual_in.device.index
    wkind, weight_ptr, scale_ptr = _weight_args(weight, weight_scale, "qkv_norm_rope")
    _launch_small(
        _small_kernel("qkv_norm_rope", residual_in.dtype, tokens, device, shared, wkind),
        (-(-units // _WARPS_PER_BLOCK),), (32 * _WARPS_PER_BLOCK,),
        (_ptr(qkv), _ptr(residual_in), _ptr_or_null(delta), _ptr(residual_out), _ptr(norm_weight), weight_ptr,
         scale_ptr, _ptr_or_null(bias), _ptr(positions), _ptr(cos_sin), _ptr_or_null(slot_mapping), _ptr_or_null(key_cache),
         _ptr_or_null(value_cache), np.int32(num_heads), np.int32(num_kv_heads),
         np.int32(head_dim), np.int32(tokens), np.int32(hidden), np.float32(eps)),
        device, shared,
    )


def gate_up_norm_silu(act, residual_in, delta, residual_out, norm_weight, weight, bias, eps: float,
                      weight_scale=None) -> None:
    """act [n, inter] = silu(gate) * up of weight [2 inter, hidden] @ rmsnorm(residual_in + delta),
    the summed rows written to residual_out."""
    tokens, hidden = residual_in.shape
    inter = act.shape[1]
    _check_rows(act=act, residual_in=residual_in, delta=delta, residual_out=residual_out, weight=weight)
    shared = _norm_shared_bytes(residual_in)
    device = residual_in.device.index
    wkind, weight_ptr, scale_ptr = _weight_args(weight, weight_scale, "gate_up_norm_silu")
    _launch_small(
        _small_kernel("gate_up_norm_silu", residual_in.dtype, tokens, device, shared, wkind),
        (-(-inter // _WARPS_PER_BLOCK),), (32 * _WARPS_PER_BLOCK,),
        (_ptr(act), _ptr(residual_in), _ptr_or_null(delta), _ptr(residual_out), _ptr(norm_weight), weight_ptr,
         scale_ptr, _ptr_or_null(bias), np.int32(inter), np.int32(tokens), np.int32(hidden), np.float32(eps)),
        device, shared,
    )


def small_gemv(out, x, weight, bias, fused=None, weight_scale=None) -> torch.Tensor:
    """out [n, N] = x [n, K] @ weight[N, K].T + bias, for n <= MAX_SMALL_BATCH; weight 16-bit,
    or e4m3 / int8 with `weight_scale` (float32, one per row, applied to each dot product). With `fused`
    (TensorParallelGroup.fused_all_reduce), `out` = that summed over the ranks: the all-reduce
    is done in the kernel (layers.cu, "The all-reduce fused into the small-batch GEMVs")."""
    tokens, width = x.shape
    rows = weight.shape[0]
    _check_rows(out=out, x=x, weight=weight)
    device = x.device.index
    wkind, weight_ptr, scale_ptr = _weight_args(weight, weight_scale)
    _launch_small(
        _small_kernel("small_gemv", x.dtype, tokens, device, wkind=wkind),
        (-(-rows // (2 * _WARPS_PER_BLOCK)),), (32 * _WARPS_PER_BLOCK,),
        (_ptr(out), _ptr(x), weight_ptr, scale_ptr, _ptr_or_null(bias), np.int32(rows), np.int32(tokens), np.int32(width),
         *_fused(fused)),
        device,
    )
    return out


# ---- FP8 GEMM for a few rows (fp8_small_m.cu) ----------------------------------------------
FP8_SMALL_M_SOURCE = Path(__file__).with_name("fp8_small_m.cu")
FP8_SMALL_M_MAX = 32  # tokens: 8 a token tile, at most 4 tiles
# GpuLlama's default: every GEMM of up to 32 rows (one H100, Llama-3-8B decode steps with the
# layouts below: 4.03 / 4.22 / 4.55 / 5.51 / 5.54 ms at 3 / 8 / 16 / 24 / 32 rows against 5.66 / 5.65 /
# 5.74 / 5.81 / 5.84 by torch._scaled_mm; docs/CUDA-KERNELS.md, "FP8 GEMM for a few rows").
FP8_SMALL_M_ROWS = 32
FP8_SMALL_M_ENV = "INFLIGHTLLM_FP8_SMALL_M_ROWS"


def fp8_small_m_rows() -> int:
    """FP8 GEMMs of at most this many rows run fp8_small_m_gemm (where fp8_small_m_ok), larger
    ones torch._scaled_mm: FP8_SMALL_M_ROWS, or `INFLIGHTLLM_FP8_SMALL_M_ROWS` (0 to
    FP8_SMALL_M_MAX; 0: torch._scaled_mm for all) for measurements."""
    rows = env_number(FP8_SMALL_M_ENV, FP8_SMALL_M_ROWS, 0, FP8_SMALL_M_MAX, "GEMM rows")
    if rows != int(rows):
        raise ValueError(f"{FP8_SMALL_M_ENV}={os.environ[FP8_SMALL_M_ENV]!r}: give GEMM rows, a whole number "
                         f"from 0 to {FP8_SMALL_M_MAX}")
    return int(rows)


# (token tiles, channel tiles a block, resident blocks an SM (0: ptxas chooses), 64-k chunks a
# warp has in flight) of the fp8_small_m_gemm instantiations, and the one that runs for each
# count of 8-row token tiles: the fastest of perf/bench_fp8_small_m.py's on one H100 (2026-12-07;
# the first, third and sixth were the defaults before, kept for that comparison)
FP8_SMALL_M_LAYOUTS = ((1, 1, 0, 4), (1, 1, 3, 4), (2, 1, 0, 4), (2, 1, 3, 2), (3, 1, 0, 2), (4, 1, 0, 2),
                       (4, 1, 2, 2))
FP8_SMALL_M_DEFAULT_LAYOUT = {1: (1, 1, 3, 4), 2: (2, 1, 3, 2), 3: (3, 1, 0, 2), 4: (4, 1, 2, 2)}


def _fp8_small_m_name(ctype: str, layout: tuple[int, int, int, int]) -> str:
    return f"fp8_small_m_gemm<{ctype},{','.join(map(str, layout))}>"


@functools.cache
def _fp8_small_m_module(device: int):
    import cupy

    from inflightllm.gpu.pdl import with_pdl

    names = [_fp8_small_m_name(ctype, layout) for ctype in ("__half", "__nv_bfloat16") for layout in FP8_SMALL_M_LAYOUTS]
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=with_pdl(FP8_SMALL_M_SOURCE.read_text(encoding="utf-8")), options=("-std=c++17",),
                                name_expressions=names)
        module.compile()
    return module


@functools.cache
def _fp8_small_m_kernel(dtype: torch.dtype, layout: tuple[int, int, int, int], device: int):
    """fp8_small_m_gemm<dtype, layout> of the module on `device`, fetched once (eager steps
    launch it for every GEMM)."""
    with _cupy_device(device):
        return _fp8_small_m_module(device).get_function(_fp8_small_m_name(CUDA_TYPES[dtype], layout))


def fp8_small_m_ok(tokens: int, width: int, device: int) -> bool:
    """Whether fp8_small_m_gemm takes `tokens` rows of `width` on GPU `device` (FP8 tensor
    cores: compute capability 8.9 and later; K in steps of 64)."""
    return 0 < tokens <= FP8_SMALL_M_MAX and width % 64 == 0 and _capability(device) >= (8, 9)


def fp8_small_m_gemm(out: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                     weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                     layout: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """out [M, N] = (x_q [M, K] @ weight [N, K].T) * x_scale[:, None] * weight_scale[None, :]
    (+ bias), e4m3 inputs with float32 per-token and per-channel scales (quantization.fp8.linear's
    numbers), for M <= FP8_SMALL_M_MAX; out bf16 or fp16. On CuPy's current stream (torch_stream).
    `layout`: one of FP8_SMALL_M_LAYOUTS with room for M tokens (measurements); by default
    FP8_SMALL_M_DEFAULT_LAYOUT's for the token tiles of M."""
    tokens, width = x_q.shape
    rows = weight.shape[0]
    device = x_q.device.index
    if x_q.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != width:
        raise ValueError("fp8_small_m_gemm: x_q [M, K] and weight [N, K] must be float8_e4m3fn")
    if out.dtype not in (torch.float16, torch.bfloat16) or out.shape != (tokens, rows):
        raise ValueError(f"fp8_small_m_gemm: out must be bf16 or fp16 [{tokens}, {rows}]")
    if not fp8_small_m_ok(tokens, width, device):
        raise ValueError(f"fp8_small_m_gemm: {tokens} rows of width {width}: at most {FP8_SMALL_M_MAX} rows, "
                         "a width divisible by 64, a GPU with FP8 tensor cores (8.9+)")
    for name, scale, count in (("x_scale", x_scale, tokens), ("weight_scale", weight_scale, rows)):
        if scale.dtype != torch.float32 or not scale.is_contiguous() or scale.numel() != count:
            raise ValueError(f"fp8_small_m_gemm: {name} must be {count} contiguous float32 values")
    if bias is not None and (bias.dtype != out.dtype or bias.numel() != rows or not bias.is_contiguous()):
        raise ValueError(f"fp8_small_m_gemm: bias must be {rows} contiguous values of out's dtype")
    _check_rows(out=out, x_q=x_q, weight=weight)
    if layout is None:
        layout = FP8_SMALL_M_DEFAULT_LAYOUT[-(-tokens // 8)]
    elif tuple(layout) not in FP8_SMALL_M_LAYOUTS or 8 * layout[0] < tokens:
        raise ValueError(f"fp8_small_m_gemm: layout {layout!r} for {tokens} rows: one of {FP8_SMALL_M_LAYOUTS} "
                         "(token tiles, channel tiles, blocks an SM, chunks in flight) with 8 rows a token tile")
    channel_tiles = layout[1]
    with _cupy_device(device):
        kernel = _fp8_small_m_kernel(out.dtype, tuple(layout), device)
        kernel((-(-rows // (16 * channel_tiles)),), (256,),
               (_ptr(out), _ptr(x_q), _ptr(x_scale), _ptr(weight), _ptr(weight_scale), _ptr_or_null(bias),
                np.int32(tokens), np.int32(rows), np.int32(width)))
    return out
