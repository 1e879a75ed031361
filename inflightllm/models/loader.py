"""Build a model from a ModelSpec: safetensors from a prepared HF folder, or seeded
random weights for a named shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from inflightllm.model_source import ModelSpec, prepare
from inflightllm.models.llama import LlamaArch, LlamaForCausalLM, rope_inverse_frequencies

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


def eos_token_ids(folder: Path, config: dict) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json."""
    value = None
    generation = folder / "generation_config.json"
    if generation.is_file():
        value = json.loads(generation.read_text()).get("eos_token_id")
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


def _load_safetensors(model: LlamaForCausalLM, folder: Path, device: torch.device) -> None:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        for name, tensor in load_file(str(file), device=str(device)).items():
            if name not in expected:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise KeyError(f"{file.name}: unexpected weight {name!r} for this architecture")
            with torch.no_grad():
                expected[name].copy_(tensor.to(expected[name].dtype))
            loaded.add(name)
    missing = set(expected) - loaded
    if model.arch.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise KeyError(f"weights missing from {folder}: {sorted(missing)[:5]}")


def load_model(spec: ModelSpec, device: str | torch.device = "cpu") -> LoadedModel:
    """Load (or randomly initialise) the model of `spec` onto `device`."""
    device = torch.device(device)
    dtype = TORCH_DTYPES[spec.dtype]
    folder = prepare(spec)
    config = json.loads((folder / "config.json").read_text())
    arch = LlamaArch.from_config(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device=device).to(dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if spec.source == "random":
        _init_random(model, spec.seed)
    else:
        _load_safetensors(model, folder, device)
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
    )
