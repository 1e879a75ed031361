"""SmoothQuant folded into the weights before FP8 quantization at load
(inflightllm.quantization.smoothing, `model.fp8_smoothing`): the calibration forward against
transformers, the fold leaving the unquantized model's function as it was, the profile key,
and the perplexity goals of issue 26 on the real SmolLM2 through the engine's runner (CPU
emulation)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from inflightllm.config import EngineConfig
from inflightllm.model_source import DEFAULT_MODEL, ModelSpec
from inflightllm.models.llama import LlamaArch
from inflightllm.models.shapes import shape_config
from inflightllm.quantization.smoothing import activation_maxima, smooth_weights, smoothing_scales

REPO_ROOT = Path(__file__).resolve().parent.parent


def tiny_model(mlp_bias: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(shape_config("tiny-llama3"), initializer_range=0.25, mlp_bias=mlp_bias)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_dict), dtype=torch.float32).eval()
    return model, LlamaArch.from_config(config_dict)


IDS = [(7 * i + 3) % 1000 + 5 for i in range(48)]


def test_calibration_forward_matches_transformers():
    model, arch = tiny_model()
    seen: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            seen[name] = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
        return record

    for name, module in model.named_modules():
        if name.endswith(("q_proj", "gate_proj", "down_proj")):
            module.register_forward_pre_hook(hook(name))
    with torch.inference_mode():
        model(torch.tensor([IDS]))
    maxima = activation_maxima(dict(model.state_dict()), arch, IDS, chunk=len(IDS))
    assert len(maxima) == arch.num_layers
    for i, layer in enumerate(maxima):
        p = f"model.layers.{i}."
        torch.testing.assert_close(layer["qkv"], seen[p + "self_attn.q_proj"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer["gate_up"], seen[p + "mlp.gate_proj"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer["down"], seen[p + "mlp.down_proj"], rtol=1e-4, atol=1e-5)


def test_chunks_take_the_maximum_over_all_of_them():
    model, arch = tiny_model()
    weights = dict(model.state_dict())
    whole = activation_maxima(weights, arch, IDS[:16], chunk=16)
    second = activation_maxima(weights, arch, IDS[16:32], chunk=16)
    both = activation_maxima(weights, arch, IDS[:32], chunk=16)
    for key in ("qkv", "gate_up", "down"):
        torch.testing.assert_close(both[0][key], torch.maximum(whole[0][key], second[0][key]))


@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no-bias", "up-bias"])
def test_the_fold_leaves_the_unquantized_model_as_it_was(mlp_bias):
    model, arch = tiny_model(mlp_bias)
    with torch.inference_mode():
        before = model(torch.tensor([IDS])).logits
    weights = dict(model.state_dict())
    maxima = activation_maxima(weights, arch, IDS)
    norm_before = weights["model.layers.0.input_layernorm.weight"].clone()
    smooth_weights(weights, arch, maxima, alpha=0.5)
    assert not torch.equal(norm_before, weights["model.layers.0.input_layernorm.weight"])  # something moved
    with torch.inference_mode():
        after = model(torch.tensor([IDS])).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    # the activations' channel maxima are evened out: q/k/v's input maxima now equal, per channel,
    # max|X|^(1-alpha) * max|W|^alpha; at alpha 0.5 their spread shrinks
    smoothed = activation_maxima(weights, arch, IDS)
    for old, new in zip(maxima, smoothed):
        assert float(new["qkv"].max() / new["qkv"].min()) < float(old["qkv"].max() / old["qkv"].min())


def test_scales_follow_the_formula_and_stay_finite():
    act = torch.tensor([4.0, 1.0, 0.0])
    w1, w2 = torch.tensor([[1.0, -0.25, 0.0]]), torch.tensor([[0.5, 0.5, 0.0]])
    s = smoothing_scales(act, [w1, w2], alpha=0.5)
    torch.testing.assert_close(s[:2], torch.tensor([4.0 ** 0.5 / 1.0, 1.0 / 0.5 ** 0.5]))
    assert torch.isfinite(s).all() and float(s[2]) > 0  # a dead channel: floored, not 0 or inf


def model_profile(tmp_path: Path, model_lines: str):
    """A profile of tiny-llama3 random weights with `model_lines` added to its model section."""
    from inflightllm.profile import load_profile

    path = tmp_path / "p.yaml"
    path.write_text(f"name: t\nengine:\n  max_input_length: 512\n  max_output_len: 256\n"
                    f"model:\n  source: random\n  shape: tiny-llama3\n{model_lines}")
    return load_profile(path)


def test_profile_key(tmp_path):
    from inflightllm.profile import ProfileError

    def profile(model_lines: str):
        return model_profile(tmp_path, model_lines)

    assert profile("  quantization: fp8\n  fp8_smoothing: 0.5\n").model.fp8_smoothing == 0.5
    assert profile("  quantization: fp8\n  fp8_smoothing: 0\n").model.fp8_smoothing is None
    with pytest.raises(ProfileError, match=r"model.fp8_smoothing: 1.5 is out of range"):
        profile("  quantization: fp8\n  fp8_smoothing: 1.5\n")
    with pytest.raises(ProfileError, match=r"model.fp8_smoothing: only with model.quantization: fp8"):
        profile("  fp8_smoothing: 0.5\n")
    spec = profile("  quantization: fp8\n  fp8_smoothing: 0.75\n").model
    assert ModelSpec.from_parameters(spec.to_parameters()) == spec


def test_smoothing_meets_the_perplexity_goals_on_smollm2(smollm2_tokenizer):
    """The whole shipped text through the runner and paged cache (perf/perplexity.py): with
    alpha 0.5 the FP8 weights within 2 % of bf16's perplexity, with the FP8 KV cache within 3 %
    (issue 26's goals; without smoothing 1.029x and 1.034x)."""
    from perf.perplexity import TEXT, evaluate

    ids = smollm2_tokenizer(TEXT.read_text())["input_ids"]
    config = EngineConfig(max_num_tokens=256, max_batch_size=8, max_input_length=len(ids) + 16, max_output_len=16,
                          num_kv_blocks=-(-len(ids) // 16) + 8)
    ppl = {}
    for name, quantization, smoothing, kv in (("bf16", None, None, "auto"), ("fp8", "fp8", 0.5, "auto"),
                                              ("fp8-kv", "fp8", 0.5, "fp8")):
        spec = dataclasses.replace(DEFAULT_MODEL, dtype="bfloat16", quantization=quantization, fp8_smoothing=smoothing)
        result = evaluate(spec, dataclasses.replace(config, kv_cache_dtype=kv), ids, chunk=256)
        ppl[name] = float(result["nll"].mean().exp())
    assert ppl["fp8"] <= 1.02 * ppl["bf16"], ppl
    assert ppl["fp8-kv"] <= 1.03 * ppl["bf16"], ppl


def test_a_random_weight_model_smooths_and_generates():
    """A random-weight shape borrows the default tokenizer for its calibration (ids past its
    vocabulary left out) and generates as an FP8 model."""
    from inflightllm.engine import Engine
    from inflightllm.llm import LLM
    from inflightllm.sampling_params import SamplingParams

    spec = ModelSpec(source="random", shape="tiny-llama3", seed=0, dtype="bfloat16", quantization="fp8",
                     fp8_smoothing=0.5)
    engine = Engine(spec, EngineConfig(max_num_tokens=64, num_kv_blocks=16), sampler_seed=0)
    assert engine.loaded.quantization == "fp8"
    result = LLM(spec, engine=engine, load_tokenizer_too=False).generate(
        [[11, 400, 900, 33, 7]], [SamplingParams(max_tokens=6, ignore_eos=True)])[0]
    assert len(result.token_ids) == 6


@pytest.mark.server
def test_smoothing_runs_in_the_engine_models_stub(tmp_path, smollm2_tokenizer):
    """A profile with `fp8_smoothing` served by the real tritonserver: the calibration forward
    runs inside the Python backend's stub (whose interpreter decodes files as ASCII unless told
    otherwise: the calibration text must be read as UTF-8), and the served greedy ids equal
    the same spec's engine in process."""
    import yaml

    from inflightllm.engine import Engine
    from inflightllm.llm import LLM
    from inflightllm.profile import load_profile
    from inflightllm.sampling_params import SamplingParams
    from tests.conftest import start_triton_server
    from tests.ensemble_client import run_stream_requests
    from tools.render_configs import render

    data = yaml.safe_load((REPO_ROOT / "profiles" / "tiny-llama3-tp2-cpu.yaml").read_text(encoding="utf-8"))
    data["name"] = "tiny-llama3-fp8-smooth-cpu"
    data["device"]["tensor_parallel_size"] = 1
    data["model"].update(quantization="fp8", fp8_smoothing=0.5)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    profile = load_profile(path)
    render(profile, tmp_path / "repo")
    texts, max_tokens = ["The capital of France is", "Once upon a time"], [10, 6]
    server = start_triton_server(tmp_path / "repo", timeout=600.0)
    try:
        results = run_stream_requests(
            server.grpc_url,
            [{"text_input": t, "max_tokens": n, "stream": False, "exclude_input_in_output": True}
             for t, n in zip(texts, max_tokens)],
            num_streams=len(texts),
        )
    finally:
        server.stop()
    assert all(r.error is None for r in results), [r.error for r in results]
    served = [r.last("output_ids").reshape(-1).tolist() for r in results]
    engine = Engine(profile.model, profile.engine, sampler_seed=0)
    prompts = [smollm2_tokenizer.encode(text, add_special_tokens=True) for text in texts]
    expected = LLM(profile.model, engine=engine, load_tokenizer_too=False).generate(
        prompts, [SamplingParams(max_tokens=n) for n in max_tokens]
    )
    assert served == [r.token_ids for r in expected]
