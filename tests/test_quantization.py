"""FP8 on CPU: the emulated math, the loader for each published checkpoint format (written
here by tests/fp8_checkpoints.py), the refusals, the FP8 KV cache of the torch reference
backend, and the profile keys. The GPU kernels are tested against this emulation in
tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from inflightllm.attention.base import SequenceSlice
from inflightllm.attention.torch_ref import TorchReferenceAttention
from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.model_source import ModelSpec
from inflightllm.models.loader import load_model
from inflightllm.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    dequantize,
    linear,
    quantize_per_channel,
    quantize_per_token,
    quantize_with_scale,
)
from inflightllm.quantization.schemes import UnsupportedQuantization, detect
from inflightllm.sampling_params import SamplingParams
from tests import fp8_checkpoints as ckpt


# ---- the math ---------------------------------------------------------------------------
def test_per_channel_scales_and_round_trip():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=generator) * torch.linspace(0.01, 3.0, 64)[:, None]
    weight[5] = 0.0  # an all-zero channel gets the floor scale, not a division by zero
    weight_q, scale = quantize_per_channel(weight)
    assert weight_q.dtype == FP8_DTYPE and scale.shape == (64,) and scale.dtype == torch.float32
    assert torch.allclose(scale[6:], weight[6:].abs().amax(dim=1) / FP8_MAX)
    assert float(weight_q.float().abs().amax(dim=1)[6:].min()) == FP8_MAX  # each channel's amax maps to 448
    assert bool((weight_q[5].float() == 0).all()) and float(scale[5]) > 0
    restored = dequantize(weight_q, scale[:, None])
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each value (plus subnormals near 0)
    error = (restored - weight).abs()
    assert bool((error <= weight.abs() / 16 + scale[:, None] * 2.0**-9).all())


def test_per_token_quantization_saturates_and_matches_the_emulated_linear():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(7, 48, generator=generator, dtype=torch.float32)
    x[2] *= 1000.0  # a large row still maps its amax to 448, not to inf
    x_q, x_scale = quantize_per_token(x)
    assert x_scale.shape == (7, 1)
    assert bool(torch.isfinite(x_q.float()).all())
    assert float(x_q[2].float().abs().max()) == FP8_MAX
    weight = torch.randn(32, 48, generator=generator)
    weight_q, weight_scale = quantize_per_channel(weight)
    expected = (x_q.float() * x_scale) @ (weight_q.float() * weight_scale[:, None]).t()
    assert torch.allclose(linear(x, weight_q, weight_scale), expected, rtol=1e-5, atol=1e-5)
    # and close to the unquantized product (a few percent: two e4m3 roundings per term)
    exact = x @ weight.t()
    assert float((linear(x, weight_q, weight_scale) - exact).norm() / exact.norm()) < 0.05
    assert quantize_with_scale(torch.tensor([1e6, -1e6]), 1.0).float().tolist() == [FP8_MAX, -FP8_MAX]


def test_fp8_linear_refuses_a_16_bit_weight():
    with pytest.raises(TypeError, match="weight must be torch.float8_e4m3fn"):
        Fp8Linear(torch.zeros(4, 4), torch.ones(4))


# ---- checkpoints --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """An unquantized tiny Llama (transformers' save_pretrained, bf16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from inflightllm.models.shapes import shape_config

    config_dict = shape_config("tiny-llama3")
    config_dict["initializer_range"] = 0.25
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = tmp_path_factory.mktemp("fp8-base")
    model.save_pretrained(folder)
    return folder


PROMPTS = [[11, 400, 9000, 33, 7], [5000 + i for i in range(40)], [48000, 17, 17, 17]]


def greedy(spec: ModelSpec, **config) -> list[list[int]]:
    values = dict(max_num_tokens=64, num_kv_blocks=64, block_size=16)
    values.update(config)
    engine = Engine(spec, EngineConfig(**values), sampler_seed=0)
    llm = LLM(spec, engine=engine, load_tokenizer_too=False)
    results = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(PROMPTS))
    return [r.token_ids for r in results]


def fp8_modules(loaded) -> dict[str, Fp8Linear]:
    return {name: m for name, m in loaded.model.named_modules() if isinstance(m, Fp8Linear)}


