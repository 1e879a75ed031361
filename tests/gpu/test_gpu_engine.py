"""The engine on a GPU against `transformers` on the same GPU and the same weights.

fp32: greedy ids equal `transformers`' `generate` for staggered, chunked, preempted and
prefix-hit schedules. bf16: where ids first differ, our token is within transformers'
top-5 there (and vice versa), as vLLM's tests compare. The weights are SmolLM2-135M's
when its prepared folder is in the model cache (the bundle seeds it), else seeded
random weights of its shape. Fused layer kernels are checked against torch ops.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from inflightllm.config import EngineConfig  # noqa: E402
from inflightllm.engine import Engine  # noqa: E402
from inflightllm.llm import LLM  # noqa: E402
from inflightllm.model_source import DEFAULT_MODEL, ModelSpec  # noqa: E402
from inflightllm.sampling_params import SamplingParams  # noqa: E402

MAX_TOKENS = [24, 8, 40, 16, 12, 32, 20, 28, 10, 36, 14, 22, 30, 18, 26, 34]


def model_spec(dtype: str) -> ModelSpec:
    """The real SmolLM2 when it can be prepared offline, else its shape with random weights."""
    if os.environ.get("INFLIGHTLLM_GPU_TEST_RANDOM") != "1":
        try:
            from inflightllm.model_source import prepare

            spec = dataclasses.replace(DEFAULT_MODEL, dtype=dtype)
            if (prepare(spec) / "model.safetensors").exists():
                return spec
        except Exception:  # noqa: BLE001 - the package is not there: fall back to random weights
            if os.environ.get("INFLIGHTLLM_GPU_TEST_REAL") == "1":
                raise
    if os.environ.get("INFLIGHTLLM_GPU_TEST_REAL") == "1":
        raise RuntimeError("INFLIGHTLLM_GPU_TEST_REAL=1 but the real SmolLM2 weights are not prepared")
    return ModelSpec(source="random", shape="smollm2-135m", seed=0, dtype=dtype)


def gpu_config(**overrides) -> EngineConfig:
    values = dict(
        device="gpu", gpu_ids=(0,), max_batch_size=32, max_num_tokens=2048, max_input_length=1024,
        max_output_len=256, num_kv_blocks=512, cuda_graphs=True, async_scheduling=True,
    )
    values.update(overrides)
    return EngineConfig(**values)


def make_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 33, 64, 9, 120, 47, 250, 3, 71, 16, 32, 90, 15, 200, 40]
    return [torch.randint(10, vocab, (lengths[i % len(lengths)],), generator=generator).tolist() for i in range(count)]


class Reference:
    """transformers' LlamaForCausalLM on the GPU with the engine's weights."""

    def __init__(self, engine: Engine):
        from transformers import LlamaConfig, LlamaForCausalLM

        loaded = engine.loaded
        config = LlamaConfig(**{k: v for k, v in loaded.config.items() if k not in ("architectures",)})
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(loaded.dtype)
        try:
            with torch.device(loaded.device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default_dtype)
        missing, unexpected = model.load_state_dict(loaded.model.hf_state_dict(), strict=False)
        assert not unexpected, unexpected
        assert all("rotary" in name or name == "lm_head.weight" for name in missing), missing
        self.model = model.eval()
        self.eos = loaded.eos_token_ids
        self.cache: dict = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self.cache:
            ids = torch.tensor([prompt], device=self.model.device)
            out = self.model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                pad_token_id=0, eos_token_id=None,
            )[0, len(prompt):].tolist()
            self.cache[key] = out
        return self.cache[key]

    @torch.inference_mode()
    def top_ids(self, tokens: list[int], k: int = 5) -> list[int]:
        logits = self.model(torch.tensor([tokens], device=self.model.device)).logits[0, -1].float()
        return torch.topk(logits, k).indices.tolist()


@pytest.fixture(scope="module")
def fp32_engine_and_reference():
    engine = Engine(model_spec("float32"), gpu_config(), sampler_seed=0)
    return engine, Reference(engine)


def run(engine, prompts, max_tokens, arrivals=None, ignore_eos=True):
    llm = LLM(engine.model_spec, engine=engine, load_tokenizer_too=False)
    params = [SamplingParams(max_tokens=n, ignore_eos=ignore_eos) for n in max_tokens]
    return llm.generate(prompts, params, arrival_steps=arrivals)


def fresh_engine(engine: Engine, **overrides) -> Engine:
    """Another engine over the same loaded weights with other scheduling settings."""
    return Engine(engine.model_spec, gpu_config(**overrides), sampler_seed=0, loaded=engine.loaded)


def assert_equal(reference, prompts, max_tokens, results):
    bad = [
        f"prompt {i}: ours {r.token_ids} != transformers {reference.greedy(p, n)}"
        for i, (p, n, r) in enumerate(zip(prompts, max_tokens, results))
        if r.token_ids != reference.greedy(p, n)
    ]
    assert not bad, "\n".join(bad)


def test_fp32_staggered_inflight_equals_transformers(fp32_engine_and_reference):
    engine, reference = fp32_engine_and_reference
    prompts = make_prompts(16, engine.vocab_size)
    arrivals = [0, 0, 1, 2, 3, 3, 5, 8, 9, 12, 13, 15, 18, 21, 22, 25]
    results = run(engine, prompts, MAX_TOKENS, arrivals)
    assert_equal(reference, prompts, MAX_TOKENS, results)
    assert engine.runner.graphs, "decode steps should have CUDA graphs"


def test_fp32_chunked_prefill_equals_transformers(fp32_engine_and_reference):
    engine, reference = fp32_engine_and_reference
    chunked = fresh_engine(engine, max_num_tokens=40, max_batch_size=8)
    prompts = make_prompts(8, engine.vocab_size, seed=1)
    results = run(chunked, prompts, MAX_TOKENS[:8], [0, 0, 0, 1, 1, 2, 3, 4])
    assert_equal(reference, prompts, MAX_TOKENS[:8], results)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_fp32_preemption_equals_transformers(fp32_engine_and_reference, mode):
    """Preempted requests are recomputed, or (swap) their KV blocks go to host memory and
    come back by CUDA copies, or (auto) either by the measured costs; the ids stay
    transformers'."""
    engine, reference = fp32_engine_and_reference
    settings = {"preemption_mode": mode} | ({"swap_space_blocks": 200} if mode != "recompute" else {})
    tight = fresh_engine(engine, num_kv_blocks=40, max_batch_size=8, **settings)
    prompts = make_prompts(8, engine.vocab_size, seed=2)
    max_tokens = [40] * 8
    results = run(tight, prompts, max_tokens)
    stats = tight.stats()
    assert stats.num_preemptions_total > 0, "the schedule should have preempted"
    if mode == "swap":
        assert stats.num_swapped_out_total > 0, "the schedule should have swapped requests out"
    if mode == "recompute":
        assert stats.num_swapped_out_total == 0 and stats.num_recomputed_tokens_total > 0
    assert stats.num_swapped_in_blocks_total <= stats.num_swapped_out_blocks_total
    assert stats.swapped_out_bytes_total == stats.num_swapped_out_blocks_total * tight.host_link.bytes_per_block
    assert_equal(reference, prompts, max_tokens, results)


