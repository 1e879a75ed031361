"""Pre-quantized checkpoints, read as they are published, or refused by name.

Supported (FP8 e4m3 weights, per tensor or per output channel; activations dynamic per
token or static per tensor; optional per-tensor K/V cache scales):
- compressed-tensors (`quantization_config.quant_method: compressed-tensors`, the format
  of the common "-FP8" / "-FP8-dynamic" Hugging Face repos): `<linear>.weight` e4m3,
  `<linear>.weight_scale` ([N, 1] channel or [1] / [] tensor), `<linear>.input_scale`
  (static activations); K/V scales as `self_attn.k_scale` / `v_scale` (or the older
  `k_proj.output_scale` / `v_proj.output_scale`) when `kv_cache_scheme` is set.
- ModelOpt (`quant_method: modelopt` in config.json, or `hf_quant_config.json` with
  `quantization.quant_algo: FP8`): `<linear>.weight` e4m3, per-tensor `weight_scale` and
  `input_scale`, `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale` (or
  `self_attn.k_scale` / `v_scale`) with `kv_cache_quant_algo: FP8`.

Anything else that declares a quantization (int8/int4 weights, FP4, block or group
scales, other methods) raises `UnsupportedQuantization` naming it: never loaded wrong.

How activations are computed does not depend on the checkpoint: every FP8 path quantizes
activations per token at run time (inflightllm.quantization.fp8). A static `input_scale`
is read and checked (finite, positive) but not used: per-token scales are at least as
accurate, and one code path serves both kinds.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inflightllm.quantization.fp8 import FP8_DTYPE

# The linear layers that FP8 checkpoints quantize (Llama family), by their leaf names.
LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization scheme that this engine cannot load; the message names it."""


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a pre-quantized checkpoint stores its linear layers."""

    method: str  # "compressed-tensors" | "modelopt"
    weight_strategy: str  # "channel" | "tensor"
    activations: str  # "dynamic" | "static"
    kv_cache_scales: bool  # the checkpoint carries per-layer K/V scales
    ignore: tuple[str, ...] = field(default_factory=tuple)  # module names or "re:" patterns left unquantized

    def is_quantized(self, module_name: str) -> bool:
        """Whether `module_name` (e.g. model.layers.0.self_attn.q_proj) is an FP8 linear."""
        if module_name.rsplit(".", 1)[-1] not in LINEAR_LEAVES:
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern) or fnmatch_name(module_name, pattern):
                return False
        return True


def fnmatch_name(name: str, pattern: str) -> bool:
    """ModelOpt's exclude_modules use shell-style wildcards (`*lm_head*`)."""
    import fnmatch

    return "*" in pattern and fnmatch.fnmatchcase(name, pattern)


def _fail(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"{what}; supported: FP8 e4m3 checkpoints in the compressed-tensors format (per-tensor or per-channel "
        "weight scales, dynamic or static per-tensor activations) and ModelOpt FP8 (quant_algo FP8)"
    )


def _compressed_tensors(config: dict) -> CheckpointQuantization:
    groups = config.get("config_groups") or {}
    if not groups:
        raise _fail("compressed-tensors: quantization_config.config_groups is empty")
    strategies, activations = set(), set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        where = f"compressed-tensors config_groups.{name}"
        kind = (weights.get("type"), weights.get("num_bits"))
        if kind != ("float", 8):
            raise _fail(f"{where}.weights: type {weights.get('type')!r} with num_bits {weights.get('num_bits')!r} "
                        "is not supported (only float 8-bit)")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "tensor"):
            raise _fail(f"{where}.weights.strategy {strategy!r} is not supported (only channel or tensor)")
        if weights.get("symmetric") is False:
            raise _fail(f"{where}.weights: asymmetric quantization is not supported")
        if weights.get("dynamic"):
            raise _fail(f"{where}.weights: dynamic weight quantization is not supported")
        strategies.add(strategy)
        acts = group.get("input_activations")
        if acts is None:
            raise _fail(f"{where}: weight-only FP8 (no input_activations) is not supported")
        if (acts.get("type"), acts.get("num_bits")) != ("float", 8):
            raise _fail(f"{where}.input_activations: type {acts.get('type')!r} with num_bits "
                        f"{acts.get('num_bits')!r} is not supported (only float 8-bit)")
        if acts.get("dynamic"):
            if acts.get("strategy") not in ("token", "tensor"):
                raise _fail(f"{where}.input_activations.strategy {acts.get('strategy')!r} is not supported "
                            "(dynamic: token or tensor)")
            activations.add("dynamic")
        else:
            if acts.get("strategy") != "tensor":
                raise _fail(f"{where}.input_activations.strategy {acts.get('strategy')!r} is not supported "
                            "(static: tensor)")
            activations.add("static")
        targets = group.get("targets") or []
        if targets and not any(t in ("Linear", "re:.*") or "proj" in t for t in targets):
            raise _fail(f"{where}.targets {targets!r}: only Linear layers are supported")
    if config.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise _fail(f"compressed-tensors format {config.get('format')!r} is not supported")
    if config.get("sparsity_config"):
        raise _fail("compressed-tensors sparsity_config (sparse weights) is not supported")
    kv = config.get("kv_cache_scheme")
    if kv is not None and ((kv.get("type"), kv.get("num_bits")) != ("float", 8) or kv.get("strategy") not in (None, "tensor")):
        raise _fail(f"compressed-tensors kv_cache_scheme {kv!r} is not supported (only float 8-bit per tensor)")
    return CheckpointQuantization(
        method="compressed-tensors",
        weight_strategy="channel" if "channel" in strategies else "tensor",
        activations="static" if "static" in activations else "dynamic",
        kv_cache_scales=kv is not None,
        ignore=tuple(config.get("ignore") or ()),
    )


