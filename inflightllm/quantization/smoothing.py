"""SmoothQuant for FP8 quantized at load: activation outliers moved into the weights.

Per-token FP8 activations lose the small channels of a token whose few outlier channels set
its scale. Smoothing divides each input channel j of a linear by s_j and multiplies the
weight's column j by s_j (the product is unchanged), with

    s_j = max|X_j| ** alpha / max|W_:,j| ** (1 - alpha)

where max|X_j| comes from a calibration pass over a text shipped with the package
(calibration.txt: a fixed snapshot of this project's docs, not the text the perplexity tool
scores). Every division is folded into a weight that already exists, so the model runs as
before, with no extra kernel:

- q/k/v's input: into `input_layernorm.weight` (the norm's output is their input);
- gate/up's input: into `post_attention_layernorm.weight`;
- down's input (SiLU(gate) * up): into the rows of `up_proj` (and its bias), since the
  product is linear in up.

The weights are then quantized as without smoothing (per output channel; a row scaled as a
whole, as up's rows are, quantizes to the same e4m3 values). The calibration pass is a plain
torch forward over Hugging Face-named weight tensors on their own device (`activation_maxima`),
so the CPU model and the GPU model (its `hf_state_dict()` views) smooth the same way; both call
`smooth_model_weights` on 16-bit weights before quantizing. SmolLM2-135M, alpha 0.5: perplexity
ratio to bf16 1.031x -> 1.011x (fp8 weights), 1.045x -> 1.021x (+ fp8 KV cache) on CPU emulation,
1.023x -> 1.014x and 1.039x -> 1.026x on the GPU: docs/QUANTIZATION.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inflightllm.models.llama import LlamaArch, RotaryEmbedding, apply_rotary, rms_norm

CALIBRATION_TEXT = Path(__file__).resolve().parent / "calibration.txt"
CALIBRATION_TOKENS = 4096
CALIBRATION_CHUNK = 512  # tokens a forward (each chunk attends to itself only)
MIN_VALUE = 1e-5  # floor of a channel's maxima and of s (a dead channel keeps a finite scale)


def _linear(x: torch.Tensor, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    bias = weights.get(name + ".bias")
    return torch.nn.functional.linear(x, weights[name + ".weight"].float(), None if bias is None else bias.float())


@torch.inference_mode()
def activation_maxima(weights: dict[str, torch.Tensor], arch: LlamaArch, token_ids: list[int],
                      chunk: int = CALIBRATION_CHUNK) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, the largest |value| of each input channel of its linears over
    `token_ids`, float32: {"qkv": [hidden], "gate_up": [hidden], "down": [intermediate]}.
    `weights`: Hugging Face names -> tensors (16-bit, on one device), a Llama decoder. The
    forward runs in float32 whatever the weights' dtype (each weight cast as it is used), so
    that the CPU and the GPU calibrate alike (a bf16 forward moves the resulting scales by up
    to ~4 % by the last layer, each device rounding its own way)."""
    embed = weights["model.embed_tokens.weight"]
    device, dtype = embed.device, torch.float32
    rotary = RotaryEmbedding(arch)
    h, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    maxima = [{} for _ in range(arch.num_layers)]

    def record(layer: int, key: str, x: torch.Tensor) -> None:
        value = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
        maxima[layer][key] = value if key not in maxima[layer] else torch.maximum(maxima[layer][key], value)

    for start in range(0, len(token_ids), chunk):
        ids = torch.tensor(token_ids[start : start + chunk], dtype=torch.int64, device=device)
        n = len(ids)
        cos, sin = rotary(torch.arange(n, device=device), dtype)
        hidden = embed[ids].float()
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            x = rms_norm(hidden, weights[p + "input_layernorm.weight"].float(), arch.rms_norm_eps)
            record(i, "qkv", x)
            q = apply_rotary(_linear(x, weights, p + "self_attn.q_proj").view(n, h, d), cos, sin)
            k = apply_rotary(_linear(x, weights, p + "self_attn.k_proj").view(n, kvh, d), cos, sin)
            v = _linear(x, weights, p + "self_attn.v_proj").view(n, kvh, d)
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(h // kvh, 1).transpose(0, 1),
                v.repeat_interleave(h // kvh, 1).transpose(0, 1), is_causal=True, scale=d**-0.5)
            hidden = hidden + _linear(attn.transpose(0, 1).reshape(n, h * d), weights, p + "self_attn.o_proj")
            x = rms_norm(hidden, weights[p + "post_attention_layernorm.weight"].float(), arch.rms_norm_eps)
            record(i, "gate_up", x)
            act = torch.nn.functional.silu(_linear(x, weights, p + "mlp.gate_proj")) * _linear(x, weights, p + "mlp.up_proj")
            record(i, "down", act)
            hidden = hidden + _linear(act, weights, p + "mlp.down_proj")
    return maxima


def smoothing_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [K] for the input channels of `weights` ([N_i, K] each, sharing the input):
    max|X_j|^alpha / max_i max|W_i[:, j]|^(1 - alpha), floored at MIN_VALUE."""
    w_max = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0).clamp(min=MIN_VALUE)
    s = act_max.float().to(w_max.device).clamp(min=MIN_VALUE).pow(alpha) / w_max.pow(1.0 - alpha)
    return s.clamp(min=MIN_VALUE)


@torch.no_grad()
def smooth_weights(weights: dict[str, torch.Tensor], arch: LlamaArch, maxima: list[dict[str, torch.Tensor]],
                   alpha: float) -> None:
    """Fold the smoothing of q/k/v's, gate/up's and down's inputs into the norms and up's rows,
    in place (`weights`: Hugging Face names -> tensors or views of the model's own)."""
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for norm, key, names in (("input_layernorm", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                 ("post_attention_layernorm", "gate_up", ("mlp.gate_proj", "mlp.up_proj"))):
            linears = [weights[p + name + ".weight"] for name in names]
            s = smoothing_scales(maxima[i][key], linears, alpha)
            norm_weight = weights[p + norm + ".weight"]
            norm_weight.copy_((norm_weight.float() / s).to(norm_weight.dtype))
            for w in linears:
                w.copy_((w.float() * s[None, :]).to(w.dtype))
        down, up = weights[p + "mlp.down_proj.weight"], weights[p + "mlp.up_proj.weight"]
        s = smoothing_scales(maxima[i]["down"], [down], alpha)
        up.copy_((up.float() / s[:, None]).to(up.dtype))
        if p + "mlp.up_proj.bias" in weights:
            bias = weights[p + "mlp.up_proj.bias"]
            bias.copy_((bias.float() / s).to(bias.dtype))
        down.copy_((down.float() * s[None, :]).to(down.dtype))


def calibration_ids(tokenizer, limit: int = CALIBRATION_TOKENS) -> list[int]:
    """The shipped calibration text's first `limit` token ids."""
    return list(tokenizer(CALIBRATION_TEXT.read_text(encoding="utf-8"))["input_ids"][:limit])


def smooth_model_weights(weights: dict[str, torch.Tensor], arch: LlamaArch, token_ids: list[int], alpha: float) -> None:
    """Calibrate on `token_ids`, then fold the smoothing (alpha in (0, 1]) into `weights`."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"model.fp8_smoothing: {alpha!r}; give the migration strength alpha, from 0 (off) to 1")
    smooth_weights(weights, arch, activation_maxima(weights, arch, token_ids), alpha)