def test_fp32_guaranteed_no_evict_equals_transformers(fp32_engine_and_reference):
    """The cache of the preemption test: guaranteed_no_evict holds requests back instead."""
    engine, reference = fp32_engine_and_reference
    tight = fresh_engine(engine, num_kv_blocks=40, max_batch_size=8, capacity_policy="guaranteed_no_evict")
    prompts = make_prompts(8, engine.vocab_size, seed=2)
    max_tokens = [40] * 8
    results = run(tight, prompts, max_tokens)
    stats = tight.stats()
    assert stats.num_preemptions_total == 0 and stats.num_recomputed_tokens_total == 0
    assert_equal(reference, prompts, max_tokens, results)


def test_host_link_is_measured_at_start(fp32_engine_and_reference):
    """The runner's timed pinned copy: a plausible PCIe / C2C figure, and the bytes of one
    block of the whole cache (every layer, K and V)."""
    engine, _ = fp32_engine_and_reference
    link = engine.host_link
    runner = engine.runner
    assert link.bytes_per_block * runner.num_blocks == runner.kv_cache_bytes
    assert 1e9 < link.bytes_per_second < 1e12, link
    stats = engine.stats()
    assert stats.host_link_bytes_per_second == link.bytes_per_second


def test_fp32_prefix_hits_equal_transformers(fp32_engine_and_reference):
    engine, reference = fp32_engine_and_reference
    shared = make_prompts(8, engine.vocab_size, seed=3)[7]  # 250 tokens: 15 full blocks shared
    prompts = [shared + tail for tail in make_prompts(6, engine.vocab_size, seed=4)]
    cached = fresh_engine(engine)
    first = run(cached, prompts[:1], [16])
    rest = run(cached, prompts[1:], [16] * 5)
    assert cached.stats().prefix_cache_hits > 0
    assert_equal(reference, prompts, [16] * 6, first + rest)


