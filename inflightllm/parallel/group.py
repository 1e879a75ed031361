"""Process groups and the collectives of a tensor-parallel model.

Each rank joins one default group (NCCL on GPU, gloo on CPU) for the model's
collectives and a gloo group for control messages (the pickled step description that
rank 0 broadcasts each step). `TensorParallelGroup` is what a sharded model holds: its
rank, the world size and the two collectives it needs.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) stays off: a program that uses it can put shared GPUs out of
# service. Set before NCCL initialises in every rank's process.
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def apply_nccl_safe_env(env: dict | None = None) -> dict:
    """Force the NVLS-off variables into `env` (os.environ when None); returns it."""
    target = os.environ if env is None else env
    target.update(NCCL_SAFE_ENV)
    return target


@dataclass
class TensorParallelGroup:
    """This rank's place in a tensor-parallel group, and the model's collectives."""

    rank: int
    world_size: int
    group: object | None = None  # the model's process group (None: the default group)
    backend: str = "gloo"
    # GPU ranks that reach each other over NVLink: the one-shot all-reduce for small tensors
    # (parallel/custom_all_reduce.py); NCCL does the others.
    custom: object | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        custom = self.custom
        if custom is not None and custom.handles(tensor):
            return custom.all_reduce(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def fused_all_reduce(self, nbytes: int) -> tuple | None:
        """The arguments of the all-reduce fused into the small-batch GEMVs for rows of
        `nbytes` (gpu/ops.small_gemv's `fused`), or None: all-reduce with `all_reduce` instead."""
        custom = self.custom
        return custom.fused_args(nbytes) if custom is not None else None

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """[n, k] on each rank -> [n, world_size * k], the ranks' columns in rank order."""
        n, k = tensor.shape
        if self.backend == "gloo":
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous(), group=self.group)
            return torch.cat(parts, dim=1)
        gathered = torch.empty(self.world_size, n, k, dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(gathered, tensor.contiguous(), group=self.group)
        return gathered.permute(1, 0, 2).reshape(n, self.world_size * k)


def shard_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """The [start, end) of `rank`'s equal share of `total` (which world_size divides)."""
    if total % world_size:
        raise ValueError(f"{total} is not divisible by the tensor-parallel size {world_size}")
    size = total // world_size
    return rank * size, (rank + 1) * size


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's rows of a vocab-parallel table: ceil(V / N) each, the last one shorter."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


class Distributed:
    """One rank's membership: the default group (model collectives) and a gloo control
    group. `init` rendezvouses over TCP on 127.0.0.1:`port`."""

    def __init__(self, rank: int, world_size: int, port: int, backend: str, timeout_s: float, device=None):
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            apply_nccl_safe_env()
        kwargs = {}
        if backend == "nccl" and device is not None:
            kwargs["device_id"] = torch.device(device)
        if dist.is_initialized():
            # A previous engine in this process left its default group behind (its teardown
            # failed or was cut short): it has no peers any more, so drop it.
            logger.warning("a process group of an earlier tensor-parallel engine is still registered; destroying it")
            try:
                dist.destroy_process_group()
            except Exception as error:  # noqa: BLE001
                logger.warning("destroying the stale process group failed: %r", error)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=self.timeout,
            **kwargs,
        )
        # Control messages always go over gloo (host memory, no GPU stream involved).
        self.control = dist.new_group(backend="gloo", timeout=self.timeout)
        self.tp = TensorParallelGroup(rank, world_size, None, backend)
        self._destroyed = False
        if backend == "nccl" and device is not None:
            from inflightllm.parallel.custom_all_reduce import CustomAllReduce

            self.tp.custom = CustomAllReduce.create(
                rank, world_size, torch.device(device), self.all_gather_object, self.all_agree
            )

    # ---- control messages --------------------------------------------------------------
    def broadcast_message(self, message=None):
        """Rank 0 sends `message` (pickled); every other rank receives and returns it."""
        if self.rank == 0:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(payload)], dtype=torch.int64)
            dist.broadcast(size, 0, group=self.control)
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data, 0, group=self.control)
            return message
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.control)
        return pickle.loads(data.numpy().tobytes())

    def all_gather_object(self, value) -> list:
        """Every rank's `value`, in rank order (over the control group)."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.control)
        return gathered

    def all_agree(self, ok: bool) -> bool:
        """True when every rank says `ok`."""
        return self.min_over_ranks(1 if ok else 0) == 1

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    # ---- teardown ----------------------------------------------------------------------
    def abort(self) -> None:
        """Abort every group so that a blocked collective returns (with an error)."""
        if self.tp.custom is not None:  # its kernels wait at a flag barrier, not in NCCL
            self.tp.custom.abort()
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            for group in (self.control, None):
                try:
                    _abort_process_group(group) if group is not None else _abort_process_group()
                except Exception as error:  # noqa: BLE001 - best effort: gloo may not abort
                    logger.debug("abort of a process group failed: %r", error)
        except ImportError:
            pass

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        if self.tp.custom is not None:
            self.tp.custom.close()
            self.tp.custom = None
        try:
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001
            logger.debug("destroy_process_group failed: %r", error)
