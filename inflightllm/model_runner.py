"""Runs one scheduled step: packs it into flat tensors, runs the model, returns the
logits of each sampling request's last position. Knows tensors, not policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflightllm.attention import AttentionBackend, SequenceSlice, make_attention_backend
from inflightllm.models.loader import LoadedModel
from inflightllm.scheduler import SchedulerOutput


@dataclass
class StepResult:
    logits: torch.Tensor  # [num_sampling_requests, vocab_size] float32
    sampling_indices: list[int]  # positions in scheduler_output.scheduled that sampled


class ModelRunner:
    """Owns the model and the KV cache of one device."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, device_kind: str = "cpu"):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        arch = loaded.arch
        self.attention: AttentionBackend = make_attention_backend(
            device_kind,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            sliding_window=arch.sliding_window,
        )
        self.attention.allocate_kv_cache(
            num_blocks, block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim, loaded.dtype, self.device
        )

    def execute(self, scheduler_output: SchedulerOutput) -> StepResult:
        sequences: list[SequenceSlice] = []
        token_chunks: list[list[int]] = []
        last_positions: list[int] = []
        sampling_indices: list[int] = []
        offset = 0
        for index, item in enumerate(scheduler_output.scheduled):
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            token_chunks.append(request.token_ids[start:end])
            sequences.append(
                SequenceSlice(
                    query_start=offset,
                    query_len=item.num_new_tokens,
                    context_len=end,
                    block_table=tuple(request.block_table),
                )
            )
            offset += item.num_new_tokens
            if item.samples:
                last_positions.append(offset - 1)
                sampling_indices.append(index)
        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.int64, device=self.device)
        metadata = self.attention.build_metadata(sequences, self.device)
        hidden = self.model(input_ids, self.attention, metadata)  # [num_tokens, hidden]
        if last_positions:
            selected = hidden[torch.tensor(last_positions, dtype=torch.int64, device=self.device)]
            logits = self.model.compute_logits(selected)
        else:
            logits = torch.empty(0, self.loaded.arch.vocab_size, dtype=torch.float32, device=self.device)
        return StepResult(logits=logits, sampling_indices=sampling_indices)
