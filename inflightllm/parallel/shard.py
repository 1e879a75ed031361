"""Shard the CPU model (`models/llama.py`) for one tensor-parallel rank, in place.

Megatron-style: q/k/v and gate/up are column-parallel (each rank keeps its attention
heads, its KV heads and its slice of the intermediate size), o_proj and down_proj are
row-parallel (partial products summed by an all-reduce, the bias added once), the
embedding and the LM head are vocab-parallel (rows of this rank's vocab range; the
embedding masks and all-reduces, the LM head all-gathers the logits).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from inflightllm.models.llama import LlamaArch, LlamaForCausalLM
from inflightllm.parallel.group import TensorParallelGroup, shard_range, vocab_range


def local_arch(arch: LlamaArch, world_size: int) -> LlamaArch:
    """The architecture one rank sees for its attention and KV cache: its share of the
    heads and KV heads (the vocab and hidden size stay whole)."""
    if arch.num_heads % world_size or arch.num_kv_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's {arch.num_heads} attention heads "
            f"and {arch.num_kv_heads} KV heads"
        )
    return dataclasses.replace(
        arch, num_heads=arch.num_heads // world_size, num_kv_heads=arch.num_kv_heads // world_size
    )


def _keep_rows(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _keep_columns(linear: nn.Linear, start: int, end: int) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, start:end].clone(), requires_grad=False)
    linear.in_features = end - start


@torch.no_grad()
def shard_llama(model: LlamaForCausalLM, tp: TensorParallelGroup) -> LlamaForCausalLM:
    """Keep this rank's share of every weight of the whole model `model`."""
    if model.lm_head_q is not None:
        raise ValueError("model.fp8_lm_head / model.int8_lm_head: the 8-bit LM head runs on one rank for now; "
                         "set engine.tensor_parallel_size to 1 (or drop the key)")
    arch = model.arch
    rank, size = tp.rank, tp.world_size
    local = local_arch(arch, size)
    head_dim = arch.head_dim
    q_start, q_end = shard_range(arch.num_heads, rank, size)
    kv_start, kv_end = shard_range(arch.num_kv_heads, rank, size)
    inter_start, inter_end = shard_range(arch.intermediate_size, rank, size)
    for layer in model.model.layers:
        attention = layer.self_attn
        _keep_rows(attention.q_proj, q_start * head_dim, q_end * head_dim)
        _keep_rows(attention.k_proj, kv_start * head_dim, kv_end * head_dim)
        _keep_rows(attention.v_proj, kv_start * head_dim, kv_end * head_dim)
        _keep_columns(attention.o_proj, q_start * head_dim, q_end * head_dim)
        attention.num_heads = local.num_heads
        attention.num_kv_heads = local.num_kv_heads
        attention.tp = tp
        mlp = layer.mlp
        _keep_rows(mlp.gate_proj, inter_start, inter_end)
        _keep_rows(mlp.up_proj, inter_start, inter_end)
        _keep_columns(mlp.down_proj, inter_start, inter_end)
        mlp.tp = tp
    vocab_start, vocab_end = vocab_range(arch.vocab_size, rank, size)
    embed = model.model.embed_tokens
    embed.weight = nn.Parameter(embed.weight.data[vocab_start:vocab_end].clone(), requires_grad=False)
    embed.num_embeddings = vocab_end - vocab_start
    if arch.tie_word_embeddings:
        model.lm_head.weight = embed.weight
    else:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.data[vocab_start:vocab_end].clone(), requires_grad=False)
    model.lm_head.out_features = vocab_end - vocab_start
    model.vocab_start, model.vocab_end = vocab_start, vocab_end
    model.tp = tp
    return model
