"""FP8 on the GPU against the CPU-defined emulation (inflightllm.quantization.fp8).

- The activation-quantizing kernels (add+RMSNorm, SiLU*mul, plain rows) against torch ops
  followed by `quantize_per_token`: the same e4m3 bytes and scales (but for rare
  one-step roundings where the sum of squares is added in another order).
- `torch._scaled_mm` with our scales against `fp8.linear`.
- The FP8 engine (weights quantized at load) against transformers with the same e4m3
  weights as `Fp8Linear` modules (the emulation): greedy ids equal, or our token within
  the emulation's top-5 where they first differ.
- A compressed-tensors checkpoint loads on the GPU with the weights the CPU loader reads.
- Split-K FP8 GEMMs (INFLIGHTLLM_FP8_SPLIT_K) against torch._scaled_mm, alone and in an engine.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

from inflightllm.engine import Engine  # noqa: E402
from inflightllm.quantization.fp8 import (  # noqa: E402
    FP8_DTYPE,
    Fp8Linear,
    linear,
    quantize_per_channel,
    quantize_per_token,
)
from tests.gpu.test_gpu_engine import fresh_engine, gpu_config, make_prompts, model_spec, run  # noqa: E402


def _rows(tokens: int, width: int):
    return (torch.empty(tokens, width, dtype=FP8_DTYPE, device="cuda"),
            torch.empty(tokens, 1, dtype=torch.float32, device="cuda"))


def _assert_same_quantization(q, scale, ref_q, ref_scale, min_equal=0.999):
    assert torch.allclose(scale, ref_scale, rtol=2e-6, atol=0), (scale - ref_scale).abs().max()
    equal = float((q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean())
    assert equal >= min_equal, equal
    # where bytes differ, by one e4m3 step at most
    assert float((q.float() - ref_q.float()).abs().max()) <= float(ref_q.float().abs().max()) / 8


@pytest.mark.parametrize("kernels", ["tma", "v2", "16-byte", "scalar"])
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
def test_activation_quantizing_kernels_match_torch(tokens, kernels, monkeypatch):
    """The three FP8 quantizing kernels (version 2, the 16-byte _vec ones, the scalar ones; for
    SiLU*mul also the TMA version, Hopper) against quantize_per_token of the unfused ops, at
    Llama-3-8B's widths (14,336: 448 threads of 4 chunks; 56 KiB of shared memory for the TMA
    version) and narrower ones."""
    from inflightllm.gpu import ops
    from inflightllm.models.llama import RMSNorm

    vector = kernels != "scalar"
    if kernels == "tma" and not ops._hopper(torch.cuda.current_device()):
        pytest.skip("silu_and_mul_fp8_tma: Hopper and later")
    if kernels == "16-byte":
        monkeypatch.setattr(ops, "fp8_quant_v2", lambda: False)
    torch.manual_seed(tokens)
    hidden, inter, eps = 4096, 1536 if tokens % 2 else 14336, 1e-5
    dtype = torch.bfloat16
    residual = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
    delta = torch.randn(tokens, hidden, dtype=dtype, device="cuda") * 0.5
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    norm = RMSNorm(hidden, eps).to("cuda", dtype)
    norm.weight.data.copy_(weight)
    expected_residual = residual + delta
    ref_q, ref_scale = quantize_per_token(norm(expected_residual))
    q, scale = _rows(tokens, hidden)
    ours = residual.clone()
    with ops.torch_stream():
        ops.add_rms_norm_fp8(q, scale, delta, ours, weight, eps, vector=vector)
    torch.cuda.synchronize()
    assert torch.equal(ours, expected_residual)
    _assert_same_quantization(q, scale, ref_q, ref_scale)
    # no add (the first layer's norm)
    ref_q, ref_scale = quantize_per_token(norm(residual))
    with ops.torch_stream():
        ops.add_rms_norm_fp8(q, scale, None, residual, weight, eps, vector=vector)
    _assert_same_quantization(q, scale, ref_q, ref_scale)

    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device="cuda") * 2
    ref_q, ref_scale = quantize_per_token(torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:])
    q, scale = _rows(tokens, inter)
    with ops.torch_stream():
        ops.silu_and_mul_fp8(q, scale, gate_up, vector=vector, tma=kernels == "tma")
    _assert_same_quantization(q, scale, ref_q, ref_scale)
    if kernels == "tma":  # bit for bit version 2's
        q2, scale2 = _rows(tokens, inter)
        with ops.torch_stream():
            ops.silu_and_mul_fp8(q2, scale2, gate_up, tma=False)
        torch.cuda.synchronize()
        assert torch.equal(scale, scale2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))

    x = torch.randn(tokens, 960, dtype=dtype, device="cuda")
    x[0, 5] = 1e4  # the row's amax maps to 448 (no saturation)
    ref_q, ref_scale = quantize_per_token(x)
    q, scale = _rows(tokens, 960)
    with ops.torch_stream():
        ops.quant_rows_fp8(q, scale, x, vector=vector)
    _assert_same_quantization(q, scale, ref_q, ref_scale)


@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
def test_scaled_mm_matches_the_emulated_linear(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(1024, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    weight_q, weight_scale = quantize_per_channel(weight)
    x_q, x_scale = quantize_per_token(x)
    for fast in (False, True):
        ours = torch._scaled_mm(x_q, weight_q.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                                out_dtype=torch.bfloat16, use_fast_accum=fast).float()
        expected = linear(x.float(), weight_q, weight_scale)
        error = float((ours - expected).norm() / expected.norm())
        assert error < (2e-3 if not fast else 5e-3), (fast, error)


class Fp8Reference:
    """transformers' Llama on the GPU with the FP8 engine's weights: the 16-bit tensors as
    they are, each decoder linear an `Fp8Linear` over the engine's e4m3 rows and scales."""

    def __init__(self, engine: Engine):
        from transformers import LlamaConfig, LlamaForCausalLM

        from inflightllm.gpu.model import FP8_LINEARS

        loaded = engine.loaded
        gpu = loaded.model
        config = LlamaConfig(**{k: v for k, v in loaded.config.items() if k not in ("architectures",)})
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(loaded.dtype)
        try:
            with torch.device(loaded.device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default_dtype)
        plain = {name: t for name, t in gpu.hf_state_dict().items() if t.dtype != FP8_DTYPE}
        model.load_state_dict(plain, strict=False)
        q, kv, inter = gpu.q_size, gpu.kv_size, gpu.intermediate_size
        splits = {"qkv": (q, kv, kv), "o": (None,), "gate_up": (inter, inter), "down": (None,)}
        for index, layer in enumerate(gpu.layers):
            block = model.model.layers[index]
            for fused, modules in FP8_LINEARS.items():
                sizes = splits[fused]
                weights = [layer[fused]] if sizes == (None,) else torch.split(layer[fused].view(torch.uint8), sizes)
                scales = [layer[fused + "_scale"][0]] if sizes == (None,) else torch.split(layer[fused + "_scale"][0], sizes)
                for module, w, s in zip(modules, weights, scales):
                    parent, leaf = module.split(".")
                    setattr(getattr(block, parent), leaf, Fp8Linear(w.view(FP8_DTYPE).contiguous(), s.contiguous()))
        self.model = model.eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=self.model.device)
        return self.model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
            pad_token_id=0, eos_token_id=None,
        )[0, len(prompt):].tolist()

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([tokens], device=self.model.device)).logits[0, -1].float()

    def top_ids(self, tokens: list[int], k: int = 5) -> list[int]:
        return torch.topk(self.logits(tokens), k).indices.tolist()


