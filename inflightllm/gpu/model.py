"""The Llama family on the GPU: fused weights, fused layer kernels, a paged-attention backend.

q/k/v are one projection and gate/up one, fused at load time; RMSNorm (+ residual add),
RoPE and SiLU·mul are CuPy kernels (`ops`). Weights are created on the GPU in their
final dtype and filled in place: from safetensors tensor by tensor, or with seeded
random values (no host copy, no float32 copy). `hf_state_dict()` gives Hugging Face
named views of the same memory, so `transformers` can be loaded with identical weights.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.nn.functional as F

from inflightllm.gpu import fp8_split_k, ops
from inflightllm.model_source import ModelSpec, prepare
from inflightllm.models.llama import LlamaArch, mask_unsampleable, rope_inverse_frequencies
from inflightllm.models.loader import (
    TORCH_DTYPES,
    LoadedModel,
    check_fp8_lm_head,
    eos_token_ids,
    read_quantized_tensors,
    sampleable_vocab_size,
    smooth_before_quantizing,
)
from inflightllm.quantization.fp8 import (
    FP8_DTYPE,
    lm_head_q_max_rows,
    quantize_lm_head,
    quantize_per_channel,
)
from inflightllm.quantization.schemes import detect

logger = logging.getLogger(__name__)

SMALL_BATCH_ENV = "INFLIGHTLLM_SMALL_BATCH_KERNELS"
FP8_FAST_ACCUM_ENV = "INFLIGHTLLM_FP8_FAST_ACCUM"
# The fused linears that hold FP8 weights (with "<name>_scale" [1, N] float32 beside them),
# and the checkpoint modules each is made of, in order.
FP8_LINEARS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
SMALL_BATCH_MAX_TOKENS = 1


def small_batch_kernels_enabled(dtype: torch.dtype) -> bool:
    """Whether small steps (`SMALL_BATCH_MAX_TOKENS`) run the fused small-batch kernels (docs/GPU-ENGINE.md):
    `INFLIGHTLLM_SMALL_BATCH_KERNELS` = auto (default: for bf16 and fp16; float32 keeps cuBLAS,
    whose summation order the exactness tests against `transformers` rely on), on, or off."""
    setting = os.environ.get(SMALL_BATCH_ENV, "auto").strip().lower()
    if setting in ("on", "1", "true", "yes"):
        return True
    if setting in ("off", "0", "false", "no"):
        return False
    if setting != "auto":
        raise ValueError(f"{SMALL_BATCH_ENV}={setting!r}: use auto, on or off")
    return dtype in (torch.bfloat16, torch.float16)


class GpuLlama:
    """Packed-batch causal LM on one GPU: `forward` gives final hidden states,
    `compute_logits` the logits of selected rows.

    With `tp` (an inflightllm.parallel TensorParallelGroup) it holds one rank's share:
    its attention heads and KV heads (q/k/v column-parallel), its slice of the
    intermediate size (gate/up column-parallel), o and down row-parallel (all-reduced,
    biases added on rank 0 only), and the vocab rows of its range (embedding masked and
    all-reduced, LM head logits all-gathered). Without it, the whole model as before.

    `quantization="fp8"`: the decoder linears hold e4m3 weights with per-output-channel
    scales (quantized at load by `quantize_fp8`, or loaded so by `load_quantized`); each
    GEMM is `torch._scaled_mm` with row-wise scales, its input quantized per token by the
    kernel before it (add+RMSNorm, SiLU*mul, or a quantize pass after attention):
    docs/QUANTIZATION.md."""

    def __init__(
        self, arch: LlamaArch, dtype: torch.dtype, device: torch.device, max_positions: int, tp=None,
        quantization: str | None = None,
    ):
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization {quantization!r}: allowed None, 'fp8'")
        if quantization == "fp8" and tp is not None:
            raise ValueError("model.quantization fp8 runs on one GPU: tensor_parallel_size must be 1")
        self.quantization = quantization
        self.fp8 = False  # True once the linears hold FP8 weights
        self.lm_head_q: tuple[torch.Tensor, torch.Tensor] | None = None  # quantize_lm_head
        self.fp8_fast_accum = os.environ.get(FP8_FAST_ACCUM_ENV, "0").strip() in ("1", "on", "true", "yes")
        self.fp8_small_m_rows = ops.fp8_small_m_rows()  # FP8 GEMMs up to this many rows: fp8_small_m_gemm
        self.fp8_split_k = fp8_split_k.setting()  # INFLIGHTLLM_FP8_SPLIT_K (off: None); _prepare_split_k
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.tp = tp
        self.sampleable_vocab_size: int | None = None  # see LlamaForCausalLM
        rank, size = (tp.rank, tp.world_size) if tp is not None else (0, 1)
        self.num_heads = arch.num_heads // size  # this rank's
        self.num_kv_heads = arch.num_kv_heads // size
        self.intermediate_size = arch.intermediate_size // size
        per_rank_vocab = -(-arch.vocab_size // size)
        self.vocab_start = min(rank * per_rank_vocab, arch.vocab_size)
        self.vocab_end = min(self.vocab_start + per_rank_vocab, arch.vocab_size)
        self.per_rank_vocab = per_rank_vocab
        hidden, inter = arch.hidden_size, self.intermediate_size
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        # With FP8 weights too: the small-batch kernels read e4m3 rows (dequantized in registers).
        self.small_batch_kernels = small_batch_kernels_enabled(dtype)
        # Steps of up to this many tokens take them; more rows make them compute-bound on CUDA
        # cores (16-bit weights, measured on the H200: faster than cuBLAS at 1 token, slower from
        # 2; FP8 weights, one H100: at 2 tokens 4.24 ms against 3.91 with fp8_small_m_gemm's GEMMs).
        self.small_batch_max_tokens = SMALL_BATCH_MAX_TOKENS

        def empty(*shape):
            return torch.empty(*shape, dtype=dtype, device=device)

        vocab_rows = self.vocab_end - self.vocab_start
        self.embed = empty(vocab_rows, hidden)
        self.lm_head = self.embed if arch.tie_word_embeddings else empty(vocab_rows, hidden)
        self.final_norm = empty(hidden)
        self.layers = []
        for _ in range(arch.num_layers):
            layer = {
                "input_norm": empty(hidden),
                "post_norm": empty(hidden),
                "qkv": empty(self.q_size + 2 * self.kv_size, hidden),
                "o": empty(hidden, self.q_size),
                "gate_up": empty(2 * inter, hidden),
                "down": empty(hidden, inter),
            }
            if arch.attention_bias:
                layer["qkv_bias"] = empty(self.q_size + 2 * self.kv_size)
                if arch.model_type == "llama":
                    layer["o_bias"] = empty(hidden)
            if arch.mlp_bias:
                layer["gate_up_bias"] = empty(2 * inter)
                layer["down_bias"] = empty(hidden)
            self.layers.append(layer)
        # RoPE table [max_positions, head_dim]: cos (first half) | sin (second half), computed
        # as transformers does (float32 angles, then cast to the weights' dtype).
        inv_freq = rope_inverse_frequencies(arch).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.int64)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).contiguous()

    # ---- weights ----------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face parameter names -> views into the fused tensors."""
        names: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.final_norm,
        }
        if not self.arch.tie_word_embeddings:
            names["lm_head.weight"] = self.lm_head
        q, kv, inter = self.q_size, self.kv_size, self.intermediate_size
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            names[prefix + "input_layernorm.weight"] = layer["input_norm"]
            names[prefix + "post_attention_layernorm.weight"] = layer["post_norm"]
            names[prefix + "self_attn.q_proj.weight"] = layer["qkv"][:q]
            names[prefix + "self_attn.k_proj.weight"] = layer["qkv"][q : q + kv]
            names[prefix + "self_attn.v_proj.weight"] = layer["qkv"][q + kv :]
            names[prefix + "self_attn.o_proj.weight"] = layer["o"]
            names[prefix + "mlp.gate_proj.weight"] = layer["gate_up"][:inter]
            names[prefix + "mlp.up_proj.weight"] = layer["gate_up"][inter:]
            names[prefix + "mlp.down_proj.weight"] = layer["down"]
            if "qkv_bias" in layer:
                names[prefix + "self_attn.q_proj.bias"] = layer["qkv_bias"][:q]
                names[prefix + "self_attn.k_proj.bias"] = layer["qkv_bias"][q : q + kv]
                names[prefix + "self_attn.v_proj.bias"] = layer["qkv_bias"][q + kv :]
            if "o_bias" in layer:
                names[prefix + "self_attn.o_proj.bias"] = layer["o_bias"]
            if "gate_up_bias" in layer:
                names[prefix + "mlp.gate_proj.bias"] = layer["gate_up_bias"][:inter]
                names[prefix + "mlp.up_proj.bias"] = layer["gate_up_bias"][inter:]
                names[prefix + "mlp.down_proj.bias"] = layer["down_bias"]
        return names

    def shard_of(self, name: str) -> tuple[int, int, int] | None:
        """How this rank's tensor `name` sits in the whole one: (dim, start, length), or
        None when it holds the whole tensor."""
        if self.tp is None:
            return None
        rank, head_dim = self.tp.rank, self.arch.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab_start, self.vocab_end - self.vocab_start
        leaf = name.split(".", 3)[-1]  # e.g. "self_attn.q_proj.weight"
        if leaf.startswith("self_attn.q_proj."):
            return 0, rank * self.q_size, self.q_size
        if leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            return 0, rank * self.kv_size, self.kv_size
        if leaf == "self_attn.o_proj.weight":
            return 1, rank * self.num_heads * head_dim, self.q_size
        if leaf.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            return 0, rank * self.intermediate_size, self.intermediate_size
        if leaf == "mlp.down_proj.weight":
            return 1, rank * self.intermediate_size, self.intermediate_size
        return None  # norms, o/down biases: whole on every rank

    def _full_shape(self, name: str, tensor: torch.Tensor) -> tuple[int, ...]:
        shard = self.shard_of(name)
        shape = list(tensor.shape)
        if shard is not None:
            dim = shard[0]
            shape[dim] = self.arch.vocab_size if "embed" in name or "lm_head" in name else shape[dim] * self.tp.world_size
        return tuple(shape)

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Seeded random weights drawn on the GPU (norms 1, biases 0, the rest N(0, 0.02)).
        A tensor-parallel rank draws each whole tensor as one GPU would and keeps its
        share, so its weights are those of the single-GPU model."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        for name, tensor in sorted(self.hf_state_dict().items()):
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith(".bias"):
                tensor.zero_()
            elif self.tp is None:
                tensor.normal_(0.0, 0.02, generator=generator)
            else:
                whole = torch.empty(self._full_shape(name, tensor), dtype=self.dtype, device=self.device)
                whole.normal_(0.0, 0.02, generator=generator)
                dim, start, length = self.shard_of(name) or (0, 0, whole.shape[0])
                tensor.copy_(whole.narrow(dim, start, length))
                del whole

    @torch.no_grad()
    def load_safetensors(self, folder) -> None:
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}")
        expected = self.hf_state_dict()
        loaded: set[str] = set()
        for file in files:
            with safe_open(str(file), framework="pt", device=str(self.device)) as handle:
                for name in handle.keys():
                    if name not in expected:
                        if name.endswith("rotary_emb.inv_freq") or (
                            name == "lm_head.weight" and self.arch.tie_word_embeddings
                        ):
                            continue
                        raise KeyError(f"{file.name}: unexpected weight {name!r} for this architecture")
                    shard = self.shard_of(name)
                    if shard is None:
                        expected[name].copy_(handle.get_tensor(name))
                    else:
                        dim, start, length = shard
                        expected[name].copy_(handle.get_tensor(name).narrow(dim, start, length))
                    loaded.add(name)
        missing = set(expected) - loaded
        if missing:
            raise KeyError(f"weights missing from {folder}: {sorted(missing)[:5]}")

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """FP8 at load: each fused linear's weight becomes e4m3 with per-output-channel
        scales (quantization.fp8.quantize_per_channel, row by row of the fused weight: the
        same values as quantizing q, k, v or gate, up one by one). Frees the 16-bit copies."""
        if self.fp8:
            return
        for layer in self.layers:
            for name in FP8_LINEARS:
                weight_q, scale = quantize_per_channel(layer[name])
                layer[name] = weight_q
                layer[name + "_scale"] = scale.view(1, -1).contiguous()
        self.fp8 = True
        self._prepare_split_k()
        torch.cuda.empty_cache()

    @torch.no_grad()
    def quantize_lm_head(self, kind: str = "e4m3") -> None:
        """model.fp8_lm_head ("e4m3") / int8_lm_head ("int8"): an 8-bit copy of the LM head
        (per-row scales) beside the 16-bit one, read weight-only by steps of at most
        `fp8.lm_head_q_max_rows` rows (`compute_logits`, small_gemv; quantization.fp8)."""
        weight_q, scale = quantize_lm_head(self.lm_head, kind)
        self.lm_head_q = (weight_q, scale.view(1, -1).contiguous())

    @torch.no_grad()
    def load_quantized(self, folder, scheme) -> list[tuple[float, float]] | None:
        """A pre-quantized FP8 checkpoint (quantization.schemes) as published: its e4m3
        weights and their scales (per tensor or per channel, as per-channel vectors) go into
        the fused linears; a decoder linear the scheme leaves unquantized is quantized per
        channel here. Returns the per-layer K/V cache scales, or None."""
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}")
        plain, weights, scales, kv_scales = read_quantized_tensors(files, scheme, self.arch.num_layers)
        expected = self.hf_state_dict()
        loaded: set[str] = set()
        for name, tensor in plain.items():
            if name not in expected:
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.arch.tie_word_embeddings):
                    continue
                raise KeyError(f"unexpected weight {name!r} for this architecture in {folder}")
            expected[name].copy_(tensor.to(self.device))
            loaded.add(name)
        for index, layer in enumerate(self.layers):
            for fused, modules in FP8_LINEARS.items():
                parts, part_scales = [], []
                for module in modules:
                    full = f"model.layers.{index}.{module}"
                    if full in weights:
                        parts.append(weights[full].to(self.device).view(torch.uint8))
                        part_scales.append(scales[full].to(self.device, torch.float32))
                    elif full + ".weight" in loaded:  # left unquantized by the checkpoint
                        weight_q, scale = quantize_per_channel(expected[full + ".weight"])
                        parts.append(weight_q.view(torch.uint8))
                        part_scales.append(scale)
                    else:
                        raise KeyError(f"weights missing from {folder}: {full}.weight")
                    loaded.add(full + ".weight")
                layer[fused] = torch.cat(parts).view(FP8_DTYPE).contiguous()
                layer[fused + "_scale"] = torch.cat(part_scales).view(1, -1).contiguous()
        missing = set(expected) - loaded
        if missing:
            raise KeyError(f"weights missing from {folder}: {sorted(missing)[:5]}")
        self.fp8 = True
        self._prepare_split_k()
        torch.cuda.empty_cache()
        return kv_scales

    def _prepare_split_k(self) -> None:
        """INFLIGHTLLM_FP8_SPLIT_K: each chosen linear's weights as K slices (views, no copies:
        fp8_split_k), once the check on layer 0 shows this GPU's torch computes torch._scaled_mm's
        product with them; otherwise split-K off, with the reason logged."""
        split = self.fp8_split_k
        if split is None:
            return
        first = self.layers[0]
        names = [name for name in split.linears if fp8_split_k.splits(first[name], split.parts)]
        reason = fp8_split_k.unsupported(self.device)
        if reason is None and not names:
            reason = f"the K of {', '.join(split.linears)} does not split into {split.parts} slices of a multiple of 16"
        if reason is None:
            split, reason = fp8_split_k.check(first[names[0]], first[names[0] + "_scale"], split)
        if split is None:
            logger.warning("%s: split-K off: %s", fp8_split_k.SPLIT_K_ENV, reason)
            self.fp8_split_k = None
            return
        self.fp8_split_k = split
        for layer in self.layers:
            for name in names:
                layer[name + "_split_k"] = fp8_split_k.weight_slices(layer[name], layer[name + "_scale"], split.parts)
        logger.info("FP8 split-K: %s in %d slices of K from %d to %d rows (%s)", ", ".join(names),
                    split.parts, self.fp8_small_m_rows + 1, split.max_rows, reason)

    def _fp8_mm(self, x_q: torch.Tensor, x_scale: torch.Tensor, layer: dict, name: str,
                bias: torch.Tensor | None) -> torch.Tensor:
        """x_q [M, K] e4m3 with scales [M, 1] times layer[name] [N, K] e4m3 with channel scales
        [1, N] -> [M, N] in the model's dtype (row-wise scaled GEMMs give bf16 out); a few rows
        (up to fp8_small_m_rows) by ops.fp8_small_m_gemm."""
        weight = layer[name]
        if x_q.shape[0] <= self.fp8_small_m_rows and ops.fp8_small_m_ok(x_q.shape[0], x_q.shape[1], self.device.index):
            out = torch.empty(x_q.shape[0], weight.shape[0], dtype=self.dtype, device=self.device)
            return ops.fp8_small_m_gemm(out, x_q, x_scale.view(-1), weight, layer[name + "_scale"].view(-1), bias)
        split = self.fp8_split_k
        slices = layer.get(name + "_split_k") if split is not None and x_q.shape[0] <= split.max_rows else None
        if slices is not None:  # INFLIGHTLLM_FP8_SPLIT_K
            out = fp8_split_k.split_k_mm(x_q, x_scale, *slices, split.flat_scales)
            bias_added = False
        else:
            bias_added = self.dtype == torch.bfloat16
            out = torch._scaled_mm(
                x_q, weight.t(), scale_a=x_scale, scale_b=layer[name + "_scale"],
                bias=bias if bias_added else None, out_dtype=torch.bfloat16,
                use_fast_accum=self.fp8_fast_accum,
            )
        if self.dtype != torch.bfloat16:
            out = out.to(self.dtype)
        if bias is not None and not bias_added:
            out += bias
        return out

    def _forward_fp8(self, residual: torch.Tensor, positions: torch.Tensor, attention, metadata) -> torch.Tensor:
        """`forward` with FP8 linears: the residual stream and attention stay in the model's
        dtype; each GEMM's input is quantized per token by the kernel that produces it."""
        eps = self.arch.rms_norm_eps
        num_tokens = residual.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.arch.head_dim
        q_end, k_end = self.q_size, self.q_size + self.kv_size

        def rows(width: int):
            return (torch.empty(num_tokens, width, dtype=FP8_DTYPE, device=self.device),
                    torch.empty(num_tokens, 1, dtype=torch.float32, device=self.device))

        x_q, x_scale = rows(self.arch.hidden_size)
        a_q, a_scale = rows(self.q_size)
        g_q, g_scale = rows(self.intermediate_size)
        delta = None  # the last o/down output, not yet added to the residual
        for index, layer in enumerate(self.layers):
            ops.add_rms_norm_fp8(x_q, x_scale, delta, residual, layer["input_norm"], eps)
            qkv = self._fp8_mm(x_q, x_scale, layer, "qkv", layer.get("qkv_bias"))
            q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
            ops.rotary(q, k, positions, self.cos_sin, heads, kv_heads, head_dim)
            attended = attention.forward(
                index,
                q.view(num_tokens, heads, head_dim),
                k.view(num_tokens, kv_heads, head_dim),
                v.view(num_tokens, kv_heads, head_dim),
                metadata,
            )
            ops.quant_rows_fp8(a_q, a_scale, attended.reshape(num_tokens, self.q_size).contiguous())
            delta = self._fp8_mm(a_q, a_scale, layer, "o", layer.get("o_bias"))
            ops.add_rms_norm_fp8(x_q, x_scale, delta, residual, layer["post_norm"], eps)
            gate_up = self._fp8_mm(x_q, x_scale, layer, "gate_up", layer.get("gate_up_bias"))
            ops.silu_and_mul_fp8(g_q, g_scale, gate_up)
            delta = self._fp8_mm(g_q, g_scale, layer, "down", layer.get("down_bias"))
        ops.add_rms_norm(delta, residual, self.final_norm, eps)
        return delta

    # ---- forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention, metadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> normed hidden [num_tokens, hidden].
        Must run inside `ops.torch_stream()`."""
        arch = self.arch
        eps = arch.rms_norm_eps
        num_tokens = input_ids.shape[0]
        tp = self.tp
        residual = self._embed(input_ids)
        if (self.small_batch_kernels and num_tokens <= self.small_batch_max_tokens
                and ops.small_batch_ok(num_tokens, arch.hidden_size, self.dtype)):
            return self._forward_small(residual, positions, attention, metadata)
        if self.fp8:
            return self._forward_fp8(residual, positions, attention, metadata)
        hidden = torch.empty_like(residual)
        ops.rms_norm(hidden, residual, self.layers[0]["input_norm"], eps)
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, arch.head_dim
        # Row-parallel biases are added once (on rank 0), before the all-reduce.
        row_bias = tp is None or tp.rank == 0
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        for index, layer in enumerate(self.layers):
            if index > 0:
                ops.add_rms_norm(hidden, residual, layer["input_norm"], eps)
            qkv = F.linear(hidden, layer["qkv"], layer.get("qkv_bias"))  # [num_tokens, q + 2 kv]
            q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
            ops.rotary(q, k, positions, self.cos_sin, heads, kv_heads, head_dim)
            attended = attention.forward(
                index,
                q.view(num_tokens, heads, head_dim),
                k.view(num_tokens, kv_heads, head_dim),
                v.view(num_tokens, kv_heads, head_dim),
                metadata,
            )  # [num_tokens, heads, head_dim]
            hidden = F.linear(attended.reshape(num_tokens, self.q_size), layer["o"], layer.get("o_bias") if row_bias else None)
            if tp is not None:
                tp.all_reduce(hidden)
            ops.add_rms_norm(hidden, residual, layer["post_norm"], eps)
            gate_up = F.linear(hidden, layer["gate_up"], layer.get("gate_up_bias"))  # [num_tokens, 2 * inter]
            activated = ops.silu_and_mul(
                torch.empty(num_tokens, self.intermediate_size, dtype=self.dtype, device=self.device), gate_up
            )
            hidden = F.linear(activated, layer["down"], layer.get("down_bias") if row_bias else None)
            if tp is not None:
                tp.all_reduce(hidden)
        ops.add_rms_norm(hidden, residual, self.final_norm, eps)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's first rows [num_tokens, hidden]."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        # vocab-parallel: this rank's rows, zeros elsewhere, summed over the ranks
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        residual = F.embedding((input_ids - self.vocab_start) * inside, self.embed)
        residual.mul_(inside.unsqueeze(1).to(residual.dtype))
        self.tp.all_reduce(residual)
        return residual

    def _forward_small(self, residual: torch.Tensor, positions: torch.Tensor, attention, metadata) -> torch.Tensor:
        """`forward` for a few tokens (at most 8) with the fused small-batch kernels: per layer, a
        qkv GEMV with the residual add + RMSNorm in its prologue and RoPE in its epilogue,
        attention, an o GEMV, a gate/up GEMV with add + RMSNorm before and SiLU*mul after,
        and a down GEMV. The residual alternates between two buffers (a kernel's blocks read
        one while its first block writes the sum to the other)."""
        eps = self.arch.rms_norm_eps
        tp = self.tp
        num_tokens, hidden_size = residual.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.arch.head_dim
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        row_bias = tp is None or tp.rank == 0
        spare = torch.empty_like(residual)
        delta = None  # the last o/down output, not yet added to the residual
        # Under TP the o/down GEMVs all-reduce their rows themselves where the ranks' buffers
        # allow (TensorParallelGroup.fused_all_reduce); else an all-reduce follows them.
        fused = tp.fused_all_reduce(residual.numel() * residual.element_size()) if tp is not None else None
        # The qkv kernel writes K/V into the paged cache itself when the backend's cache is
        # the plain [blocks, block_size, kv_heads, head_dim] one of the CUDA backend.
        caches = getattr(attention, "key_cache", None), getattr(attention, "value_cache", None)
        slots = getattr(metadata, "slot_mapping", None)
        kv_in_kernel = (
            slots is not None and caches[0] is not None and len(caches[0]) == len(self.layers)
            and getattr(attention, "dtype", None) == self.dtype
        )
        for index, layer in enumerate(self.layers):
            qkv = torch.empty(num_tokens, k_end + self.kv_size, dtype=self.dtype, device=self.device)
            ops.qkv_norm_rope(
                qkv, residual, delta, spare, layer["input_norm"], layer["qkv"], layer.get("qkv_bias"),
                positions, self.cos_sin, heads, kv_heads, head_dim, eps,
                *((slots, caches[0][index], caches[1][index]) if kv_in_kernel else (None, None, None)),
                weight_scale=layer.get("qkv_scale"),
            )
            if delta is not None:
                residual, spare = spare, residual
            attended = attention.forward(
                index,
                qkv[:, :q_end].view(num_tokens, heads, head_dim),
                qkv[:, q_end:k_end].view(num_tokens, kv_heads, head_dim),
                qkv[:, k_end:].view(num_tokens, kv_heads, head_dim),
                metadata,
                **({"kv_written": True} if kv_in_kernel else {}),
            )
            delta = ops.small_gemv(
                torch.empty(num_tokens, hidden_size, dtype=self.dtype, device=self.device),
                attended.reshape(num_tokens, self.q_size).contiguous(), layer["o"],
                layer.get("o_bias") if row_bias else None, fused=fused, weight_scale=layer.get("o_scale"),
            )
            if tp is not None and fused is None:
                tp.all_reduce(delta)
            activated = torch.empty(num_tokens, self.intermediate_size, dtype=self.dtype, device=self.device)
            ops.gate_up_norm_silu(
                activated, residual, delta, spare, layer["post_norm"], layer["gate_up"], layer.get("gate_up_bias"), eps,
                weight_scale=layer.get("gate_up_scale"),
            )
            residual, spare = spare, residual
            delta = ops.small_gemv(
                torch.empty(num_tokens, hidden_size, dtype=self.dtype, device=self.device), activated, layer["down"],
                layer.get("down_bias") if row_bias else None, fused=fused, weight_scale=layer.get("down_scale"),
            )
            if tp is not None and fused is None:
                tp.all_reduce(delta)
        ops.add_rms_norm(delta, residual, self.final_norm, eps)
        return delta

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size], contiguous; -inf from
        `sampleable_vocab_size` on (ids the tokenizer does not have). In `dtype`, or with
        None in the model's own dtype, as the LM head computes them (the runner's choice:
        the GPU sampler converts to float32 only where a step needs it, docs/GPU-ENGINE.md)."""
        rows = hidden.shape[0]
        if (self.lm_head_q is not None and rows <= lm_head_q_max_rows(self.lm_head_q[0])
                and self.small_batch_kernels and ops.small_batch_ok(rows, self.arch.hidden_size, self.dtype)):
            weight_q, scale = self.lm_head_q
            logits = ops.small_gemv(torch.empty(rows, weight_q.shape[0], dtype=self.dtype, device=self.device),
                                    hidden.contiguous(), weight_q, None, weight_scale=scale)
        else:
            logits = F.linear(hidden, self.lm_head)  # [n, this rank's vocab rows] under TP
        if self.tp is not None:
            if logits.shape[1] < self.per_rank_vocab:
                logits = F.pad(logits, (0, self.per_rank_vocab - logits.shape[1]), value=float("-inf"))
            logits = self.tp.all_gather_last(logits)[:, : self.arch.vocab_size]
        logits = logits.to(dtype) if dtype is not None else logits
        return mask_unsampleable(logits.contiguous(), self.sampleable_vocab_size)


