"""`CustomAllReduce`: the small all-reduces of tensor-parallel decode without NCCL.

At batch 1 a TP step all-reduces one row of the hidden size 65 times (the embedding, then
after o and down in every layer). NCCL took ~6 us a call on two H200s, and its kernels do not
take part in programmatic dependent launch, so each also breaks the overlap of the kernels
around it (docs/GPU-ENGINE.md, "Programmatic dependent launch"). Here each rank maps every
other rank's buffer (CUDA IPC over NVLink) and one kernel (gpu/allreduce.cu) copies its
input in, meets the other ranks at a flag barrier, and sums the ranks' copies in rank order,
so every rank gets the same bits. It is launched with PDL and captured in the decode graphs.

Used for tensors of at most `max_bytes` (the decode buckets), in the engine's dtypes, on
GPUs that can all reach each other (peer access); NCCL does the rest. All ranks set it up
together and agree: if one cannot, none uses it. `INFLIGHTLLM_CUSTOM_ALL_REDUCE=0` turns it
off. `abort()` releases kernels that wait for a rank that died (the runner's failure path).

The same buffers also carry the all-reduce fused into the small-batch o and down GEMVs
(gpu/layers.cu, "The all-reduce fused into the small-batch GEMVs"): each GEMV stores its rows
into every rank's buffer, and its last block sums them, so no all-reduce kernel follows it.
`fused_args` gives the GEMV the buffers; `INFLIGHTLLM_FUSED_ALL_REDUCE=0` keeps the
all-reduce kernel instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

ENV = "INFLIGHTLLM_CUSTOM_ALL_REDUCE"
FUSED_ENV = "INFLIGHTLLM_FUSED_ALL_REDUCE"
FUSED_SLOT_BYTES = 256 << 10  # FUSED_SLOT_BYTES in layers.cu: one rank's rows of one call, as 8-byte words
SOURCE = Path(__file__).resolve().parent.parent / "gpu" / "allreduce.cu"
GRID = 8  # AR_GRID in allreduce.cu
THREADS = 512
MAX_RANKS = 8
HEADER_BYTES = 1024
DEFAULT_MAX_BYTES = 256 << 10  # 32 rows of a 4,096-wide bf16 hidden state
_DTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_HOST_ALLOC_MAPPED = 2


def wanted(name: str = ENV) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


def buffer_bytes(world_size: int, max_bytes: int) -> int:
    """One rank's buffer: the header, the all-reduce kernel's two slots, then the fused
    all-reduce's two slots per rank."""
    return HEADER_BYTES + 2 * max_bytes + 2 * world_size * FUSED_SLOT_BYTES


@functools.cache
def _module(device: int):
    import cupy

    from inflightllm.gpu.pdl import with_pdl

    names = [f"one_shot_all_reduce<{ctype}>" for ctype in _DTYPES.values()]
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=with_pdl(SOURCE.read_text(encoding="utf-8")), options=("-std=c++17",), name_expressions=names)
        module.compile()
    return module


@functools.cache
def _function(device: int, dtype: torch.dtype):
    import cupy

    with cupy.cuda.Device(device):
        return _module(device).get_function(f"one_shot_all_reduce<{_DTYPES[dtype]}>")