def test_min_tokens_holds_back_stop_ids_in_the_batched_gpu_sampler(fp32_engine_and_reference):
    """min_tokens: the stop id a request would emit early is banned until its minimum (all
    such rows in one write); a request without a minimum in the same batch stops on it."""
    engine, reference = fp32_engine_and_reference
    prompt = make_prompts(1, engine.vocab_size, seed=7)[0]
    greedy = reference.greedy(prompt, 12)
    at = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])  # its first occurrence
    stop = greedy[at]  # a request stopping on it ends after `at` tokens (the stop id is dropped)
    llm = LLM(engine.model_spec, engine=engine, load_tokenizer_too=False)
    held, free = llm.generate([prompt, prompt], [
        SamplingParams(max_tokens=12, min_tokens=8, ignore_eos=True, stop_sequences=((stop,),)),
        SamplingParams(max_tokens=12, ignore_eos=True, stop_sequences=((stop,),)),
    ])
    assert free.token_ids == greedy[:at]
    assert len(held.token_ids) >= 8 and stop not in held.token_ids[:8], held.token_ids
    assert held.token_ids[:at] == greedy[:at]


def test_fp32_eager_synchronous_equals_transformers(fp32_engine_and_reference):
    engine, reference = fp32_engine_and_reference
    eager = fresh_engine(engine, cuda_graphs=False, async_scheduling=False)
    assert not eager.runner.graphs
    prompts = make_prompts(6, engine.vocab_size, seed=5)
    assert_equal(reference, prompts, [20] * 6, run(eager, prompts, [20] * 6))


def assert_within_top5(reference, prompts, results, max_tokens: int) -> int:
    """Where our greedy ids first differ from transformers', our token is within its top-5
    there. Returns how many sequences diverged."""
    diverged = 0
    for prompt, result in zip(prompts, results):
        expected = reference.greedy(prompt, max_tokens)
        if result.token_ids == expected:
            continue
        diverged += 1
        first = next(i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b)
        context = prompt + expected[:first]
        assert result.token_ids[first] in reference.top_ids(context, 5), (
            f"ours {result.token_ids[first]} not in transformers' top-5 at output position {first}"
        )
    return diverged


def test_bf16_within_top5_at_first_divergence():
    engine = Engine(model_spec("bfloat16"), gpu_config(), sampler_seed=0)
    reference = Reference(engine)
    prompts = make_prompts(8, engine.vocab_size, seed=6)
    results = run(engine, prompts, [32] * 8, [0, 0, 1, 1, 2, 3, 3, 4])
    diverged = assert_within_top5(reference, prompts, results, 32)
    print(f"bf16: {diverged} of {len(prompts)} sequences diverged, each within top-5 at the first divergence")