def _modelopt(config: dict) -> CheckpointQuantization:
    section = config.get("quantization", config)  # hf_quant_config.json nests it
    algo = section.get("quant_algo")
    if algo != "FP8":
        raise _fail(f"ModelOpt quant_algo {algo!r} is not supported (only FP8)")
    kv_algo = section.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise _fail(f"ModelOpt kv_cache_quant_algo {kv_algo!r} is not supported (only FP8 or none)")
    return CheckpointQuantization(
        method="modelopt",
        weight_strategy="tensor",
        activations="static",
        kv_cache_scales=kv_algo == "FP8",
        ignore=tuple(section.get("exclude_modules") or section.get("ignore") or ()),
    )


def detect(folder: Path, config: dict | None = None) -> CheckpointQuantization | None:
    """The checkpoint's quantization scheme, None for an unquantized checkpoint; raises
    UnsupportedQuantization naming any other declared scheme."""
    if config is None:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config")
    if quant is None:
        hf_quant = Path(folder) / "hf_quant_config.json"
        if hf_quant.is_file():
            data = json.loads(hf_quant.read_text(encoding="utf-8"))
            producer = (data.get("producer") or {}).get("name", "modelopt")
            if producer != "modelopt":
                raise _fail(f"hf_quant_config.json from producer {producer!r} is not supported")
            return _modelopt(data)
        return None
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "modelopt":
        return _modelopt(quant)
    raise _fail(f"quantization_config.quant_method {method!r} is not supported")


def channel_scale(weight_scale: torch.Tensor, out_features: int, name: str) -> torch.Tensor:
    """A checkpoint's weight scale (per tensor: [] or [1]; per channel: [N] or [N, 1]) as
    float32 [out_features]."""
    scale = weight_scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(out_features).clone()
    elif scale.numel() != out_features:
        raise UnsupportedQuantization(
            f"{name}: weight_scale has {weight_scale.numel()} values for {out_features} output channels; "
            "supported: one per tensor or one per output channel (block or group scales are not)"
        )
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise UnsupportedQuantization(f"{name}: weight_scale holds a non-finite or non-positive value")
    return scale


def check_fp8_weight(weight: torch.Tensor, name: str) -> None:
    if weight.dtype != FP8_DTYPE:
        raise UnsupportedQuantization(
            f"{name}: stored as {weight.dtype}, expected {FP8_DTYPE} (an FP8 e4m3 checkpoint)"
        )


def check_scalar_scale(value: torch.Tensor, name: str) -> float:
    """A per-tensor scale (input_scale, k_scale, v_scale) as a finite positive float."""
    if value.numel() != 1:
        raise UnsupportedQuantization(f"{name}: {value.numel()} values; only a per-tensor scale is supported")
    scalar = float(value.float().reshape(-1)[0])
    if not math.isfinite(scalar) or scalar <= 0:
        raise UnsupportedQuantization(f"{name}: {scalar} is not a finite positive scale")
    return scalar


KV_SCALE_NAMES = {
    # canonical leaf -> names under "model.layers.<i>." that checkpoints use
    "k_scale": ("self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.k_proj.output_scale"),
    "v_scale": ("self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.v_proj.output_scale"),
}


def classify_tensor(name: str) -> tuple[str, str] | None:
    """(module name, role) for the quantization tensors of a checkpoint: role is
    weight_scale, input_scale, k_scale or v_scale; None for ordinary tensors."""
    for role, names in KV_SCALE_NAMES.items():
        for suffix in names:
            if name.endswith("." + suffix):
                return name[: -len(suffix) - 1], role
    for role in ("weight_scale", "input_scale"):
        if name.endswith("." + role):
            return name[: -len(role) - 1], role
    return None