class CustomAllReduce:
    """One rank's end. Build it with `create` (collective over the control group)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, max_bytes: int, own_ptr: int,
                 peer_ptrs: list[int], abort_flag: int):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.max_bytes = max_bytes
        self._own = own_ptr
        self._peers = peer_ptrs  # opened IPC mappings (this rank's excluded), closed in close()
        # Mapped pinned memory: with unified addressing (every 64-bit CUDA process) the kernel
        # reads it at the host pointer itself.
        self._abort_flag = abort_flag
        bases = [own_ptr if r == rank else peer_ptrs[r - (r > rank)] for r in range(world_size)]
        self.bases = torch.tensor(bases, dtype=torch.int64, device=device)  # uint64 in the kernel
        self._closed = False
        self.fused = wanted(FUSED_ENV)

    # ---- set-up ----------------------------------------------------------------------
    @classmethod
    def create(cls, rank: int, world_size: int, device: torch.device, exchange, agree,
               max_bytes: int = DEFAULT_MAX_BYTES) -> CustomAllReduce | None:
        """Set up rank `rank`'s end. `exchange(obj) -> [obj of each rank]` and `agree(ok) -> bool`
        (true when every rank says ok) run over the control group; every rank calls this."""
        import cupy

        runtime = cupy.cuda.runtime
        ok, reason, handle, state = True, "", b"", None
        if not wanted():
            ok, reason = False, f"{ENV}=0"
        elif world_size > MAX_RANKS:
            ok, reason = False, f"{world_size} ranks (at most {MAX_RANKS})"
        if ok:
            try:
                with cupy.cuda.Device(device.index):
                    size = buffer_bytes(world_size, max_bytes)
                    own = runtime.malloc(size)
                    runtime.memset(own, 0, size)
                    runtime.deviceSynchronize()
                    handle = bytes(runtime.ipcGetMemHandle(own))
                    abort_flag = runtime.hostAlloc(4, _HOST_ALLOC_MAPPED)
                    ctypes.c_int.from_address(abort_flag).value = 0
                    _module(device.index)
                state = (own, abort_flag)
            except Exception as error:  # noqa: BLE001 - any failure: NCCL for everything
                ok, reason = False, f"{type(error).__name__}: {error}"
        gpus = exchange((device.index, handle if ok else b""))
        if ok:
            for index, _ in gpus:
                if index != device.index and not runtime.deviceCanAccessPeer(device.index, index):
                    ok, reason = False, f"GPU {device.index} cannot access GPU {index} (no P2P)"
        peers: list[int] = []
        if ok:
            try:
                with cupy.cuda.Device(device.index):
                    for r, (_, peer_handle) in enumerate(gpus):
                        if r != rank:
                            peers.append(runtime.ipcOpenMemHandle(peer_handle, _IPC_LAZY_ENABLE_PEER_ACCESS))
            except Exception as error:  # noqa: BLE001
                ok, reason = False, f"opening a peer's buffer failed: {type(error).__name__}: {error}"
        everyone = agree(ok)
        if not everyone:
            if ok:
                reason = "another rank could not set it up"
            logger.info("custom all-reduce off on rank %d: %s; NCCL does every all-reduce", rank, reason)
            with cupy.cuda.Device(device.index):
                for pointer in peers:
                    runtime.ipcCloseMemHandle(pointer)
                if state is not None:
                    runtime.free(state[0])
                    runtime.freeHost(state[1])
            return None
        own, abort_flag = state
        logger.info("custom all-reduce on rank %d (%s, up to %d KiB per call)", rank, device, max_bytes >> 10)
        return cls(rank, world_size, device, max_bytes, own, peers, abort_flag)

    # ---- use -------------------------------------------------------------------------
    def handles(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        return (
            not self._closed and tensor.dtype in _DTYPES and tensor.device == self.device and 0 < nbytes <= self.max_bytes
            and nbytes % 16 == 0 and tensor.is_contiguous() and tensor.data_ptr() % 16 == 0
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place, on torch's current stream of this rank's GPU
        (`handles` must hold)."""
        from inflightllm.gpu import pdl

        index = self.device.index
        pointer = np.uintp(tensor.data_ptr())
        args = (pointer, pointer, np.uintp(self.bases.data_ptr()), np.uintp(self._abort_flag),
                np.int32(self.rank), np.int32(self.world_size),
                np.int64(tensor.numel() * tensor.element_size() // 16), np.int64(self.max_bytes))
        pdl.launch_on(_function(index, tensor.dtype), (GRID,), (THREADS,), args, 0,
                      torch.cuda.current_stream(self.device).cuda_stream, index)
        return tensor

    def fused_args(self, nbytes: int) -> tuple | None:
        """small_gemv's `fused_*` arguments (bases, abort flag, offset of the slots, rank,
        world size) for rows of `nbytes` per rank, or None where the fused all-reduce does
        not take them (off, closed, or more than a slot holds: its words take twice the
        bytes)."""
        if not self.fused or self._closed or not 0 < 2 * nbytes <= FUSED_SLOT_BYTES or nbytes % 16:
            return None
        return (np.uintp(self.bases.data_ptr()), np.uintp(self._abort_flag), np.int64(HEADER_BYTES + 2 * self.max_bytes),
                np.int32(self.rank), np.int32(self.world_size))

    def abort(self) -> None:
        """Let kernels that wait at the barrier for a rank that is gone return (garbage)."""
        if not self._closed:
            ctypes.c_int.from_address(self._abort_flag).value = 1

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (after its kernels have finished)."""
        if self._closed:
            return
        self._closed = True
        import cupy

        runtime = cupy.cuda.runtime
        try:
            with cupy.cuda.Device(self.device.index):
                runtime.deviceSynchronize()
                for pointer in self._peers:
                    runtime.ipcCloseMemHandle(pointer)
                runtime.free(self._own)
                runtime.freeHost(self._abort_flag)
        except Exception as error:  # noqa: BLE001 - teardown is best effort
            logger.debug("custom all-reduce close: %r", error)
