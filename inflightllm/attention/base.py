"""The attention interface: paged KV storage plus attention over packed sequences."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SequenceSlice:
    """One scheduled sequence inside a packed step."""

    query_start: int  # offset of its first new token in the packed batch
    query_len: int  # new tokens this step
    context_len: int  # tokens in the KV cache after this step (computed + new)
    block_table: tuple[int, ...]


@dataclass
class AttentionMetadata:
    """Everything attention needs about one packed step (no padding).

    Built once per step by the backend, shared by every layer.
    """

    sequences: list[SequenceSlice]
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) of each new token
    positions: torch.Tensor  # [num_tokens] int64: position of each new token in its sequence
    backend_data: dict = field(default_factory=dict)  # backend-specific precomputed indices

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(abc.ABC):
    """Owns the KV cache tensors and computes attention over them."""

    block_size: int
    num_blocks: int

    @abc.abstractmethod
    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Create the cache: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

    @abc.abstractmethod
    def build_metadata(self, sequences: list[SequenceSlice], device: torch.device) -> AttentionMetadata:
        """Pack the step's sequences into flat index tensors."""

    @abc.abstractmethod
    def forward(
        self,
        layer_index: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V into the cache, then attend; returns [num_tokens, num_heads, head_dim]."""

    # ---- swap (preemption_mode: swap) ------------------------------------------------
    # A preempted request's blocks are copied to host memory and later back into other
    # blocks. The CPU reference keeps a separate CPU tensor pool; a CUDA backend copies
    # to pinned host tensors. Handles are opaque to the caller.
    def swap_out(self, block_ids: list[int]):
        """Copy the K/V of `block_ids` (every layer) to host memory; returns a handle."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV blocks")

    def swap_in(self, handle, block_ids: list[int]) -> None:
        """Copy a swapped-out handle's K/V into `block_ids` (same count) and free the handle."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV blocks")

    def discard_swapped(self, handle) -> None:
        """Free a handle's host memory without copying it back (the request ended)."""
        raise NotImplementedError(f"{type(self).__name__} cannot swap KV blocks")

    # ---- host KV tier (engine.host_kv_cache_bytes) ------------------------------------------
    # A second cache of the same shape in host memory, `num_host_blocks` blocks, filled with
    # evicted prefix-cache blocks and read back on prefix hits (inflightllm.host_kv_tier).
    # The block manager decides which slot holds what; the backend only copies.
    def allocate_host_tier(self, num_host_blocks: int) -> int:
        """Allocate the host blocks; returns the bytes one block takes (every layer's K and V)."""
        raise NotImplementedError(f"{type(self).__name__} has no host KV tier")

    def offload_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (device block, host slot) pair's K/V of every layer into the host tier."""
        raise NotImplementedError(f"{type(self).__name__} has no host KV tier")

    def onload_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (host slot, device block) pair's K/V of every layer back into the cache."""
        raise NotImplementedError(f"{type(self).__name__} has no host KV tier")

    # ---- copy-on-write (sequence groups) --------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the K/V of every layer of each (source block, destination block) pair, all
        pairs at once. Sources and destinations are distinct blocks."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy KV blocks")


class HostSwapMixin:
    """swap_out/swap_in over per-layer `key_cache`/`value_cache` tensors of slots
    ([num_blocks * block_size, num_kv_heads, head_dim]): each swapped block is copied into
    fresh host tensors (pinned when the cache is on a GPU) and back with `index_copy_`.
    The host KV tier the same way: per-layer host tensors of the cache's shape
    ([num_host_blocks * block_size, ...]), a second tier of the same layout."""

    key_cache: list[torch.Tensor]
    value_cache: list[torch.Tensor]
    block_size: int

    def _block_slots(self, block_ids: list[int], device) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).reshape(-1)
        return slots.to(device)

    def swap_out(self, block_ids: list[int]):
        if not block_ids:
            return []
        device = self.key_cache[0].device
        slots = self._block_slots(block_ids, device)
        pin = device.type == "cuda"
        handle = []
        for key, value in zip(self.key_cache, self.value_cache):
            # [len(block_ids) * block_size, num_kv_heads, head_dim] each, in host memory.
            host_key = torch.empty((slots.shape[0], *key.shape[1:]), dtype=key.dtype, pin_memory=pin)
            host_value = torch.empty((slots.shape[0], *value.shape[1:]), dtype=value.dtype, pin_memory=pin)
            host_key.copy_(key.index_select(0, slots), non_blocking=pin)
            host_value.copy_(value.index_select(0, slots), non_blocking=pin)
            handle.append((host_key, host_value))
        if pin:
            torch.cuda.current_stream(device).synchronize()
        return handle

    def swap_in(self, handle, block_ids: list[int]) -> None:
        if not block_ids:
            return
        device = self.key_cache[0].device
        slots = self._block_slots(block_ids, device)
        for (host_key, host_value), key, value in zip(handle, self.key_cache, self.value_cache):
            if host_key.shape[0] != slots.shape[0]:
                raise ValueError(f"swap_in: {host_key.shape[0]} swapped slots for {slots.shape[0]} slots")
            key.index_copy_(0, slots, host_key.to(device, non_blocking=True))
            value.index_copy_(0, slots, host_value.to(device, non_blocking=True))

    def discard_swapped(self, handle) -> None:
        handle.clear()

    # ---- host KV tier: per-layer host tensors of the cache's shape ([slots, kvh, d]) --------
    def allocate_host_tier(self, num_host_blocks: int) -> int:
        rows = num_host_blocks * self.block_size
        self.host_key_cache = [torch.zeros((rows, *k.shape[1:]), dtype=k.dtype) for k in self.key_cache]
        self.host_value_cache = [torch.zeros((rows, *v.shape[1:]), dtype=v.dtype) for v in self.value_cache]
        return sum(k[: self.block_size].nbytes + v[: self.block_size].nbytes
                   for k, v in zip(self.key_cache, self.value_cache))

    def offload_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        device = self.key_cache[0].device
        sources = self._block_slots([block for block, _ in copies], device)
        destinations = self._block_slots([slot for _, slot in copies], "cpu")
        for key, value, host_key, host_value in zip(self.key_cache, self.value_cache, self.host_key_cache,
                                                    self.host_value_cache):
            host_key.index_copy_(0, destinations, key.index_select(0, sources).cpu())
            host_value.index_copy_(0, destinations, value.index_select(0, sources).cpu())

    def onload_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        device = self.key_cache[0].device
        sources = self._block_slots([slot for slot, _ in copies], "cpu")
        destinations = self._block_slots([block for _, block in copies], device)
        for key, value, host_key, host_value in zip(self.key_cache, self.value_cache, self.host_key_cache,
                                                    self.host_value_cache):
            key.index_copy_(0, destinations, host_key.index_select(0, sources).to(device))
            value.index_copy_(0, destinations, host_value.index_select(0, sources).to(device))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        device = self.key_cache[0].device
        sources = self._block_slots([source for source, _ in copies], device)
        destinations = self._block_slots([destination for _, destination in copies], device)
        for key, value in zip(self.key_cache, self.value_cache):
            key.index_copy_(0, destinations, key.index_select(0, sources))
            value.index_copy_(0, destinations, value.index_select(0, sources))