def test_channel_checkpoint_loads_what_quantization_at_load_computes(base_folder, tmp_path):
    folder = ckpt.write_compressed_tensors(base_folder, tmp_path / "ct-channel", strategy="channel")
    scheme = detect(folder)
    assert (scheme.method, scheme.weight_strategy, scheme.activations) == ("compressed-tensors", "channel", "dynamic")
    at_load = ModelSpec(source="hf_folder", path=str(base_folder), dtype="bfloat16", quantization="fp8")
    published = ModelSpec(source="hf_folder", path=str(folder), dtype="bfloat16")
    a, b = load_model(at_load), load_model(published)
    assert a.quantization == b.quantization == "fp8" and b.kv_scales is None
    modules_a, modules_b = fp8_modules(a), fp8_modules(b)
    assert len(modules_b) == 7 * 2 and set(modules_a) == set(modules_b)  # 7 linears in each of 2 layers
    for name, module in modules_b.items():
        assert torch.equal(module.weight.view(torch.uint8), modules_a[name].weight.view(torch.uint8)), name
        assert torch.equal(module.weight_scale, modules_a[name].weight_scale), name
    # embeddings, norms and the LM head are not quantized
    assert not isinstance(b.model.lm_head, Fp8Linear) and b.model.lm_head.weight.dtype == torch.bfloat16
    assert greedy(at_load) == greedy(published)


def test_tensor_scaled_checkpoint_with_static_inputs(base_folder, tmp_path):
    folder = ckpt.write_compressed_tensors(base_folder, tmp_path / "ct-tensor", strategy="tensor", static_inputs=True)
    scheme = detect(folder)
    assert (scheme.weight_strategy, scheme.activations) == ("tensor", "static")
    loaded = load_model(ModelSpec(source="hf_folder", path=str(folder), dtype="bfloat16"))
    from safetensors.torch import load_file

    written = load_file(str(folder / "model.safetensors"))
    module = fp8_modules(loaded)["model.layers.1.mlp.down_proj"]
    assert torch.equal(module.weight.view(torch.uint8), written["model.layers.1.mlp.down_proj.weight"].view(torch.uint8))
    # one per-tensor scale, held as a per-channel vector
    scale = float(written["model.layers.1.mlp.down_proj.weight_scale"])
    assert module.weight_scale.shape == (module.out_features,) and bool((module.weight_scale == scale).all())
    base = load_model(ModelSpec(source="hf_folder", path=str(base_folder), dtype="bfloat16"))
    original = base.model.get_submodule("model.layers.1.mlp.down_proj").weight.detach().float()
    restored = dequantize(module.weight, module.weight_scale[:, None])
    assert float((restored - original).norm() / original.norm()) < 0.05
    assert len(greedy(ModelSpec(source="hf_folder", path=str(folder), dtype="bfloat16"))[0]) == 12


@pytest.mark.parametrize("in_config", [False, True], ids=["hf_quant_config.json", "config.json"])
def test_modelopt_checkpoint_with_kv_scales(base_folder, tmp_path, in_config):
    folder = ckpt.write_modelopt(base_folder, tmp_path / "modelopt", kv=True, in_config=in_config)
    scheme = detect(folder)
    assert (scheme.method, scheme.kv_cache_scales) == ("modelopt", True)
    spec = ModelSpec(source="hf_folder", path=str(folder), dtype="bfloat16")
    loaded = load_model(spec)
    assert loaded.kv_scales == [ckpt.KV_SCALES] * 2
    assert len(fp8_modules(loaded)) == 14
    engine = Engine(spec, EngineConfig(max_num_tokens=64, num_kv_blocks=64, kv_cache_dtype="fp8"), loaded=loaded)
    attention = engine.runner.attention
    assert attention.kv_cache_dtype == "fp8" and attention.kv_scales == [ckpt.KV_SCALES] * 2
    llm = LLM(spec, engine=engine, load_tokenizer_too=False)
    (result,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8


def test_ignored_linears_stay_unquantized(base_folder, tmp_path):
    folder = ckpt.write_compressed_tensors(base_folder, tmp_path / "ct-ignore", ignore=("layers.0.mlp.down_proj",))
    loaded = load_model(ModelSpec(source="hf_folder", path=str(folder), dtype="bfloat16"))
    down = loaded.model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, torch.nn.Linear) and down.weight.dtype == torch.bfloat16
    assert isinstance(loaded.model.get_submodule("model.layers.1.mlp.down_proj"), Fp8Linear)


def _edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


def _group(quant):
    return quant["config_groups"]["group_0"]


