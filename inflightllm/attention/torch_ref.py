"""Pure-torch paged attention: the exact CPU reference.

The cache of each layer is a flat tensor of slots, [num_blocks * block_size,
num_kv_heads, head_dim] (a view of [num_blocks, block_size, ...]); a token's slot is
`block_table[position // block_size] * block_size + position % block_size`.

Prefill chunks attend one sequence at a time over the K/V gathered from its blocks,
with `scaled_dot_product_attention` called the way `transformers` calls it for a single
unpadded sequence (causal for a whole prompt). Decodes (one query each) attend in one
batched call over their contexts padded to the longest, padding masked out. Greedy
outputs match `transformers` on the same weights (tests/test_exactness.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inflightllm.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    HostSwapMixin,
    SequenceSlice,
)
from inflightllm.quantization.fp8 import FP8_DTYPE, quantize_with_scale


class TorchReferenceAttention(HostSwapMixin, AttentionBackend):
    """Paged KV cache in torch tensors; attention with torch SDPA, one sequence at a time.
    Swapped-out blocks go to a separate pool of CPU tensors (HostSwapMixin).

    `kv_cache_dtype="fp8"`: the cache holds e4m3 values of K / k_scale and V / v_scale (per
    layer, from `kv_scales`; 1.0 where a checkpoint gives none, as vLLM does), stored as
    uint8 bytes; attention reads them back as e4m3 * scale in the query's dtype. This is
    the reference the CUDA kernels' FP8 cache is tested against."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", kv_scales: list[tuple[float, float]] | None = None):
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: allowed auto, fp8")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scales = kv_scales
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self.block_size = 0
        self.num_blocks = 0

    def allocate_kv_cache(self, num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype, device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        if self.kv_cache_dtype == "fp8":
            dtype = torch.uint8  # e4m3 bytes (index_copy_ of float8 tensors is not implemented on every device)
            if self.kv_scales is None:
                self.kv_scales = [(1.0, 1.0)] * num_layers
            elif len(self.kv_scales) != num_layers:
                raise ValueError(f"kv_scales: {len(self.kv_scales)} layers of scales for {num_layers} layers")
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def _slots(self, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end, dtype=torch.int64)
        return block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def build_metadata(self, sequences: list[SequenceSlice], device) -> AttentionMetadata:
        slot_chunks, position_chunks = [], []
        singles, multis = [], []  # decode sequences (one query, whole context) / the rest
        for index, seq in enumerate(sequences):
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            first = seq.context_len - seq.query_len
            slot_chunks.append(self._slots(table, first, seq.context_len))
            position_chunks.append(torch.arange(first, seq.context_len, dtype=torch.int64))
            mask = self._mask(seq)
            gather = self._slots(table, 0, seq.context_len)
            if mask is None:
                singles.append((index, gather))
            else:
                multis.append((index, gather.to(device), mask))
        empty = torch.empty(0, dtype=torch.int64)
        return AttentionMetadata(
            sequences=sequences,
            slot_mapping=torch.cat(slot_chunks).to(device) if slot_chunks else empty,
            positions=torch.cat(position_chunks).to(device) if position_chunks else empty,
            backend_data={"decode": self._decode_batch(sequences, singles, device), "others": multis},
        )

    @staticmethod
    def _decode_batch(sequences, singles, device):
        """All one-query sequences attended in one call: their contexts gathered into a
        padded [batch, longest] slot index, padding masked out."""
        if not singles:
            return None
        longest = max(gather.shape[0] for _, gather in singles)
        slots = torch.zeros(len(singles), longest, dtype=torch.int64)
        valid = torch.zeros(len(singles), longest, dtype=torch.bool)
        for row, (_, gather) in enumerate(singles):
            slots[row, : gather.shape[0]] = gather
            valid[row, : gather.shape[0]] = True
        token_index = torch.tensor([sequences[i].query_start for i, _ in singles], dtype=torch.int64)
        # All of one length: no mask at all (the same call as for a single sequence).
        mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
        return token_index.to(device), slots.to(device), mask

    def _mask(self, seq: SequenceSlice) -> torch.Tensor | None | str:
        """None: attend to everything (one query, no window); "causal": a whole prompt;
        else a boolean [query_len, context_len] mask (True = attend)."""
        first = seq.context_len - seq.query_len
        window = self.sliding_window
        if window is None or seq.context_len <= window:
            if seq.query_len == 1:
                return None
            if first == 0:
                return "causal"
        query_pos = torch.arange(first, seq.context_len).unsqueeze(1)  # [q, 1]
        key_pos = torch.arange(seq.context_len).unsqueeze(0)  # [1, ctx]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        return mask

    def _write(self, layer_index: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor):
        """Store the new K/V (quantized for an FP8 cache); returns a reader of cache rows."""
        key_cache = self.key_cache[layer_index]
        value_cache = self.value_cache[layer_index]
        if self.kv_cache_dtype != "fp8":
            key_cache.index_copy_(0, slots, key)
            value_cache.index_copy_(0, slots, value)
            return lambda rows: (key_cache.index_select(0, rows), value_cache.index_select(0, rows))
        k_scale, v_scale = self.kv_scales[layer_index]
        key_cache.index_copy_(0, slots, quantize_with_scale(key, k_scale).view(torch.uint8))
        value_cache.index_copy_(0, slots, quantize_with_scale(value, v_scale).view(torch.uint8))
        dtype = key.dtype

        def read(rows: torch.Tensor):
            k = key_cache.index_select(0, rows).view(FP8_DTYPE).to(torch.float32) * k_scale
            v = value_cache.index_select(0, rows).view(FP8_DTYPE).to(torch.float32) * v_scale
            return k.to(dtype), v.to(dtype)

        return read

    def forward(self, layer_index, query, key, value, metadata: AttentionMetadata) -> torch.Tensor:
        read = self._write(layer_index, key, value, metadata.slot_mapping)

        output = torch.empty_like(query)
        decode = metadata.backend_data["decode"]
        if decode is not None:
            token_index, slots, mask = decode
            batch, longest = slots.shape
            q = query.index_select(0, token_index).unsqueeze(2)  # [batch, heads, 1, head_dim]
            flat = slots.reshape(-1)
            # [batch, kv_heads, longest, head_dim]
            k, v = read(flat)
            k = k.view(batch, longest, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, longest, self.num_kv_heads, self.head_dim).transpose(1, 2)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            output.index_copy_(0, token_index, attended.squeeze(2))
        for index, gather, mask in metadata.backend_data["others"]:
            seq = metadata.sequences[index]
            end = seq.query_start + seq.query_len
            # [1, heads, q, head_dim] and [1, kv_heads, ctx, head_dim]
            q = query[seq.query_start : end].transpose(0, 1).unsqueeze(0)
            k, v = read(gather)
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            if isinstance(mask, str):
                attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            output[seq.query_start : end] = attended.squeeze(0).transpose(0, 1)
        return output
