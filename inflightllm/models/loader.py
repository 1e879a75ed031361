"""Build a model from a ModelSpec: safetensors from a prepared HF folder, or seeded
random weights for a named shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from inflightllm.model_source import ModelSpec, load_tokenizer, prepare
from inflightllm.models.llama import LlamaArch, LlamaForCausalLM, rope_inverse_frequencies
from inflightllm.quantization.fp8 import FP8_DTYPE, Fp8Linear, quantize_lm_head
from inflightllm.quantization.schemes import (
    LINEAR_LEAVES,
    CheckpointQuantization,
    UnsupportedQuantization,
    channel_scale,
    check_fp8_weight,
    check_scalar_scale,
    classify_tensor,
    detect,
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: LlamaArch
    config: dict
    folder: Path
    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    device: torch.device
    spec: ModelSpec | None = None  # what was loaded (tensor-parallel workers load it again)
    # "fp8" when the linear layers hold e4m3 weights (quantized at load or pre-quantized).
    quantization: str | None = None
    # Per layer (k_scale, v_scale) of a checkpoint that carries K/V cache scales, else None.
    kv_scales: list[tuple[float, float]] | None = None


def eos_token_ids(folder: Path, config: dict) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json."""
    value = None
    generation = folder / "generation_config.json"
    if generation.is_file():
        value = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
    if value is None:
        value = config.get("eos_token_id")
    if value is None:
        return frozenset()
    return frozenset(value if isinstance(value, list) else [value])


def sampleable_vocab_size(folder: Path, vocab_size: int) -> int | None:
    """How many ids the model may sample: the tokenizer's (inflightllm.detokenizer
    `TokenizerVocabulary.num_ids`) when it has fewer ids than the model, else None (all).

    A random-weight shape with more ids than its borrowed tokenizer (Llama 3's 128,256
    with SmolLM2's 49,152) would otherwise sample ids the tokenizer cannot decode: they
    stream no text, and streamed and whole text could differ. A real model's tokenizer
    covers its vocabulary (nothing is masked); where the LM head is padded beyond the
    tokenizer (Qwen2's 151,936 rows for 151,665 ids), the padding rows are never sampled,
    as their ids mean nothing. Log probabilities are over the sampleable ids."""
    from inflightllm.detokenizer import tokenizer_vocabulary

    vocabulary = tokenizer_vocabulary(folder)
    if vocabulary is None or not 0 < vocabulary.num_ids < vocab_size:
        return None
    return vocabulary.num_ids


def _init_random(model: LlamaForCausalLM, seed: int) -> None:
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=generator)


def _copy_weight(expected: dict[str, torch.Tensor], loaded: set[str], name: str, tensor: torch.Tensor,
                 source: str) -> None:
    """A checkpoint tensor into its parameter (RoPE's stored inv_freq is skipped: recomputed)."""
    if name not in expected:
        if name.endswith("rotary_emb.inv_freq"):
            return
        raise KeyError(f"{source}: unexpected weight {name!r} for this architecture")
    with torch.no_grad():
        expected[name].copy_(tensor.to(expected[name].dtype))
    loaded.add(name)


def _check_all_loaded(model: LlamaForCausalLM, expected: dict[str, torch.Tensor], loaded: set[str],
                      folder: Path) -> None:
    missing = set(expected) - loaded
    if model.arch.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise KeyError(f"weights missing from {folder}: {sorted(missing)[:5]}")


def _load_safetensors(model: LlamaForCausalLM, folder: Path, device: torch.device) -> None:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        for name, tensor in load_file(str(file), device=str(device)).items():
            _copy_weight(expected, loaded, name, tensor, file.name)
    _check_all_loaded(model, expected, loaded, folder)


def _replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, module)


def smooth_before_quantizing(weights: dict[str, torch.Tensor], arch, spec: ModelSpec) -> None:
    """SmoothQuant folded into the 16-bit weights (Hugging Face names), calibrated on the
    package's calibration text with the model's tokenizer (inflightllm.quantization.smoothing)."""
    from inflightllm.quantization.smoothing import calibration_ids, smooth_model_weights

    tokenizer = load_tokenizer(spec)  # a random-weight shape's folder holds its borrowed tokenizer
    # (a random-weight shape may have fewer ids than the tokenizer it borrows)
    ids = [token for token in calibration_ids(tokenizer) if token < arch.vocab_size]
    smooth_model_weights(weights, arch, ids, float(spec.fp8_smoothing))


def check_fp8_lm_head(spec: ModelSpec, fp8: bool) -> None:
    """model.fp8_lm_head only where the linears are FP8 (quantized at load or a pre-quantized
    checkpoint): refused, naming the key, on a 16-bit model."""
    if not fp8:
        raise ValueError(
            f"model.fp8_lm_head: {spec.describe()} is not served with FP8 weights; set model.quantization: fp8 "
            "or load an FP8 checkpoint (or drop model.fp8_lm_head)"
        )


def quantize_linears(model: LlamaForCausalLM) -> None:
    """FP8 at load: every decoder linear (q/k/v/o, gate/up/down) becomes an `Fp8Linear`
    with per-output-channel scales; embeddings, norms and the LM head stay as they are."""
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEAR_LEAVES and ".layers." in name:
            _replace_module(model, name, Fp8Linear.from_linear(module))