@pytest.mark.parametrize("smoothing", [None, 0.5], ids=["plain", "smoothquant"])
def test_fp8_engine_follows_the_emulation(smoothing):
    spec = dataclasses.replace(model_spec("bfloat16"), quantization="fp8", fp8_smoothing=smoothing)
    engine = Engine(spec, gpu_config(), sampler_seed=0)
    assert engine.loaded.quantization == "fp8" and engine.loaded.model.fp8
    assert engine.loaded.model.layers[0]["qkv"].dtype == FP8_DTYPE
    reference = Fp8Reference(engine)
    prompts = make_prompts(8, engine.vocab_size, seed=9)
    results = run(engine, prompts, [24] * 8, [0, 0, 1, 1, 2, 3, 3, 4])
    equal = 0
    for prompt, result in zip(prompts, results):
        expected = reference.greedy(prompt, 24)
        if result.token_ids == expected:
            equal += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b)
        ours = result.token_ids[first]
        if ours not in reference.top_ids(prompt + expected[:first], 5):
            logits = reference.logits(prompt + expected[:first])
            rank = int((logits > logits[ours]).sum())
            pytest.fail(
                f"ours {ours} not in the emulation's top-5 at output position {first} (prompt of "
                f"{len(prompt)} tokens): its rank there {rank}, logit {float(logits[ours]):.3f} against the "
                f"top {float(logits.max()):.3f} ({int(logits.argmax())}); {equal} sequence(s) equal before it"
            )
    # (not all equal: one-token steps take the small-batch kernels, which keep activations in
    # bf16, W8A16, where the emulation quantizes them; and bf16 ties)
    print(f"fp8: {equal} of {len(prompts)} sequences equal the emulation's greedy ids; the rest within top-5")