def gpu_device(config) -> torch.device:
    """The engine's GPU: the first of the profile's gpu_ids, else the current device."""
    index = config.gpu_ids[0] if config.gpu_ids else torch.cuda.current_device()
    return torch.device("cuda", index)


def model_len(spec: ModelSpec, arch: LlamaArch, config) -> int:
    """The longest sequence this engine can hold: the model's context, capped by the
    longest request the engine accepts (prompt + output)."""
    limit = spec.max_model_len or arch.max_position_embeddings
    return min(limit, config.max_input_length + config.max_output_len)


# The GPUs the kernels are built for: compute capability 8.0 or later (cp.async and bf16 in the
# attention kernels: Ampere, Ada, Hopper). FP8 weights need FP8 tensor cores (torch._scaled_mm):
# 8.9 or later. The FP8 KV cache runs on any of them (the e4m3 conversions are done in software
# below 8.9, gpu/pdl.cuh); the Hopper kernels (paged_decode_v6, silu_and_mul_fp8_tma, PDL) are
# taken only on 9.0 and later.
MIN_CAPABILITY = (8, 0)
FP8_MIN_CAPABILITY = (8, 9)


def check_capability(device: torch.device, quantization: str | None) -> None:
    """Refuse, with the GPU named, a GPU the engine's kernels do not run on, or FP8 weights on
    a GPU without FP8 tensor cores."""
    capability = tuple(torch.cuda.get_device_capability(device))
    name = torch.cuda.get_device_name(device)
    found = f"{device} ({name}) has compute capability {capability[0]}.{capability[1]}"
    if capability < MIN_CAPABILITY:
        raise ValueError(f"the GPU engine needs compute capability 8.0 or later (Ampere, Ada, Hopper): {found}")
    if quantization == "fp8" and capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"model.quantization fp8 (or an FP8 checkpoint) needs FP8 tensor cores, compute capability "
            f"8.9 or later (Ada, Hopper): {found}. Serve the 16-bit weights there (no model.quantization); "
            "engine.kv_cache_dtype fp8 works on this GPU"
        )