REFUSED_CONFIGS = [
    (lambda q: _group(q)["weights"].update(type="int", num_bits=8), "type 'int' with num_bits 8 is not supported"),
    (lambda q: _group(q)["weights"].update(type="int", num_bits=4, strategy="group", group_size=128),
     "type 'int' with num_bits 4"),
    (lambda q: _group(q)["weights"].update(strategy="block", block_structure=[128, 128]),
     "weights.strategy 'block' is not supported"),
    (lambda q: _group(q).update(input_activations=None), "weight-only FP8 (no input_activations) is not supported"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24"}), "sparsity_config"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}), "kv_cache_scheme"),
    (lambda q: (q.clear(), q.update(quant_method="awq", bits=4)), "quant_method 'awq' is not supported"),
    (lambda q: (q.clear(), q.update(quant_method="gptq", bits=4)), "quant_method 'gptq' is not supported"),
    (lambda q: (q.clear(), q.update(quant_method="fp8", weight_block_size=[128, 128])),
     "quant_method 'fp8' is not supported"),
    (lambda q: (q.clear(), q.update(quant_method="modelopt", quant_algo="NVFP4")),
     "ModelOpt quant_algo 'NVFP4' is not supported"),
]


@pytest.mark.parametrize("edit, expected", REFUSED_CONFIGS, ids=[e for _, e in REFUSED_CONFIGS])
def test_unsupported_schemes_are_refused_by_name(base_folder, tmp_path, edit, expected):
    folder = ckpt.write_compressed_tensors(base_folder, tmp_path / "refused")
    _edit_config(folder, edit)
    with pytest.raises(UnsupportedQuantization) as info:
        load_model(ModelSpec(source="hf_folder", path=str(folder)))
    assert expected in str(info.value)
    assert "supported: FP8 e4m3 checkpoints" in str(info.value)


def _rewrite_tensors(folder, edit):
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    ckpt.save(tensors, folder)


REFUSED_TENSORS = [
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                         t["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16)}),
     "model.layers.0.self_attn.q_proj.weight: stored as torch.bfloat16, expected torch.float8_e4m3fn"),
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"),
     "model.layers.1.mlp.up_proj.weight_scale: missing for an FP8 weight"),
    (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight_scale": torch.ones(256 // 128, 128 // 128)}),
     "block or group scales are not"),
    (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight_scale": -torch.ones(256, 1)}),
     "non-finite or non-positive"),
    (lambda t: t.update({"model.layers.1.self_attn.k_scale": torch.tensor(float("nan"))}),
     "model.layers.1.self_attn.k_scale: nan is not a finite positive scale"),
    (lambda t: t.pop("model.layers.1.self_attn.v_scale"),
     "model.layers.1: K/V cache scales are declared but k_scale/v_scale is missing"),
]


@pytest.mark.parametrize("edit, expected", REFUSED_TENSORS, ids=[e.split(":")[0] for _, e in REFUSED_TENSORS])
def test_malformed_tensors_are_refused_by_name(base_folder, tmp_path, edit, expected):
    folder = ckpt.write_compressed_tensors(base_folder, tmp_path / "bad", kv=True)
    _rewrite_tensors(folder, edit)
    with pytest.raises(UnsupportedQuantization) as info:
        load_model(ModelSpec(source="hf_folder", path=str(folder)))
    assert expected in str(info.value)


def test_an_unknown_hf_quant_config_producer_is_refused(base_folder, tmp_path):
    folder = tmp_path / "producer"
    shutil.copytree(base_folder, folder)
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "other"}, "quantization": {}}))
    with pytest.raises(UnsupportedQuantization, match="producer 'other' is not supported"):
        load_model(ModelSpec(source="hf_folder", path=str(folder)))