def test_bf16_long_whole_prompts_on_cudnn_within_top5(monkeypatch):
    """Three whole prompts of 640 tokens in one step are one dense cuDNN call (Hopper), the
    fourth, cut by the 2048-token budget, goes through flash varlen as a first and a later
    chunk; greedy ids within transformers' top-5 at the first divergence."""
    from inflightllm.attention.cuda.backend import CudaPagedAttention

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN dense prefill attention is taken on Hopper or later")
    calls = []
    dense = CudaPagedAttention._dense

    def counting(self, q, k, v, prompts, length, out):
        calls.append((prompts, length))
        return dense(self, q, k, v, prompts, length, out)

    monkeypatch.setattr(CudaPagedAttention, "_dense", counting)
    engine = Engine(model_spec("bfloat16"), gpu_config(), sampler_seed=0)
    reference = Reference(engine)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(10, engine.vocab_size, (n,), generator=generator).tolist() for n in (640, 640, 640, 700)]
    calls.clear()  # (the start's profiling step is one whole prompt too)
    results = run(engine, prompts, [16] * 4)
    layers = engine.loaded.config["num_hidden_layers"]
    assert calls.count((3, 640)) == layers, calls
    diverged = assert_within_top5(reference, prompts, results, 16)
    print(f"bf16 long prompts: {diverged} of {len(prompts)} sequences diverged, each within top-5")


