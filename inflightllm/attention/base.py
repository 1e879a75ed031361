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
