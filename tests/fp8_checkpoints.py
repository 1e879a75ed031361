"""FP8 checkpoints written by the tests in each published format, from one unquantized
model folder (safetensors + config.json), for the loader tests on CPU and on the GPU.

- compressed-tensors (the "-FP8" / "-FP8-dynamic" Hugging Face repos): e4m3
  `<linear>.weight`, `<linear>.weight_scale` per channel ([N, 1]) or per tensor ([1]),
  `<linear>.input_scale` when activations are static, `self_attn.k_scale` / `v_scale`
  with a `kv_cache_scheme`;
- ModelOpt: per-tensor `weight_scale` and `input_scale`, `self_attn.k_proj.k_scale` /
  `self_attn.v_proj.v_scale`, its settings in `hf_quant_config.json` or in config.json.

The weights are quantized with inflightllm.quantization.fp8 so that a channel-scaled
checkpoint holds exactly what `model.quantization: fp8` computes at load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from inflightllm.quantization.fp8 import FP8_MAX, quantize_per_channel, quantize_with_scale
from inflightllm.quantization.schemes import LINEAR_LEAVES

KV_SCALES = (0.0625, 0.125)  # every layer's (k_scale, v_scale) in the checkpoints that carry them


def is_linear(name: str) -> bool:
    """A decoder linear's weight (model.layers.<i>.<...>.<leaf>.weight)."""
    parts = name.split(".")
    return name.endswith(".weight") and ".layers." in name and parts[-2] in LINEAR_LEAVES


def _base_tensors(base: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _copy_folder(base: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, out / item.name)
    return json.loads((base / "config.json").read_text())


def _num_layers(config: dict) -> int:
    return int(config["num_hidden_layers"])


def quantized_tensors(base: Path, strategy: str, static_inputs: bool, kv_names: tuple[str, str] | None,
                      ignore: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The base folder's tensors with every decoder linear (but `ignore`d modules) as e4m3
    plus its scales; K/V scales under kv_names (k, v leaf names) when given."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _base_tensors(base).items():
        module = name.rsplit(".", 1)[0]
        if not is_linear(name) or any(module.endswith(i) for i in ignore):
            out[name] = tensor
            continue
        if strategy == "channel":
            weight_q, scale = quantize_per_channel(tensor)
            out[module + ".weight_scale"] = scale.reshape(-1, 1)
        else:
            scale = (tensor.float().abs().amax() / FP8_MAX).reshape(1)
            weight_q = quantize_with_scale(tensor, scale)
            out[module + ".weight_scale"] = scale
        out[name] = weight_q
        if static_inputs:
            out[module + ".input_scale"] = torch.tensor([0.02], dtype=torch.float32)
    if kv_names is not None:
        layers = {int(n.split(".")[2]) for n in out if n.startswith("model.layers.")}
        for i in sorted(layers):
            out[f"model.layers.{i}.{kv_names[0]}"] = torch.tensor(KV_SCALES[0])
            out[f"model.layers.{i}.{kv_names[1]}"] = torch.tensor(KV_SCALES[1])
    return out


def save(tensors: dict[str, torch.Tensor], out: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))


def compressed_tensors_config(strategy: str, static_inputs: bool, kv: bool, ignore: tuple[str, ...]) -> dict:
    activations = (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        if static_inputs
        else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    )
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True},
                "input_activations": activations,
            }
        },
        "ignore": list(ignore) + ["lm_head"],
        "quantization_status": "compressed",
    }
    if kv:
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}
    return config


def write_compressed_tensors(base: Path, out: Path, strategy: str = "channel", static_inputs: bool = False,
                             kv: bool = False, ignore: tuple[str, ...] = ()) -> Path:
    config = _copy_folder(base, out)
    config["quantization_config"] = compressed_tensors_config(strategy, static_inputs, kv, ignore)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save(quantized_tensors(base, strategy, static_inputs, ("self_attn.k_scale", "self_attn.v_scale") if kv else None,
                           ignore), out)
    return out


def write_modelopt(base: Path, out: Path, kv: bool = True, in_config: bool = False) -> Path:
    """ModelOpt FP8: settings in hf_quant_config.json (its export) or config.json."""
    config = _copy_folder(base, out)
    settings = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv else None, "exclude_modules": ["lm_head"]}
    if in_config:
        config["quantization_config"] = dict(settings, quant_method="modelopt")
    else:
        (out / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": settings})
        )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kv_names = ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale") if kv else None
    save(quantized_tensors(base, "tensor", True, kv_names), out)
    return out
