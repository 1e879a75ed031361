"""The Llama family in our own torch code: Llama 2/3 (incl. Llama-3 RoPE scaling),
Mistral (sliding window), Qwen2 (QKV bias), SmolLM2.

RMSNorm, SwiGLU, grouped-query attention, tied embeddings. The model runs on packed
batches with no padding: hidden states are [num_tokens, hidden_size]; attention goes
through an AttentionBackend (paged KV cache). Parameter names follow Hugging Face's,
so a `transformers` state dict loads as is. The arithmetic follows `transformers`'
order of operations, so fp32 greedy outputs are equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inflightllm.attention.base import AttentionBackend, AttentionMetadata
from inflightllm.quantization.fp8 import linear_weight_only, lm_head_q_max_rows

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class LlamaArch:
    """The architecture numbers of one model, normalised from its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: dict) -> LlamaArch:
        model_type = config.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        # transformers 5 keeps RoPE settings in rope_parameters; 4.x in rope_theta/rope_scaling.
        rope = dict(config.get("rope_parameters") or {})
        scaling = config.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
            elif scaling["rope_type"] != "llama3":
                raise ValueError(f"RoPE scaling {scaling['rope_type']!r} is not supported; supported: llama3")
        sliding_window = config.get("sliding_window")
        if model_type == "qwen2" and not config.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
        )


def rope_inverse_frequencies(arch: LlamaArch) -> torch.Tensor:
    """[head_dim // 2] float32, as transformers computes them (incl. Llama-3 scaling)."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    scaling = arch.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(arch), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [num_tokens, head_dim], for the given positions."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, back to the input's dtype, times the weight."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weight, self.variance_epsilon)


class Attention(nn.Module):
    # Tensor parallel (inflightllm.parallel.shard): this rank's heads only, o_proj row-parallel.
    tp = None

    def __init__(self, arch: LlamaArch, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        bias = arch.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, arch.num_heads * arch.head_dim, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, arch.num_kv_heads * arch.head_dim, bias=bias)
        self.o_proj = nn.Linear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=arch.model_type == "llama" and arch.attention_bias)

    def forward(self, hidden, cos, sin, backend: AttentionBackend, metadata: AttentionMetadata):
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = backend.forward(self.layer_index, q, k, v, metadata)  # [num_tokens, heads, head_dim]
        if self.tp is not None:
            return _row_parallel(self.o_proj, out.reshape(num_tokens, self.num_heads * self.head_dim), self.tp)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


def _row_parallel(linear: nn.Linear, x: torch.Tensor, tp) -> torch.Tensor:
    """A row-parallel linear: this rank's partial product, summed over the ranks, then
    the bias once."""
    out = tp.all_reduce(F.linear(x, linear.weight))
    return out if linear.bias is None else out + linear.bias


class MLP(nn.Module):
    # Tensor parallel: gate/up column-parallel (this rank's columns), down row-parallel.
    tp = None

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, hidden):
        if self.tp is not None:
            return _row_parallel(self.down_proj, F.silu(self.gate_proj(hidden)) * self.up_proj(hidden), self.tp)
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, layer_index: int):
        super().__init__()
        self.self_attn = Attention(arch, layer_index)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, hidden, cos, sin, backend, metadata):
        residual = hidden
        hidden = self.input_layernorm(hidden)
        hidden = residual + self.self_attn(hidden, cos, sin, backend, metadata)
        residual = hidden
        hidden = self.post_attention_layernorm(hidden)
        return residual + self.mlp(hidden)


class LlamaBody(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch)


def mask_unsampleable(logits: torch.Tensor, sampleable_vocab_size: int | None) -> torch.Tensor:
    """`logits` [n, vocab_size] with columns from `sampleable_vocab_size` on set to -inf,
    in place (no host sync: CUDA graphs may capture it)."""
    if sampleable_vocab_size is not None and sampleable_vocab_size < logits.shape[-1]:
        logits[:, sampleable_vocab_size:] = float("-inf")
    return logits


class LlamaForCausalLM(nn.Module):
    """Packed-batch causal LM: `forward` gives hidden states, `compute_logits` the
    logits of selected positions only."""

    # Tensor parallel: vocab-parallel embedding and LM head (rows vocab_start:vocab_end).
    tp = None
    vocab_start = 0
    vocab_end = 0
    # Ids from here up are never sampled (their logits are -inf): the tokenizer has no
    # such ids (models/loader.py `sampleable_vocab_size`). None: every id of the model.
    sampleable_vocab_size: int | None = None
    # model.fp8_lm_head / int8_lm_head: (e4m3 or int8 [vocab, hidden], float32 scales [vocab])
    # of the LM head, read weight-only by steps of at most fp8.lm_head_q_max_rows rows (1 e4m3,
    # 4 int8). None: off.
    lm_head_q: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.arch = arch
        self.model = LlamaBody(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, backend: AttentionBackend, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        if self.tp is not None:
            hidden = self._vocab_parallel_embedding(input_ids)
        else:
            hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(metadata.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, backend, metadata)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden_size] -> float32 logits [n, vocab_size]; -inf from
        `sampleable_vocab_size` on."""
        if self.tp is not None:
            local = self.lm_head(hidden)  # [n, this rank's vocab rows], padded to an equal share
            per_rank = -(-self.arch.vocab_size // self.tp.world_size)
            if local.shape[1] < per_rank:
                local = F.pad(local, (0, per_rank - local.shape[1]), value=float("-inf"))
            logits = self.tp.all_gather_last(local)[:, : self.arch.vocab_size].float()
        elif self.lm_head_q is not None and hidden.shape[0] <= lm_head_q_max_rows(self.lm_head_q[0]):
            logits = linear_weight_only(hidden, *self.lm_head_q).float()
        else:
            logits = self.lm_head(hidden).float()
        return mask_unsampleable(logits, self.sampleable_vocab_size)

    def _vocab_parallel_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's vocab range, zeros elsewhere, summed over the ranks."""
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(inside, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        hidden = F.embedding(local_ids, self.model.embed_tokens.weight)
        hidden = hidden * inside.unsqueeze(1).to(hidden.dtype)
        return self.tp.all_reduce(hidden)