def test_smoothing_on_the_gpu_folds_what_the_cpu_folds():
    """SmoothQuant at load (model.fp8_smoothing) on the GPU model's fused tensors: the smoothed
    norms and e4m3 weights within bf16 rounding of what the CPU code folds from the same
    16-bit weights (the calibration forward runs on each device), and different from the
    unsmoothed ones. The same weights: the GPU model's own before smoothing (random weights are
    drawn on the GPU, so the CPU loader's random model is another model)."""
    from inflightllm.gpu.model import load_gpu_model
    from inflightllm.models.loader import load_tokenizer
    from inflightllm.quantization.fp8 import quantize_per_channel
    from inflightllm.quantization.smoothing import calibration_ids, smooth_model_weights

    spec = dataclasses.replace(model_spec("bfloat16"), quantization="fp8", fp8_smoothing=0.5)
    config = gpu_config()
    unsmoothed = load_gpu_model(dataclasses.replace(spec, quantization=None, fp8_smoothing=None), config)
    weights = {name: tensor.detach().cpu().clone() for name, tensor in unsmoothed.model.hf_state_dict().items()}
    arch = unsmoothed.arch
    del unsmoothed
    plain = {name: tensor.clone() for name, tensor in weights.items()}
    ids = [token for token in calibration_ids(load_tokenizer(spec)) if token < arch.vocab_size]
    smooth_model_weights(weights, arch, ids, 0.5)  # the CPU's fold (the model's dtype, on the CPU)
    gpu = load_gpu_model(spec, config).model
    for index in (0, arch.num_layers - 1):
        p = f"model.layers.{index}."
        for fused, norm in (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm")):
            torch.testing.assert_close(gpu.layers[index][fused].float().cpu(), weights[p + norm + ".weight"].float(),
                                       rtol=1e-2, atol=1e-3)
            assert not torch.equal(weights[p + norm + ".weight"], plain[p + norm + ".weight"])
        down = gpu.layers[index]["down"].float().cpu() * gpu.layers[index]["down_scale"].float().cpu().view(-1, 1)
        down_q, down_scale = quantize_per_channel(weights[p + "mlp.down_proj.weight"])
        expected = down_q.float() * down_scale.float().view(-1, 1)
        assert float((down - expected).norm() / expected.norm()) < 5e-2


def test_compressed_tensors_checkpoint_loads_on_the_gpu(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from inflightllm.model_source import ModelSpec
    from inflightllm.models.loader import load_model
    from inflightllm.models.shapes import shape_config
    from tests import fp8_checkpoints as ckpt

    # SmolLM2's shape (head_dim 64, as the CUDA attention kernels need) with two layers
    config = AutoConfig.for_model(**dict(shape_config("smollm2-135m"), num_hidden_layers=2, initializer_range=0.25))
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    folder = ckpt.write_compressed_tensors(tmp_path / "base", tmp_path / "ct", strategy="tensor", kv=True)
    spec = ModelSpec(source="hf_folder", path=str(folder), dtype="bfloat16")
    engine = Engine(spec, gpu_config(max_num_tokens=512, max_input_length=256, max_output_len=64), sampler_seed=0)
    cpu = load_model(spec)
    gpu = engine.loaded.model
    assert engine.loaded.kv_scales == [ckpt.KV_SCALES] * 2
    q, kv = gpu.q_size, gpu.kv_size
    for index, layer in enumerate(gpu.layers):
        k_rows = layer["qkv"].view(torch.uint8)[q : q + kv].cpu()
        module = cpu.model.get_submodule(f"model.layers.{index}.self_attn.k_proj")
        assert torch.equal(k_rows, module.weight.view(torch.uint8))
        assert torch.equal(layer["qkv_scale"][0, q : q + kv].cpu(), module.weight_scale)
    results = run(engine, make_prompts(4, engine.vocab_size, seed=2), [8] * 4)
    assert all(len(r.token_ids) == 8 for r in results)


@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("rows, width", [(4096, 4096), (1536, 576), (576, 1536)])
def test_small_batch_fp8_gemv_matches_the_weight_only_reference(tokens, rows, width):
    """The small-batch GEMV over e4m3 rows (8 a load, scaled after the dot product) against
    `fp8.linear_weight_only`: the W8A16 reference the one-token steps follow."""
    from inflightllm.gpu import ops
    from inflightllm.quantization.fp8 import linear_weight_only

    torch.manual_seed(tokens + rows)
    x = torch.randn(tokens, width, dtype=torch.bfloat16, device="cuda")
    weight_q, weight_scale = quantize_per_channel(torch.randn(rows, width, device="cuda") * 0.02)
    out = torch.empty(tokens, rows, dtype=torch.bfloat16, device="cuda")
    with ops.torch_stream():
        ops.small_gemv(out, x, weight_q, None, weight_scale=weight_scale)
    torch.cuda.synchronize()
    expected = linear_weight_only(x, weight_q, weight_scale).float()
    error = float((out.float() - expected).norm() / expected.norm())
    assert error < 5e-3, error
    with pytest.raises(ValueError, match="FP8 weights need contiguous float32 scales"):
        ops.small_gemv(out, x, weight_q, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("rows, width", [(4096, 4096), (1537, 576), (576, 1536)])
def test_small_batch_int8_gemv_matches_the_weight_only_reference(tokens, rows, width, dtype):
    """The small-batch GEMV over int8 rows (model.int8_lm_head: bytes to floats exactly by prmt
    and one FADD, scaled after the dot product) against `fp8.linear_weight_only` on the same
    int8 values; an odd row count (the last warp's single row) and the chunk-by-chunk tail."""
    from inflightllm.gpu import ops
    from inflightllm.quantization.fp8 import linear_weight_only, quantize_rows_int8

    torch.manual_seed(tokens + rows)
    x = torch.randn(tokens, width, dtype=dtype, device="cuda")
    weight = torch.randn(rows, width, device="cuda") * 0.02
    weight[7, :5] = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.9])  # +-127 and the row's other values
    weight_q, weight_scale = quantize_rows_int8(weight)
    assert int(weight_q.min()) == -127 and int(weight_q.max()) == 127
    out = torch.empty(tokens, rows, dtype=dtype, device="cuda")
    with ops.torch_stream():
        ops.small_gemv(out, x, weight_q, None, weight_scale=weight_scale)
    torch.cuda.synchronize()
    expected = linear_weight_only(x, weight_q, weight_scale)
    exact = (x.float() @ weight_q.float().t()) * weight_scale[None, :]
    error = float((out.float() - exact).norm() / exact.norm())
    assert error < 2e-3, error
    assert float((out == expected).float().mean()) >= 0.99  # the same float32 sums, rounded alike
    with pytest.raises(ValueError, match="int8 weights need contiguous float32 scales"):
        ops.small_gemv(out, x, weight_q, None)
    with pytest.raises(ValueError, match="int8 weights go to small_gemv only"):
        ops._weight_args(weight_q, weight_scale, "qkv_norm_rope")


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_int8_lm_head_reads_int8_rows_in_one_token_steps(quantization):
    """model.int8_lm_head (16-bit or FP8 linears): steps of up to 4 rows compute their logits
    from the int8 copy of the LM head (small_gemv; `linear_weight_only` is the reference), larger
    steps keep the bf16 head, and batches of 1 and 3 requests decode through it (CUDA graphs on)."""
    from inflightllm.gpu import ops
    from inflightllm.quantization.fp8 import linear_weight_only

    spec = dataclasses.replace(model_spec("bfloat16"), quantization=quantization, int8_lm_head=True)
    engine = Engine(spec, gpu_config(), sampler_seed=0)
    model = engine.loaded.model
    weight_q, scale = model.lm_head_q
    assert weight_q.dtype == torch.int8 and weight_q.shape == model.lm_head.shape
    torch.manual_seed(5)
    hidden = torch.randn(5, model.arch.hidden_size, dtype=torch.bfloat16, device="cuda")
    with ops.torch_stream():
        small = {rows: model.compute_logits(hidden[:rows]) for rows in (1, 3, 4)}
        five = model.compute_logits(hidden)
    torch.cuda.synchronize()
    vocab = model.sampleable_vocab_size or five.shape[1]
    bf16 = torch.nn.functional.linear(hidden, model.lm_head).float()[:, :vocab]
    for rows, logits in small.items():
        expected = linear_weight_only(hidden[:rows], weight_q, scale.view(-1)).float()[:, :vocab]
        error = float((logits[:, :vocab] - expected).norm() / expected.norm())
        assert error < 5e-3, (rows, error)
        assert float((logits[:, :vocab] - bf16[:rows]).abs().max()) > 0  # the int8 head, not the bf16 one
    torch.testing.assert_close(five[:, :vocab], bf16, rtol=0, atol=0)
    for count in (1, 3):
        results = run(engine, make_prompts(count, engine.vocab_size, seed=6), [16] * count)
        assert all(len(r.token_ids) == 16 for r in results)


def test_fp8_lm_head_reads_e4m3_rows_in_one_token_steps():
    """model.fp8_lm_head: one-token steps compute their logits from the e4m3 copy of the LM
    head (small_gemv, weight-only: `linear_weight_only` is the reference); larger steps keep
    the bf16 head; a batch-1 request decodes through it (CUDA graphs on); a 16-bit model
    refuses the key, naming it."""
    from inflightllm.gpu import ops
    from inflightllm.gpu.model import load_gpu_model
    from inflightllm.quantization.fp8 import linear_weight_only

    spec = dataclasses.replace(model_spec("bfloat16"), quantization="fp8", fp8_lm_head=True)
    engine = Engine(spec, gpu_config(), sampler_seed=0)
    model = engine.loaded.model
    weight_q, scale = model.lm_head_q
    assert weight_q.dtype == FP8_DTYPE and weight_q.shape == model.lm_head.shape
    torch.manual_seed(3)
    hidden = torch.randn(2, model.arch.hidden_size, dtype=torch.bfloat16, device="cuda")
    with ops.torch_stream():
        one = model.compute_logits(hidden[:1])
        two = model.compute_logits(hidden)
    torch.cuda.synchronize()
    vocab = model.sampleable_vocab_size or one.shape[1]
    expected = linear_weight_only(hidden[:1], weight_q, scale.view(-1)).float()[:, :vocab]
    error = float((one[:, :vocab] - expected).norm() / expected.norm())
    assert error < 5e-3, error
    bf16 = torch.nn.functional.linear(hidden, model.lm_head).float()[:, :vocab]
    torch.testing.assert_close(two[:, :vocab], bf16, rtol=0, atol=0)
    assert float((one[:, :vocab] - bf16[:1]).abs().max()) > 0  # the e4m3 head, not the bf16 one
    results = run(engine, make_prompts(1, engine.vocab_size, seed=4), [16])
    assert len(results[0].token_ids) == 16
    with pytest.raises(ValueError, match="model.fp8_lm_head: .* is not served with FP8 weights"):
        load_gpu_model(dataclasses.replace(spec, quantization=None), gpu_config())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("rows, width", [(4096, 4096), (6144, 4096), (4096, 14336), (40, 256)])
def test_fp8_small_m_gemm_matches_the_w8a8_reference(tokens, rows, width, dtype):
    """ops.fp8_small_m_gemm (mma.sync e4m3, 8 warps splitting K, float32 sums) against the
    products of the same e4m3 values in float32 (quantization.fp8.linear's numbers): one to four
    token tiles, a partial last tile, a partial last block of channels (40 rows), a bias; the
    default layout and every other one of FP8_SMALL_M_LAYOUTS with room for the rows."""
    from inflightllm.gpu import ops

    if not ops.fp8_small_m_ok(tokens, width, torch.cuda.current_device()):
        pytest.skip("FP8 tensor cores: compute capability 8.9 and later")
    torch.manual_seed(tokens + rows + width)
    x_q, x_scale = quantize_per_token(torch.randn(tokens, width, device="cuda", dtype=dtype))
    weight_q, weight_scale = quantize_per_channel(torch.randn(rows, width, device="cuda") * 0.02)
    bias = torch.randn(rows, device="cuda", dtype=dtype)
    exact = (x_q.float() @ weight_q.float().t()) * x_scale * weight_scale[None, :] + bias.float()
    layouts = [None] + [layout for layout in ops.FP8_SMALL_M_LAYOUTS if 8 * layout[0] >= tokens]
    for layout in layouts:
        out = torch.full((tokens, rows), float("nan"), device="cuda", dtype=dtype)
        with ops.torch_stream():
            ops.fp8_small_m_gemm(out, x_q, x_scale.view(-1), weight_q, weight_scale, bias, layout=layout)
        torch.cuda.synchronize()
        error = float((out.float() - exact).norm() / exact.norm())
        assert error < 2e-3, (layout, error)
        if dtype == torch.bfloat16:  # float32 sums in another order (and the tensor cores' own adds), rounded alike
            assert float((out == exact.to(dtype)).float().mean()) >= 0.95, layout
    with pytest.raises(ValueError, match="layout .* one of"):
        ops.fp8_small_m_gemm(out, x_q, x_scale.view(-1), weight_q, weight_scale, layout=(1, 3, 0, 4))
    if tokens > 8:
        with pytest.raises(ValueError, match=f"layout .* for {tokens} rows"):
            ops.fp8_small_m_gemm(out, x_q, x_scale.view(-1), weight_q, weight_scale, layout=(1, 1, 0, 4))
    with pytest.raises(ValueError, match="at most 32 rows"):
        ops.fp8_small_m_gemm(torch.empty(33, rows, device="cuda", dtype=dtype),
                             torch.zeros(33, width, device="cuda").to(FP8_DTYPE),
                             torch.ones(33, device="cuda"), weight_q, weight_scale)


def test_fp8_small_m_decode_steps_follow_scaled_mm():
    """An FP8 engine's GEMMs of up to fp8_small_m_rows rows run fp8_small_m_gemm, CUDA graphs
    on; the first decode step's greedy ids equal torch._scaled_mm's (INFLIGHTLLM_FP8_SMALL_M_ROWS
    0) for 5 requests (the same e4m3 products; one near tie may round apart), and generation runs
    to the end."""
    from inflightllm.gpu import ops

    if not ops.fp8_small_m_ok(8, 64, torch.cuda.current_device()):
        pytest.skip("FP8 tensor cores: compute capability 8.9 and later")
    spec = dataclasses.replace(model_spec("bfloat16"), quantization="fp8")
    calls = []
    original = ops.fp8_small_m_gemm
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "fp8_small_m_gemm", lambda *args: calls.append(args[1].shape[0]) or original(*args))
        patch.setenv(ops.FP8_SMALL_M_ENV, "0")  # this engine's graphs capture torch._scaled_mm
        engine = Engine(spec, gpu_config(), sampler_seed=0)
        prompts = make_prompts(5, engine.vocab_size, seed=7)
        reference = run(engine, prompts, [12] * 5)
        assert not calls
        model = engine.loaded.model
        model.fp8_small_m_rows = ops.FP8_SMALL_M_MAX
        try:
            results = run(fresh_engine(engine), prompts, [12] * 5)
        finally:
            model.fp8_small_m_rows = 0
    assert calls and set(calls) <= set(range(1, 33))
    assert all(len(r.token_ids) == 12 for r in results)
    # the prefill's token equal; the first decode step's in (nearly) all: a near tie may round apart
    assert [r.token_ids[0] for r in results] == [r.token_ids[0] for r in reference]
    assert sum(r.token_ids[1] == ref.token_ids[1] for r, ref in zip(results, reference)) >= 4