def _layer_index(module_name: str) -> int:
    parts = module_name.split(".")
    try:
        return int(parts[parts.index("layers") + 1])
    except (ValueError, IndexError):
        raise UnsupportedQuantization(f"{module_name}: a K/V scale outside a decoder layer") from None


def read_quantized_tensors(files: list[Path], scheme: CheckpointQuantization, num_layers: int):
    """Split a pre-quantized checkpoint's tensors: (plain tensors by name, e4m3 weights by
    module, per-channel float32 scales by module, per-layer (k_scale, v_scale) or None).
    Raises UnsupportedQuantization naming the tensor for anything that does not fit the scheme."""
    from safetensors.torch import load_file

    plain: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    raw_scales: dict[str, torch.Tensor] = {}
    kv: dict[tuple[int, str], float] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            role = classify_tensor(name)
            if role is not None:
                module, kind = role
                if kind in ("k_scale", "v_scale"):
                    kv[(_layer_index(module), kind)] = check_scalar_scale(tensor, name)
                elif kind == "weight_scale":
                    raw_scales[module] = tensor
                else:  # input_scale: static activation scale, checked, not used (schemes.py)
                    check_scalar_scale(tensor, name)
                continue
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and scheme.is_quantized(module):
                check_fp8_weight(tensor, name)
                weights[module] = tensor
            elif tensor.dtype == FP8_DTYPE:
                raise UnsupportedQuantization(f"{name}: an e4m3 tensor where the scheme has no FP8 layer")
            else:
                plain[name] = tensor
    scales: dict[str, torch.Tensor] = {}
    for module, weight in weights.items():
        if module not in raw_scales:
            raise UnsupportedQuantization(f"{module}.weight_scale: missing for an FP8 weight")
        scales[module] = channel_scale(raw_scales.pop(module), weight.shape[0], f"{module}.weight_scale")
    if raw_scales:
        raise UnsupportedQuantization(f"{sorted(raw_scales)[0]}.weight_scale: a scale without an FP8 weight")
    kv_scales = None
    if scheme.kv_cache_scales or kv:
        missing = [i for i in range(num_layers) for kind in ("k_scale", "v_scale") if (i, kind) not in kv]
        if missing:
            raise UnsupportedQuantization(
                f"model.layers.{missing[0]}: K/V cache scales are declared but k_scale/v_scale is missing"
            )
        kv_scales = [(kv[(i, "k_scale")], kv[(i, "v_scale")]) for i in range(num_layers)]
    return plain, weights, scales, kv_scales


def _load_quantized_safetensors(model: LlamaForCausalLM, folder: Path, device: torch.device,
                                scheme: CheckpointQuantization):
    """A pre-quantized FP8 checkpoint into the CPU model: its FP8 linears become `Fp8Linear`s
    (the emulation), the rest loads as usual. Returns the per-layer K/V scales or None."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    plain, weights, scales, kv_scales = read_quantized_tensors(files, scheme, model.arch.num_layers)
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in plain.items():
        _copy_weight(expected, loaded, name, tensor, str(folder))
    for module, weight in weights.items():
        linear = model.get_submodule(module)
        bias = None if linear.bias is None else linear.bias.data
        _replace_module(model, module, Fp8Linear(weight.to(device), scales[module].to(device), bias))
        loaded.add(module + ".weight")
    _check_all_loaded(model, expected, loaded, folder)
    return kv_scales


def load_model(spec: ModelSpec, device: str | torch.device = "cpu") -> LoadedModel:
    """Load (or randomly initialise) the model of `spec` onto `device`. FP8: a
    pre-quantized checkpoint loads as published; `spec.quantization == "fp8"` quantizes
    an unquantized one at load (the CPU computes FP8 by emulation: quantization.fp8)."""
    device = torch.device(device)
    dtype = TORCH_DTYPES[spec.dtype]
    folder = prepare(spec)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch = LlamaArch.from_config(config)
    scheme = detect(folder, config) if spec.source == "hf_folder" else None
    fp8 = scheme is not None or spec.quantization == "fp8"
    head_kind = spec.lm_head_kind()  # refused before any weight is read
    if spec.fp8_lm_head:
        check_fp8_lm_head(spec, fp8)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device=device).to(dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    kv_scales = None
    if spec.source == "random":
        _init_random(model, spec.seed)
    elif scheme is not None:
        kv_scales = _load_quantized_safetensors(model, folder, device, scheme)
    else:
        _load_safetensors(model, folder, device)
    if scheme is None and spec.quantization == "fp8":
        if spec.fp8_smoothing:
            smooth_before_quantizing(dict(model.named_parameters()), arch, spec)
        quantize_linears(model)
    if head_kind is not None:
        model.lm_head_q = quantize_lm_head(model.lm_head.weight.data, head_kind)
    # RoPE frequencies stay float32 (as in transformers), whatever the weights' dtype.
    model.model.rotary_emb.inv_freq = rope_inverse_frequencies(arch).to(device)
    model.sampleable_vocab_size = sampleable_vocab_size(folder, arch.vocab_size)
    model.eval()
    return LoadedModel(
        model=model,
        arch=arch,
        config=config,
        folder=folder,
        eos_token_ids=eos_token_ids(folder, config),
        dtype=dtype,
        device=device,
        spec=spec,
        quantization="fp8" if fp8 else None,
        kv_scales=kv_scales,
    )