# ---- the FP8 KV cache (torch reference backend) --------------------------------------------
def test_fp8_kv_cache_stores_e4m3_and_attends_over_the_rounded_values():
    """The fp8 cache holds e4m3(K / k_scale); its attention equals the 16-bit cache's
    attention over those rounded values (same SDPA on the same numbers)."""
    heads, kv_heads, head_dim, block = 4, 2, 32, 16
    scales = [(0.05, 0.02)]
    fp8 = TorchReferenceAttention(heads, kv_heads, head_dim, kv_cache_dtype="fp8", kv_scales=scales)
    plain = TorchReferenceAttention(heads, kv_heads, head_dim)
    for backend in (fp8, plain):
        backend.allocate_kv_cache(8, block, 1, kv_heads, head_dim, torch.bfloat16, torch.device("cpu"))
    assert fp8.key_cache[0].dtype == torch.uint8
    generator = torch.Generator().manual_seed(3)
    # a prefill of 21 tokens then a decode: blocks 3, 5 (partial) of one sequence
    query = torch.randn(21, heads, head_dim, generator=generator).to(torch.bfloat16)
    key = torch.randn(21, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    value = torch.randn(21, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    rounded_k = dequantize(quantize_with_scale(key, 0.05), 0.05, torch.bfloat16)
    rounded_v = dequantize(quantize_with_scale(value, 0.02), 0.02, torch.bfloat16)
    steps = [(SequenceSlice(query_start=0, query_len=20, context_len=20, block_table=(3, 5)), slice(0, 20)),
             (SequenceSlice(query_start=0, query_len=1, context_len=21, block_table=(3, 5)), slice(20, 21))]
    for seq, rows in steps:
        out_fp8 = fp8.forward(0, query[rows], key[rows], value[rows], fp8.build_metadata([seq], "cpu"))
        out_plain = plain.forward(0, query[rows], rounded_k[rows], rounded_v[rows], plain.build_metadata([seq], "cpu"))
        assert torch.equal(out_fp8, out_plain)
    slots = torch.tensor([3 * block + i for i in range(16)] + [5 * block + i for i in range(5)])
    stored = fp8.key_cache[0].index_select(0, slots)
    assert torch.equal(stored, quantize_with_scale(key, 0.05).view(torch.uint8))


def test_fp8_kv_cache_holds_twice_the_blocks_and_generates():
    spec = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="bfloat16")
    budget = 4 * 1024 * 1024
    auto = Engine(spec, EngineConfig(max_num_tokens=64, kv_cache_bytes=budget), sampler_seed=0)
    fp8 = Engine(spec, EngineConfig(max_num_tokens=64, kv_cache_bytes=budget, kv_cache_dtype="fp8"), sampler_seed=0,
                 loaded=auto.loaded)
    assert fp8.runner.num_blocks == 2 * auto.runner.num_blocks
    llm = LLM(spec, engine=fp8, load_tokenizer_too=False)
    results = llm.generate(PROMPTS, [SamplingParams(max_tokens=10, ignore_eos=True)] * len(PROMPTS))
    assert [len(r.token_ids) for r in results] == [10] * len(PROMPTS)


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8': allowed auto, fp8"):
        TorchReferenceAttention(4, 2, 32, kv_cache_dtype="int8")


# ---- emulation on the real model ------------------------------------------------------------
def test_fp8_smollm2_stays_close_to_bf16_over_a_real_text(smollm2_folder, smollm2_tokenizer):
    """FP8 weights (quantized at load) + FP8 KV on the real SmolLM2, through the engine's
    runner and paged cache (perf/perplexity.py, on its first 192 tokens): the perplexity
    within 10% of bf16's and most argmaxes equal (the tool measures the whole text)."""
    from perf.perplexity import TEXT, evaluate

    ids = smollm2_tokenizer(TEXT.read_text())["input_ids"][:192]
    results = {}
    for name, quantization, kv in (("bf16", None, "auto"), ("fp8", "fp8", "fp8")):
        spec = ModelSpec(source="hf_folder", path=str(smollm2_folder), dtype="bfloat16", quantization=quantization)
        config = EngineConfig(max_num_tokens=64, num_kv_blocks=16, kv_cache_dtype=kv)
        results[name] = evaluate(spec, config, ids, chunk=64)
    ppl = {name: float(r["nll"].mean().exp()) for name, r in results.items()}
    agree = float((results["bf16"]["argmax"] == results["fp8"]["argmax"]).float().mean())
    assert ppl["fp8"] < 1.10 * ppl["bf16"], ppl
    assert agree > 0.8, agree


def test_perplexity_int8_lm_head_sets_the_key_on_the_lmh_variants_only(tmp_path, monkeypatch):
    """--lm-head-int8: the -lmh variants load with model.int8_lm_head (an int8 copy of the LM
    head, read a row at a time), the others without; the JSON says which head."""
    from perf import perplexity

    seen = []
    evaluate = perplexity.evaluate

    def recording(spec, *args):
        seen.append((spec.quantization, spec.lm_head_kind()))
        return evaluate(spec, *args)

    monkeypatch.setattr(perplexity, "evaluate", recording)
    out = tmp_path / "ppl.json"
    assert perplexity.main(["--variants", "base,fp8-lmh", "--max-tokens", "24", "--lm-head-int8", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["lm_head"] == "int8" and set(figures["results"]) == {"base", "fp8-lmh"}
    assert 0.5 < figures["results"]["fp8-lmh"]["ratio_to_base"] < 2.0
    assert seen == [(None, None), ("fp8", "int8")]


@pytest.mark.parametrize("capability, quantization, refused", [
    ((9, 0), "fp8", None),  # H100 / H200
    ((8, 9), "fp8", None),  # Ada: FP8 tensor cores
    ((8, 0), None, None),  # A100: 16-bit weights (the FP8 KV cache too: software e4m3)
    ((8, 0), "fp8", "model.quantization fp8 (or an FP8 checkpoint) needs FP8 tensor cores"),
    ((7, 5), None, "the GPU engine needs compute capability 8.0 or later"),
])
def test_gpu_capability_is_checked_before_loading(monkeypatch, capability, quantization, refused):
    """The GPU engine refuses, naming the GPU and its compute capability, a GPU its kernels do
    not run on (cp.async: 8.0) and FP8 weights without FP8 tensor cores (8.9). Checked on the
    CPU: only the capability and the name are read."""
    from inflightllm.gpu import model as gpu_model

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    device = torch.device("cuda", 0)
    if refused is None:
        gpu_model.check_capability(device, quantization)
        return
    with pytest.raises(ValueError, match=r"cuda:0 \(Test GPU\) has compute capability " + r"\.".join(map(str, capability))) as error:
        gpu_model.check_capability(device, quantization)
    assert refused in str(error.value)
