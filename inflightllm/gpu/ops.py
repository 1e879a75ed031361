"""Launchers for the fused layer kernels in `layers.cu` (CuPy RawModule, NVRTC).

CuPy is imported lazily: this module imports on a machine without it. Kernels launch on
CuPy's current stream; the runner makes that torch's current stream for the whole model
step (`torch_stream`), so torch and CuPy work share one stream and a torch CUDA graph
captures both. Tensors are passed as raw device pointers (no copies, no host syncs).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np
import torch

CUDA_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
KERNELS = ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "silu_and_mul_vec")
SOURCE = Path(__file__).with_name("layers.cu")


@functools.cache
def _module():
    import cupy

    names = [f"{kernel}<{ctype}>" for kernel in KERNELS for ctype in CUDA_TYPES.values()]
    module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",), name_expressions=names)
    module.compile()
    return module


@functools.cache
def _kernel(name: str, dtype: torch.dtype):
    return _module().get_function(f"{name}<{CUDA_TYPES[dtype]}>")


@functools.cache
def _external_stream(pointer: int, device_index: int):
    import cupy

    return cupy.cuda.ExternalStream(pointer, device_index)


@contextlib.contextmanager
def torch_stream():
    """Make torch's current CUDA stream CuPy's current stream (and device) too."""
    import cupy

    stream = torch.cuda.current_stream()
    device = stream.device.index
    with cupy.cuda.Device(device), _external_stream(stream.cuda_stream, device):
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
        _kernel("rms_norm", x.dtype)(
            (tokens,), (_threads(min(hidden, 1024)),), (_ptr(out), _ptr(x), _ptr(weight), np.float32(eps), np.int32(hidden))
        )
    return out


def add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += hidden; hidden = weight * rmsnorm(residual)."""
    tokens, width = hidden.shape
    if tokens:
        _kernel("add_rms_norm", hidden.dtype)(
            (tokens,),
            (_threads(min(width, 1024)),),
            (_ptr(hidden), _ptr(residual), _ptr(weight), np.float32(eps), np.int32(width)),
            shared_mem=4 * width,
        )


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
           num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """In place RoPE on q [num_tokens, num_heads*head_dim] and k [num_tokens, num_kv_heads*head_dim]
    (row-strided views allowed); positions int64 [num_tokens]; cos_sin [max_pos, head_dim]."""
    tokens = q.shape[0]
    if tokens:
        pairs = (num_heads + num_kv_heads) * head_dim // 2
        _kernel("rotary", q.dtype)(
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
        _kernel("silu_and_mul_vec", gate_up.dtype)(
            (-(-width // (threads * vec)), tokens), (threads,), (_ptr(out), _ptr(gate_up), np.int32(width))
        )
    elif total:
        blocks = min((total + 255) // 256, 65535)
        _kernel("silu_and_mul", gate_up.dtype)(
            (blocks,), (256,), (_ptr(out), _ptr(gate_up), np.int32(width), np.int64(total))
        )
    return out
