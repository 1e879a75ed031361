"""The batched sampler on CUDA draws from the reference sampler's distributions, as the CPU
tests check on the CPU device (tests/test_gpu_sampler_distributions.py, whose helpers
these use): kept sets and probabilities, chi-square tests of 20,000 draws, penalties from
the device counts, log probs, seeded rows independent of their neighbours; and, at Llama
3's shape (1,024 rows x 128,256 bf16 logits), every path runs without a host sync."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from inflightllm.gpu.sampler import TOP_K_MAX, GpuSampler  # noqa: E402
from inflightllm.request import Request  # noqa: E402
from inflightllm.sampler import sampling_distribution  # noqa: E402
from inflightllm.sampling_params import SamplingParams  # noqa: E402
from tests.test_gpu_sampler_distributions import (  # noqa: E402
    PENALTIES,
    SETTINGS,
    assert_follows,
    draws,
    gpu_and_reference,
    kept_as_the_reference,
    random_settings,
    reference_adjusted,
    request,
    sampler_for,
)

CUDA = torch.device("cuda", 0)


def staged_sampler(rows: int, seed: int = 0) -> GpuSampler:
    from inflightllm.gpu.staging import PinnedStaging

    return GpuSampler(CUDA, max_rows=rows, seed=seed, upload=PinnedStaging(CUDA).upload)


def test_kept_sets_and_probabilities_on_cuda_equal_the_reference():
    rng = np.random.default_rng(0)
    for trial in range(40):
        vocab = int(rng.choice([50, 300, 1200]))
        logits = torch.from_numpy(rng.normal(size=(8, vocab)).astype(np.float32) * 3)
        for row, params, got, reference in gpu_and_reference(logits, [random_settings(rng) for _ in range(8)], CUDA):
            assert kept_as_the_reference(logits[row], params, got, reference) == "same", (trial, params)
            torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_draws_on_cuda_follow_the_reference_distribution(params):
    logits = torch.randn(48, generator=torch.Generator().manual_seed(11)) * 2
    expected = sampling_distribution(logits.clone(), params)
    assert_follows(draws(params, logits, 20_000, seed=1, device=CUDA), (expected / expected.sum()).double().numpy())


def test_penalties_on_cuda_follow_the_sampled_ids():
    vocab = 300
    states = [request(p, prompt=(1, 5, 5, 9), outputs=(5, 7), name=f"r{i}") for i, p in enumerate(PENALTIES)]
    sampler, rows = sampler_for(states, rows=[4, 0, 6, 2, 1], device=CUDA)
    generator = torch.Generator().manual_seed(5)
    for _step in range(6):
        logits = (torch.randn(len(states), vocab, generator=generator) * 3).to(torch.bfloat16)
        expected = reference_adjusted(logits, states)
        with torch.inference_mode():
            adjusted = sampler._apply_penalties(logits.to(CUDA), rows, sampler.params.wants_logprobs[rows], {})
        torch.testing.assert_close(adjusted.cpu(), expected, atol=0, rtol=1e-6)
        ids = sampler.sample(logits.to(CUDA), rows, states).token_ids.tolist()
        for state, token in zip(states, ids):
            state.token_ids.append(token)


def test_log_probs_on_cuda_equal_log_softmax():
    params = [SamplingParams(logprobs=True), SamplingParams(temperature=0.8, top_k=50, top_p=0.95, top_logprobs=5),
              SamplingParams(), SamplingParams(temperature=1.0, repetition_penalty=1.1, top_logprobs=5)]
    states = [request(p, outputs=(4, 9), name=f"r{i}") for i, p in enumerate(params)]
    sampler, rows = sampler_for(states, device=CUDA)
    logits = (torch.randn(len(params), 128256, generator=torch.Generator().manual_seed(6)) * 4).to(torch.bfloat16)
    # On the GPU too: CUDA's and the CPU's float32 sums over 128k entries differ by ~1e-5.
    expected = torch.log_softmax(logits.to(CUDA).float(), dim=-1).cpu()
    ids, logprobs, top_ids, top_values = sampler(logits.to(CUDA), rows, states)
    for i, p in enumerate(params):
        if not (p.logprobs or p.top_logprobs):
            continue
        assert logprobs[i] == pytest.approx(float(expected[i, ids[i]]), abs=5e-5)
        if p.top_logprobs:
            values, _ = torch.topk(expected[i], p.top_logprobs)
            assert top_values[i] == pytest.approx(values.tolist(), abs=5e-5)
            assert expected[i, top_ids[i]].tolist() == pytest.approx(values.tolist(), abs=5e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=7, seed=11),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11),
    SamplingParams(temperature=1.0, top_k=TOP_K_MAX + 3, seed=11),
], ids=["top-k", "top-p", "large-top-k"])
def test_a_seeded_row_on_cuda_draws_the_same_tokens_whatever_its_neighbours(params):
    vocab = 4096
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(9))

    def run(neighbours, position, sampler_seed):
        others = [request(p, name=f"n{i}") for i, p in enumerate(neighbours)]
        states = others[:position] + [request(params, name="seeded")] + others[position:]
        sampler, rows = sampler_for(states, seed=sampler_seed, rows=np.arange(len(states)) * 3, device=CUDA)
        tokens = []
        for step in range(5):
            batch = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(50 + step))
            batch[position] = logits[step]
            tokens.append(sampler.sample(batch.to(CUDA), rows, states).token_ids[position].item())
        return tokens

    neighbours = [SamplingParams(temperature=1.0, top_k=300), SamplingParams(temperature=0.5, top_p=0.5),
                  SamplingParams()]
    assert run(neighbours, 1, 1) == run([], 0, 0) == run(neighbours[:1], 1, 5)


def test_every_path_at_llama_3_shape_runs_without_a_host_sync():
    """1,024 rows of 128,256 bf16 logits: greedy, top-k with top-p, top-p alone (bisection),
    a top_k above TOP_K_MAX, penalties with top log probs, min_p; torch's sync debug mode
    raises on any synchronising call. The distributions of a few rows match the reference's
    (ties as documented: bf16 logits tie often)."""
    rows, vocab = 1024, 128256
    kinds = [SamplingParams(), SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
             SamplingParams(temperature=0.8, top_p=0.95),
             SamplingParams(temperature=1.0, top_k=TOP_K_MAX + 500, min_p=0.01),
             SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, top_logprobs=5),
             SamplingParams(temperature=0.7, min_p=0.05, frequency_penalty=0.5, seed=4)]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    states = [Request(request_id=f"r{i}", prompt_token_ids=[1, 2, 3 + i % 50], params=p) for i, p in enumerate(params)]
    sampler = staged_sampler(rows)
    for row, state in enumerate(states):
        sampler.add_row(row, state)
    logits = (torch.randn(rows, vocab, device=CUDA, generator=torch.Generator(CUDA).manual_seed(3)) * 4)
    logits = logits.to(torch.bfloat16)
    sampler.sample(logits.clone(), np.arange(rows), states)  # first step: the penalty counts are allocated
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = sampler.sample(logits.clone(), np.arange(rows), states)
        distribution = sampler.distribution(logits[: len(kinds)], np.arange(len(kinds)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids = result.token_ids.cpu()
    assert ids[0].item() == int(logits[0].float().argmax())
    for row in range(1, 4):  # no penalties: drawn from these distributions
        reference = sampling_distribution(logits[row].float().cpu(), kinds[row])
        got = distribution[row].cpu()
        kept_as_the_reference(logits[row].cpu(), kinds[row], got, reference / reference.sum())
        assert got[ids[row]] > 0
    assert 1 <= int((distribution[1] > 0).sum()) <= 100  # top-k 50 then top-p (ties up to its candidates)
    assert bool(((ids >= 0) & (ids < vocab)).all())


# ---- through the engine ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp32_engine():
    from inflightllm.engine import Engine
    from tests.gpu.test_gpu_engine import gpu_config, model_spec

    return Engine(model_spec("float32"), gpu_config(), sampler_seed=0)


def generate(engine, prompts, params, arrivals=None):
    from inflightllm.llm import LLM

    llm = LLM(engine.model_spec, engine=engine, load_tokenizer_too=False)
    return [result.token_ids for result in llm.generate(prompts, params, arrival_steps=arrivals)]


def test_repetition_penalty_through_the_async_engine_equals_transformers(fp32_engine):
    """Greedy with repetition_penalty 1.3 (transformers' semantics: prompt and output ids),
    staggered arrivals and preemptions, asynchronous scheduling (the engine no longer waits
    for the step in flight: the counts follow the sampled ids on the device): the ids equal
    transformers' generate with the same penalty."""
    from inflightllm.engine import Engine
    from tests.gpu.test_gpu_engine import Reference, gpu_config, make_prompts

    engine = Engine(fp32_engine.model_spec, gpu_config(num_kv_blocks=40, max_batch_size=8), sampler_seed=0,
                    loaded=fp32_engine.loaded)
    assert engine.runner.penalties_follow_sampled_ids
    prompts = make_prompts(8, engine.vocab_size, seed=12)
    params = [SamplingParams(max_tokens=32, repetition_penalty=1.3, ignore_eos=True)] * 8
    got = generate(engine, prompts, params, [0, 0, 1, 2, 2, 3, 5, 6])
    assert engine.stats().num_preemptions_total > 0, "the schedule should have preempted"
    reference = Reference(fp32_engine)
    for prompt, ids in zip(prompts, got):
        with torch.inference_mode():
            tokens = torch.tensor([prompt], device=reference.model.device)
            expected = reference.model.generate(
                tokens, max_new_tokens=32, do_sample=False, repetition_penalty=1.3, attention_mask=torch.ones_like(tokens),
                pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert ids == expected


def test_presence_and_frequency_penalties_async_equal_sync(fp32_engine):
    """Presence and frequency penalties (and a sampled, seeded penalty row) beside plain rows:
    the asynchronous engine's ids equal the synchronous engine's."""
    from inflightllm.engine import Engine
    from tests.gpu.test_gpu_engine import gpu_config, make_prompts

    prompts = make_prompts(6, fp32_engine.vocab_size, seed=13)
    params = [SamplingParams(max_tokens=24, presence_penalty=1.5, ignore_eos=True),
              SamplingParams(max_tokens=24, frequency_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, top_k=40, repetition_penalty=1.2, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=24, presence_penalty=-0.5, frequency_penalty=0.7, logprobs=True,
                             ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, frequency_penalty=0.5, seed=6, ignore_eos=True)]
    results = {}
    for mode in (True, False):
        engine = Engine(fp32_engine.model_spec, gpu_config(async_scheduling=mode), sampler_seed=0,
                        loaded=fp32_engine.loaded)
        results[mode] = generate(engine, prompts, params, [0, 0, 1, 1, 2, 4])
    assert results[True] == results[False]
    assert all(len(ids) == 24 for ids in results[True])


def test_seeded_noise_kernel_equals_the_reference():
    """`seeded_exponential` on CUDA (one kernel for all seeded rows) against the NumPy
    reference: each seeded row's first `length` entries, the same bits, so -log within a
    few ulp; the entries past its length and the other rows untouched."""
    from inflightllm.gpu.sampler import seeded_exponential, write_seeded_exponential
    from inflightllm.gpu.staging import PinnedStaging

    width = 128_256
    noise = torch.full((6, width), -1.0, device=CUDA)
    index = np.array([0, 2, 3, 5])
    seeds = np.array([0, 7, 2**63 - 1, 123456789], np.int64)
    counters = np.array([0, 3, 1000, 2**40], np.int64)
    lengths = np.array([width, 17, 1, 4096], np.int64)
    write_seeded_exponential(noise, index, seeds, counters, lengths, PinnedStaging(CUDA).upload)
    got = noise.cpu().numpy()
    for i, row in enumerate(index):
        want = seeded_exponential(int(seeds[i]), int(counters[i]), int(lengths[i]))
        np.testing.assert_allclose(got[row, : lengths[i]], want, rtol=5e-7, atol=0)
        assert (got[row, lengths[i]:] == -1.0).all()
    assert (got[[1, 4]] == -1.0).all()


@pytest.mark.parametrize("dtype,rows,vocab", [(torch.bfloat16, 512, 128256), (torch.float32, 64, 5000),
                                              (torch.float16, 3, 50)])
def test_top_p_threshold_kernel_equals_the_bisection(dtype, rows, vocab):
    """largest_mass_threshold (32 thresholds a pass, one kernel) finds the logit that the
    halving bisection `_largest_threshold` (torch ops) finds, for top_p from 0.01 to 0.999
    and 1 (nothing masked: -inf), on Llama 3's vocabulary in bf16 and on small float32/fp16
    rows. The two sum the masses in other orders, so where the target falls within rounding
    of a mass (seen: 1 row of 512 at top_p 0.999) they may pick neighbours: every row's pick
    must reach the target and the next value up must not, up to 1e-5 of mass, and at most 1 %
    of the rows may differ."""
    from inflightllm.gpu.sampler import _largest_threshold, largest_mass_threshold

    generator = torch.Generator(CUDA).manual_seed(5)
    logits = (torch.randn(rows, vocab, device=CUDA, generator=generator) * 3).to(dtype)
    probs = torch.softmax(logits.float() / 0.8, dim=-1)
    top_p = torch.tensor([0.01, 0.3, 0.9, 0.95, 0.999, float("inf")], device=CUDA).repeat(rows)[:rows]
    low = torch.full((rows,), float("-inf"), dtype=dtype, device=CUDA)
    high = logits.amax(dim=-1)
    expected = _largest_threshold(top_p, lambda t: torch.where(logits >= t[:, None], probs, 0.0).sum(dim=-1),
                                  low, high)
    got = largest_mass_threshold(logits, probs, top_p, low, high)
    assert got.dtype == dtype
    differ = (got != expected).nonzero().flatten().tolist()
    assert len(differ) <= rows // 100, differ[:10]
    at = torch.where(logits.double() >= got[:, None].double(), probs.double(), 0.0).sum(dim=-1)
    above = torch.where(logits.double() > got[:, None].double(), probs.double(), 0.0).sum(dim=-1)
    finite = torch.isfinite(top_p)
    assert bool((at[finite] >= top_p[finite] - 1e-5).all())
    assert bool((above[finite] < top_p[finite] + 1e-5).all())
    assert bool(torch.isneginf(got[~finite].float()).all())