def load_gpu_model(spec: ModelSpec, config, tp=None, device=None) -> LoadedModel:
    """Build the fused model of `spec` directly on the engine's GPU. With tensor
    parallelism: `tp` and `device` give one rank's share on its GPU; called without them
    for a tensor-parallel engine, nothing is loaded here (model None): the
    tensor-parallel runner loads each rank's share once the ranks are joined."""
    device = device if device is not None else gpu_device(config)
    torch.cuda.set_device(device)
    dtype = TORCH_DTYPES[spec.dtype]
    folder = prepare(spec)
    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch = LlamaArch.from_config(hf_config)
    scheme = detect(folder, hf_config) if spec.source == "hf_folder" else None
    quantization = "fp8" if scheme is not None or spec.quantization == "fp8" else None
    head_kind = spec.lm_head_kind()  # refused before any weight is read
    if spec.fp8_lm_head:
        check_fp8_lm_head(spec, quantization == "fp8")
    tensor_parallel = tp is not None or getattr(config, "tensor_parallel_size", 1) > 1
    if head_kind == "int8" and tensor_parallel:
        raise ValueError("model.int8_lm_head runs on one GPU for now: set engine.tensor_parallel_size to 1 "
                         "(or drop model.int8_lm_head)")
    if quantization and tensor_parallel:
        raise ValueError(
            "model.quantization fp8 (or an FP8 checkpoint) runs on one GPU for now: "
            "set engine.tensor_parallel_size to 1"
        )
    check_capability(device, quantization)
    if tp is None and getattr(config, "tensor_parallel_size", 1) > 1:
        return LoadedModel(
            model=None, arch=arch, config=hf_config, folder=folder,
            eos_token_ids=eos_token_ids(folder, hf_config), dtype=dtype, device=device, spec=spec,
        )
    model = GpuLlama(arch, dtype, device, max_positions=model_len(spec, arch, config), tp=tp,
                     quantization=quantization)
    model.sampleable_vocab_size = sampleable_vocab_size(folder, arch.vocab_size)
    kv_scales = None
    if spec.source == "random":
        model.init_random(spec.seed)
    elif scheme is not None:
        kv_scales = model.load_quantized(folder, scheme)
    else:
        model.load_safetensors(folder)
    if quantization == "fp8":
        if scheme is None and spec.fp8_smoothing:
            smooth_before_quantizing(model.hf_state_dict(), arch, spec)
        model.quantize_fp8()
    if head_kind is not None:
        model.quantize_lm_head(head_kind)
    torch.cuda.synchronize(device)
    size = sum(t.numel() * t.element_size() for t in model.hf_state_dict().values())
    logger.info(
        "model on %s: %s%s, %.2f GiB of weights%s", device, spec.dtype,
        f" with FP8 e4m3 linears ({scheme.method if scheme else 'quantized at load'})" if quantization else "",
        size / 2**30, f" (tensor-parallel rank {tp.rank} of {tp.world_size})" if tp is not None else "",
    )
    return LoadedModel(
        model=model,
        arch=arch,
        config=hf_config,
        folder=folder,
        eos_token_ids=eos_token_ids(folder, hf_config),
        dtype=dtype,
        device=device,
        spec=spec,
        quantization=quantization,
        kv_scales=kv_scales,
    )