@pytest.mark.parametrize("parts", [2, 4])
def test_split_k_grouped_gemm_matches_scaled_mm(parts):
    """INFLIGHTLLM_FP8_SPLIT_K's product (fp8_split_k.split_k_mm: the K slices as one
    torch._scaled_grouped_mm over views, the bf16 partials summed) equals torch._scaled_mm's
    within the partials' rounding, at the rows it is for and at the Llama-3-8B o and down shapes."""
    from inflightllm.gpu import fp8_split_k

    reason = fp8_split_k.unsupported(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    torch.manual_seed(parts)
    for n, k in ((4096, 4096), (4096, 14336), (960, 576)):
        weight_q, weight_scale = quantize_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        split, why = fp8_split_k.check(weight_q, weight_scale.view(1, -1), fp8_split_k.SplitK(parts, 512))
        assert split is not None, why
        slices, scales = fp8_split_k.weight_slices(weight_q, weight_scale.view(1, -1), parts)
        for rows in (33, 256, 512):
            x_q, x_scale = quantize_per_token(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
            got = fp8_split_k.split_k_mm(x_q, x_scale, slices, scales, split.flat_scales).float()
            whole = torch._scaled_mm(x_q, weight_q.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                                     out_dtype=torch.bfloat16).float()
            error = float((got - whole).norm() / whole.norm())
            assert error < 4e-3, (n, k, rows, error)


def test_split_k_engine_follows_scaled_mm(caplog):
    """An FP8 engine with INFLIGHTLLM_FP8_SPLIT_K=2:4096 runs its prefill GEMMs and its decode
    steps of 33-64 rows (CUDA graphs captured with split-K) by split-K; the prefill's and the first
    decode step's greedy tokens equal those of the engine without it (near ties may round apart),
    and generation runs to the end."""
    from inflightllm.gpu import fp8_split_k

    reason = fp8_split_k.unsupported(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    spec = dataclasses.replace(model_spec("bfloat16"), quantization="fp8")
    config = gpu_config(max_batch_size=64)
    engine = Engine(spec, config, sampler_seed=0)
    prompts = make_prompts(40, engine.vocab_size, seed=5)
    reference = run(engine, prompts, [12] * 40)
    del engine
    calls = []
    original = fp8_split_k.split_k_mm
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fp8_split_k.SPLIT_K_ENV, "2:4096")
        patch.setattr(fp8_split_k, "split_k_mm", lambda *args: calls.append(args[0].shape[0]) or original(*args))
        with caplog.at_level("INFO"):
            split_engine = Engine(spec, config, sampler_seed=0)
        model = split_engine.loaded.model
        assert model.fp8_split_k is not None, caplog.text
        assert {"qkv_split_k", "o_split_k", "down_split_k"} <= set(model.layers[0])
        assert "gate_up_split_k" not in model.layers[0]
        results = run(split_engine, prompts, [12] * 40)
    assert calls and min(calls) > 32  # up to 32 rows: fp8_small_m_gemm
    assert any(c <= 64 for c in calls)  # the decode graphs of 48 and 64 rows were captured with it
    assert any(c > 64 for c in calls)  # prefill steps
    assert all(len(r.token_ids) == 12 for r in results)
    assert sum(r.token_ids[0] == ref.token_ids[0] for r, ref in zip(results, reference)) >= 38
    assert sum(r.token_ids[1] == ref.token_ids[1] for r, ref in zip(results, reference)) >= 36