def test_sampling_on_gpu_is_seeded_and_valid(fp32_engine_and_reference):
    engine, _ = fp32_engine_and_reference
    llm = LLM(engine.model_spec, engine=engine, load_tokenizer_too=False)
    prompts = make_prompts(4, engine.vocab_size, seed=7)
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=12, temperature=0.7, min_p=0.1, seed=13, ignore_eos=True, top_logprobs=3),
        SamplingParams(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True, min_tokens=4),
    ]
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    for a, b in zip(first, second):
        assert len(a.token_ids) == 12
        assert a.token_ids == b.token_ids  # seeded rows repeat; the greedy row is deterministic
    assert all(lp <= 0.0 for lp in first[1].logprobs) and len(first[1].logprobs) == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_kernels_match_torch(dtype):
    from inflightllm.gpu import ops
    from inflightllm.models.llama import RMSNorm, apply_rotary

    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens, hidden, heads, kv_heads, head_dim = 37, 576, 9, 3, 64
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    residual = torch.randn(tokens, hidden, device=device, dtype=dtype)
    norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, device=device, dtype=dtype) + 0.5)
    with ops.torch_stream():
        out = torch.full_like(x, float("nan"))
        ops.rms_norm(out, x, norm.weight, 1e-5)
        # fp32: the sum of squares is reduced in another order than torch's mean: rounding only.
        torch.testing.assert_close(out, norm(x), rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2)
        h, r = x.clone(), residual.clone()
        ops.add_rms_norm(h, r, norm.weight, 1e-5)
        torch.testing.assert_close(r, residual + x, rtol=0, atol=0)
        torch.testing.assert_close(h, norm(residual + x), rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2)
        # The 16-byte kernel (taken above) against the scalar one: the same residual bits, the
        # normed rows within one rounding (the sum of squares is added in another order).
        h_scalar, r_scalar = x.clone(), residual.clone()
        ops.add_rms_norm(h_scalar, r_scalar, norm.weight, 1e-5, vector=False)
        assert torch.equal(r_scalar, r)
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding step of the normed value
        torch.testing.assert_close(h_scalar, h, rtol=tol, atol=tol)
        gate_up = torch.randn(tokens, 2 * 1536, device=device, dtype=dtype)
        act = ops.silu_and_mul(torch.empty(tokens, 1536, device=device, dtype=dtype), gate_up)
        expected = torch.nn.functional.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
        torch.testing.assert_close(act, expected, rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2)
        # The 16-byte vector kernel (taken above) rounds exactly as the scalar one (odd widths).
        scalar = torch.full_like(act, float("nan"))
        ops._kernel("silu_and_mul", dtype)(
            (64,), (256,), (ops._ptr(scalar), ops._ptr(gate_up), np.int32(1536), np.int64(tokens * 1536))
        )
        torch.cuda.synchronize()
        assert torch.equal(scalar, act)
        odd_gate_up = torch.randn(tokens, 2 * 1539, device=device, dtype=dtype)
        odd = ops.silu_and_mul(torch.empty(tokens, 1539, device=device, dtype=dtype), odd_gate_up)
        torch.testing.assert_close(
            odd, torch.nn.functional.silu(odd_gate_up[:, :1539]) * odd_gate_up[:, 1539:],
            rtol=1e-6, atol=1e-6 if dtype == torch.float32 else 1e-2,
        )
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
        positions = torch.randint(0, 4000, (tokens,), device=device)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        freqs = torch.arange(4096, device=device).float()[:, None] * inv_freq[None, :]
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype)
        q_ref = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim).clone()
        k_ref = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim).clone()
        emb = torch.cat((freqs, freqs), -1)[positions]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        qkv_scalar = qkv.clone()
        ops.rotary(qkv[:, : heads * head_dim], qkv[:, heads * head_dim :], positions, cos_sin, heads, kv_heads, head_dim)
        ops.rotary(qkv_scalar[:, : heads * head_dim], qkv_scalar[:, heads * head_dim :], positions, cos_sin, heads,
                   kv_heads, head_dim, vector=False)
        torch.cuda.synchronize()
    assert torch.equal(qkv_scalar, qkv)  # the 16-byte kernel (rotary_vec) rounds as the scalar one
    torch.testing.assert_close(qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim), apply_rotary(q_ref, cos, sin))
    torch.testing.assert_close(
        qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim),
        apply_rotary(k_ref, cos, sin),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_small_batch_kernels_match_the_unfused_ops(dtype, tokens):
    """The fused small-batch kernels (norm+GEMV+RoPE, norm+GEMV+SiLU*mul, GEMV) against the
    unfused path: add_rms_norm, cuBLAS, rotary, silu_and_mul. The residual sum is bitwise the
    same; GEMV outputs differ only by summation order (rounding). Widths exercise both the
    unrolled main loop and the tail loop of the kernels."""
    from inflightllm.gpu import ops

    device = torch.device("cuda")
    torch.manual_seed(tokens)
    hidden, heads, kv_heads, head_dim, inter = 1024, 16, 4, 64, 2816
    width = (heads + 2 * kv_heads) * head_dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    residual, delta = rand(tokens, hidden), rand(tokens, hidden)
    norm_w = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    w_qkv, b_qkv = rand(width, hidden, scale=0.02), rand(width, scale=0.1)
    w_gate_up, w_down, w_o = rand(2 * inter, hidden, scale=0.02), rand(hidden, inter, scale=0.02), rand(hidden, hidden, scale=0.02)
    positions = torch.randint(0, 4000, (tokens,), device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.arange(4096, device=device).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype).contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with ops.torch_stream():
        # reference: the unfused ops
        ref_res, ref_h = residual.clone(), delta.clone()
        ops.add_rms_norm(ref_h, ref_res, norm_w, 1e-5)
        ref_qkv = torch.nn.functional.linear(ref_h, w_qkv, b_qkv)
        ops.rotary(ref_qkv[:, : heads * head_dim], ref_qkv[:, heads * head_dim :], positions, cos_sin, heads, kv_heads, head_dim)
        ref_first = torch.empty_like(residual)
        ops.rms_norm(ref_first, residual, norm_w, 1e-5)
        ref_first_qkv = torch.nn.functional.linear(ref_first, w_qkv, b_qkv)
        ops.rotary(ref_first_qkv[:, : heads * head_dim], ref_first_qkv[:, heads * head_dim :], positions, cos_sin,
                   heads, kv_heads, head_dim)
        ref_act = ops.silu_and_mul(torch.empty(tokens, inter, device=device, dtype=dtype),
                                   torch.nn.functional.linear(ref_h, w_gate_up))
        ref_down = torch.nn.functional.linear(ref_act, w_down)
        ref_o = torch.nn.functional.linear(ref_h, w_o)

        qkv = torch.full((tokens, width), float("nan"), device=device, dtype=dtype)
        out_res = torch.full_like(residual, float("nan"))
        ops.qkv_norm_rope(qkv, residual, delta, out_res, norm_w, w_qkv, b_qkv, positions, cos_sin,
                          heads, kv_heads, head_dim, 1e-5)
        # the same with the K/V cache write in the epilogue, against reshape_and_cache
        from inflightllm.attention.cuda import ops as attention_ops

        caches = [torch.zeros(4, 16, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(4)]
        slots = torch.randperm(64, device=device)[:tokens]
        if tokens > 1:
            slots[1] = -1  # padding: skipped
        k_ref = ref_qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
        v_ref = ref_qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
        attention_ops.reshape_and_cache(k_ref, v_ref, caches[0], caches[1], slots, attention_ops.current_stream())
        cached_qkv = torch.full_like(qkv, float("nan"))
        ops.qkv_norm_rope(cached_qkv, residual, delta, torch.empty_like(residual), norm_w, w_qkv, b_qkv, positions,
                          cos_sin, heads, kv_heads, head_dim, 1e-5, slots, caches[2], caches[3])
        first_qkv = torch.full_like(qkv, float("nan"))
        untouched = torch.full_like(residual, float("nan"))
        ops.qkv_norm_rope(first_qkv, residual, None, untouched, norm_w, w_qkv, b_qkv, positions, cos_sin,
                          heads, kv_heads, head_dim, 1e-5)
        act = torch.full((tokens, inter), float("nan"), device=device, dtype=dtype)
        out_res2 = torch.full_like(residual, float("nan"))
        ops.gate_up_norm_silu(act, residual, delta, out_res2, norm_w, w_gate_up, None, 1e-5)
        down = ops.small_gemv(torch.full_like(residual, float("nan")), ref_act, w_down, None)
        o = ops.small_gemv(torch.full_like(residual, float("nan")), ref_h, w_o, None)
        torch.cuda.synchronize()
    assert torch.equal(out_res, ref_res) and torch.equal(out_res2, ref_res)
    assert torch.isnan(untouched).all(), "without a delta the kernel writes no residual"
    torch.testing.assert_close(qkv, ref_qkv, **tol)
    assert torch.equal(cached_qkv, qkv)
    torch.testing.assert_close(caches[2], caches[0], **tol)  # keys: written where the reference wrote
    torch.testing.assert_close(caches[3], caches[1], **tol)  # values
    assert (caches[2] != 0).sum() == (caches[0] != 0).sum()
    torch.testing.assert_close(first_qkv, ref_first_qkv, **tol)
    torch.testing.assert_close(act, ref_act, **tol)
    torch.testing.assert_close(down, ref_down, **tol)
    torch.testing.assert_close(o, ref_o, **tol)


def test_fp32_small_batch_kernels_equal_transformers(monkeypatch):
    """The engine with the small-batch kernels forced on for float32 (every step of at most
    8 tokens, CUDA graphs of buckets 1-8 included) still gives transformers' greedy ids."""
    from inflightllm.gpu import model as gpu_model

    monkeypatch.setenv(gpu_model.SMALL_BATCH_ENV, "on")
    monkeypatch.setattr(gpu_model, "SMALL_BATCH_MAX_TOKENS", 8)
    engine = Engine(model_spec("float32"), gpu_config(max_batch_size=8), sampler_seed=0)
    assert engine.loaded.model.small_batch_kernels
    reference = Reference(engine)
    prompts = [p[:8] for p in make_prompts(8, engine.vocab_size, seed=9)]
    results = run(engine, prompts, [24] * 8, [0, 0, 1, 2, 3, 5, 8, 9])
    assert_equal(reference, prompts, [24] * 8, results)
    assert engine.runner.graphs


def test_the_gpu_sampler_does_not_wait_for_the_gpu():
    """min_tokens bans, penalties and bad words queue their work without a host-device sync
    (under asynchronous scheduling a sync in the sampler made the host wait for the step in
    flight: on the H200 the min_tokens ban's `logits[r, c] = float` was half of the engine
    process's CPU through the server). torch's sync debug mode raises on any synchronizing
    call; the results are checked against the same sampler on the CPU."""
    from inflightllm.gpu.sampler import GpuSampler
    from inflightllm.gpu.staging import PinnedStaging
    from inflightllm.request import Request

    device = torch.device("cuda", 0)
    vocab = 512
    params = [
        SamplingParams(min_tokens=4, stop_sequences=((9,),)),
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(bad_words=((5,), (1, 7))),
        SamplingParams(),
    ]

    def states():
        made = []
        for i, p in enumerate(params):
            state = Request(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], params=p, eos_token_ids=frozenset({2}))
            state.token_ids.extend([4, 4, 1])  # ends with 1: the bad word (1, 7) bans 7
            made.append(state)
        return made

    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 2] = logits[0, 9] = 50.0  # the stop ids would win if they were not banned
    logits[2, 5] = logits[2, 7] = 50.0  # the bad words would win
    rows = np.arange(len(params))
    results = {}
    for where in ("cpu", "cuda"):
        here = torch.device(where) if where == "cpu" else device
        staging = PinnedStaging(device) if where == "cuda" else None
        sampler = GpuSampler(here, max_rows=8, seed=0, upload=staging.upload if staging else None)
        requests = states()
        for row, state in zip(rows, requests):
            sampler.add_row(int(row), state)
        batch = logits.to(here)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = sampler.sample(batch, rows, requests, np.zeros(len(params), np.int64))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[where] = result.token_ids.cpu().tolist()
    assert results["cuda"] == results["cpu"]
    assert results["cuda"][0] not in (2, 9) and results["cuda"][2] not in (5, 7)


