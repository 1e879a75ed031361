"""Programmatic dependent launch (PDL) for our kernels on Hopper and later GPUs.

A kernel normally starts only when the one before it in the stream has ended: every kernel
boundary leaves the GPU part idle while the last blocks drain and the next grid is launched.
In a batch-1 decode step there are ~200 boundaries (6 kernels a layer), each a few
microseconds against kernels of 10-60 us. With PDL the next kernel is launched while the
previous one still runs: its blocks start in the slots the previous kernel leaves free, issue
what does not depend on it (the first weight loads of a GEMV), and wait in
`griddepcontrol.wait` until the previous grid has completed and its writes are visible.

Both sides are needed:
- the kernel calls `griddepcontrol.launch_dependents` (lets the next grid be scheduled once
  all of this grid's blocks are running) and `griddepcontrol.wait` before it reads anything
  an earlier kernel wrote (layers.cu and the attention kernels.cu: `pdl_trigger`, `pdl_wait`;
  both are no-ops when the kernel was launched without the attribute);
- the launch carries `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, which CuPy's
  launcher cannot set, so these launches go through the driver's `cuLaunchKernelEx` here.
  Captured into a CUDA graph the attribute becomes a programmatic edge.

Every kernel launched this way waits before its first dependent read and before it exits, so
"the previous kernel has completed" holds transitively down the stream. A kernel launched
without the attribute after one of ours waits for it to complete, as always. Before its wait
a kernel reads only what none of these kernels writes: weights, norm weights, the RoPE
table, and the step's positions and slots (uploaded before the step's first kernel, which
is not one of ours and so lets the next start only when it has completed).

`INFLIGHTLLM_PDL=0` turns it off (plain CuPy launches); by default it is on where the GPU is
compute capability 9.0 or later and the driver has `cuLaunchKernelEx`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from pathlib import Path

import numpy as np

ENV = "INFLIGHTLLM_PDL"
DEVICE_SOURCE = Path(__file__).with_name("pdl.cuh")  # pdl_trigger() and pdl_wait()
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("align", ctypes.c_void_p), ("flag", ctypes.c_int)]


class _Attribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attribute)), ("numAttrs", ctypes.c_uint),
    ]


# Each kernel argument in an 8-byte slot of a packed buffer, by the NumPy scalar type the
# launchers pass (np.uintp is np.uint64 here); the driver copies the arguments at launch.
_SLOT_FORMATS = {np.int32: "i4x", np.int64: "q", np.uint64: "Q", np.float32: "f4x"}
_MAX_ARGS = 64


@functools.cache
def _format(types: tuple) -> struct.Struct:
    try:
        return struct.Struct("=" + "".join(_SLOT_FORMATS[kind] for kind in types))
    except KeyError as error:
        raise TypeError(f"pdl.launch: kernel arguments of type {error.args[0].__name__} are not supported") from None


@functools.cache
def _attribute() -> _Attribute:
    attribute = _Attribute()
    attribute.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.flag = 1
    return attribute


class _Launch(threading.local):
    """This thread's argument buffer, its pointer array and launch config, reused."""

    def __init__(self):
        self.slots = ctypes.create_string_buffer(8 * _MAX_ARGS)
        base = ctypes.addressof(self.slots)
        self.pointers = (ctypes.c_void_p * _MAX_ARGS)(*(base + 8 * i for i in range(_MAX_ARGS)))
        self.config = _Config()
        self.config.attrs = ctypes.pointer(_attribute())
        self.config.numAttrs = 1


_state = _Launch()


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernelEx
    launch.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    launch.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int
    return lib


def with_pdl(source: str) -> str:
    """A kernel source with the device helpers (pdl.cuh) before it: prepended rather than
    #included, so that CuPy's compile cache, keyed by the source text, sees them change."""
    return DEVICE_SOURCE.read_text(encoding="utf-8") + "\n" + source


@functools.cache
def enabled(device: int) -> bool:
    """Whether launches on GPU `device` use PDL (see the module's docstring)."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return False
    import torch

    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        _driver()
    except (OSError, AttributeError):
        return False
    return True


def _error_name(status: int) -> str:
    name = ctypes.c_char_p()
    if _driver().cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {status}"


def launch(kernel, grid, block, args, shared_mem: int, stream_ptr: int) -> None:
    """Launch CuPy RawKernel `kernel` (compiled for the current device) with the programmatic
    stream serialization attribute on stream `stream_ptr`. `args` are NumPy scalars (int32,
    int64, uint64 / uintp, float32), as for CuPy's own launch."""
    if len(args) > _MAX_ARGS:
        raise TypeError(f"pdl.launch: at most {_MAX_ARGS} kernel arguments")
    state = _state
    _format(tuple(map(type, args))).pack_into(state.slots, 0, *args)
    config = state.config
    config.gridDimX, config.gridDimY, config.gridDimZ = (tuple(grid) + (1, 1))[:3]
    config.blockDimX, config.blockDimY, config.blockDimZ = (tuple(block) + (1, 1))[:3]
    config.sharedMemBytes = shared_mem
    config.hStream = stream_ptr
    function = kernel.kernel.ptr
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), function, state.pointers, None)
    if status == _INVALID_CONTEXT:
        # A thread whose first CUDA call this is has no current context yet (the runtime API
        # binds the device's primary context lazily): bind it, as any runtime call would.
        import cupy

        cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())
        status = _driver().cuLaunchKernelEx(ctypes.byref(config), function, state.pointers, None)
    if status != 0:
        name = getattr(kernel, "__name__", "kernel")
        raise RuntimeError(f"cuLaunchKernelEx ({name}, grid {tuple(grid)}, block {tuple(block)}) failed: {_error_name(status)}")


@functools.cache
def external_stream(stream_ptr: int, device: int):
    """CuPy's handle of a CUDA stream made elsewhere (torch's), one per stream."""
    import cupy

    return cupy.cuda.ExternalStream(stream_ptr, device)


def launch_on(kernel, grid, block, args, shared_mem: int, stream_ptr: int, device: int) -> None:
    """Launch a kernel that calls pdl_trigger and pdl_wait on stream `stream_ptr` of GPU
    `device`: by programmatic dependent launch where that GPU has it (`enabled`), else by
    CuPy's plain launch (the two calls are no-ops then)."""
    if enabled(device):
        launch(kernel, grid, block, args, shared_mem, stream_ptr)
        return
    import cupy

    with cupy.cuda.Device(device), external_stream(stream_ptr, device):
        kernel(tuple(grid), tuple(block), args, shared_mem=shared_mem)