def test_greedy_steps_take_the_argmax_of_16_bit_logits_with_the_float32_ids():
    """The runner's LM head gives bf16 logits; an all-greedy step takes its argmax on them
    (no float32 copy) without a host sync, and its ids are those of the float32 logits, ties
    included, at the Llama 3 vocabulary and a throughput batch."""
    from inflightllm.gpu.sampler import GpuSampler
    from inflightllm.gpu.staging import PinnedStaging
    from inflightllm.request import Request

    device = torch.device("cuda", 0)
    rows = 1024
    logits = (torch.randn(rows, 128256, device=device, generator=torch.Generator(device).manual_seed(3)) * 4)
    logits = logits.to(torch.bfloat16)
    logits[7, 100] = logits[7, 90000] = logits[7].max() + 1  # a tie: the first id wins
    sampler = GpuSampler(device, max_rows=rows, seed=0, upload=PinnedStaging(device).upload)
    requests = [Request(request_id=f"r{i}", prompt_token_ids=[1], params=SamplingParams()) for i in range(rows)]
    for row, state in enumerate(requests):
        sampler.add_row(row, state)
    expected = logits.float().argmax(dim=-1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = sampler.sample(logits, np.arange(rows), requests, np.zeros(rows, np.int64))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(result.token_ids, expected) and result.token_ids[7].item() == 100


def test_pdl_launches_give_the_same_tokens(monkeypatch):
    """Programmatic dependent launch (inflightllm/gpu/pdl.py) changes when kernels start, not
    what they compute: bf16 greedy ids with it equal those without, over staggered arrivals
    (eager mixed steps, decode graphs of several buckets) and a long tail at batch 1 (the fused
    small-batch kernels in the bucket-1 graph)."""
    from inflightllm.gpu import pdl

    if torch.cuda.get_device_capability(0)[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    prompts = make_prompts(12, 49152, seed=21)
    max_tokens = [8, 16, 12, 10, 14, 9, 16, 11, 13, 15, 12, 64]
    arrivals = [0, 0, 0, 1, 1, 2, 3, 3, 4, 6, 8, 9]
    results, loaded = {}, None
    try:
        for setting in ("0", "1"):
            monkeypatch.setenv(pdl.ENV, setting)
            pdl.enabled.cache_clear()
            engine = Engine(model_spec("bfloat16"), gpu_config(), sampler_seed=0, loaded=loaded)
            loaded = engine.loaded
            assert engine.loaded.model.small_batch_kernels
            assert pdl.enabled(0) == (setting == "1")
            results[setting] = [r.token_ids for r in run(engine, prompts, max_tokens, arrivals)]
    finally:
        pdl.enabled.cache_clear()
    assert [len(ids) for ids in results["1"]] == max_tokens
    assert results["1"] == results["0"]
