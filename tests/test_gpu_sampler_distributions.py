"""The GPU sampler (inflightllm/gpu/sampler.py, run here on the CPU device) draws from the
reference sampler's distributions: the kept sets and probabilities equal the reference's
`sampling_distribution` (ties: documented below), seeded chi-square tests of the draws
against those distributions and against the reference sampler's own draws, penalties
equal the reference's adjusted logits step after step (counts kept on the device), log
probs equal log_softmax, and a seeded row draws the same tokens whatever its neighbours.

The chi-square bounds are at p = 1e-6 (Wilson-Hilferty), with fixed seeds: a correct
sampler fails with probability about 1e-6 per comparison, and as the seeds are fixed a
passing test keeps passing."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from inflightllm.gpu.sampler import TOP_K_MAX, GpuSampler, candidates
from inflightllm.request import Request
from inflightllm.sampler import Sampler, sampling_distribution
from inflightllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
Z_1E6 = 4.753  # the standard normal's upper 1e-6 quantile


def request(params: SamplingParams, prompt=(1, 2, 3), outputs=(), name="r") -> Request:
    state = Request(request_id=name, prompt_token_ids=list(prompt), params=params, eos_token_ids=frozenset({2}))
    state.token_ids.extend(outputs)
    return state


def sampler_for(states, seed=0, rows=None, device=CPU) -> tuple[GpuSampler, np.ndarray]:
    rows = np.arange(len(states)) if rows is None else np.asarray(rows)
    sampler = GpuSampler(device, max_rows=int(rows.max()) + 1, seed=seed)
    for row, state in zip(rows, states):
        sampler.add_row(int(row), state)
    return sampler, rows


def chi_square_bound(degrees: int) -> float:
    """The chi-square statistic a correct sampler exceeds with probability ~1e-6."""
    h = 2.0 / (9.0 * degrees)
    return degrees * (1.0 - h + Z_1E6 * math.sqrt(h)) ** 3


def merged(expected: np.ndarray, *observed: np.ndarray):
    """Bins with an expected count under 5 pooled into one (the chi-square approximation)."""
    small = expected < 5
    if not small.any():
        return (expected, *observed)
    return (np.append(expected[~small], expected[small].sum()),
            *(np.append(o[~small], o[small].sum()) for o in observed))


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    """counts of N draws follow probs: nothing outside its support, chi-square within bound."""
    total = counts.sum()
    assert counts[probs == 0].sum() == 0, "drew a token the distribution drops"
    support = probs > 0
    expected, observed = merged(total * probs[support], counts[support].astype(np.float64))
    if len(expected) < 2:
        return
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < chi_square_bound(len(expected) - 1), (statistic, len(expected))


def assert_same_law(first: np.ndarray, second: np.ndarray) -> None:
    """Two samples' counts come from one distribution (chi-square test of homogeneity)."""
    keep = (first + second) > 0
    a, b = first[keep].astype(np.float64), second[keep].astype(np.float64)
    pooled = (a + b) / (a.sum() + b.sum())
    expected_a, expected_b = a.sum() * pooled, b.sum() * pooled
    small = (expected_a < 5) | (expected_b < 5)
    if small.any():
        a, b = np.append(a[~small], a[small].sum()), np.append(b[~small], b[small].sum())
        expected_a = np.append(expected_a[~small], expected_a[small].sum())
        expected_b = np.append(expected_b[~small], expected_b[small].sum())
    statistic = float(((a - expected_a) ** 2 / expected_a).sum() + ((b - expected_b) ** 2 / expected_b).sum())
    assert statistic < chi_square_bound(max(len(a) - 1, 1)), statistic


def draws(params: SamplingParams, logits: torch.Tensor, count: int, seed: int, device=CPU) -> np.ndarray:
    """The GPU sampler's ids for `count` rows of the same logits (one step, one batch)."""
    states = [request(params, name=f"r{i}") for i in range(count)]
    sampler, rows = sampler_for(states, seed=seed, device=device)
    ids = sampler.sample(logits.to(device).expand(count, -1).clone(), rows, states).token_ids
    return np.bincount(ids.cpu().numpy(), minlength=logits.shape[-1])


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=30, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=2.0, top_p=0.5, min_p=0.2),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_draws_follow_the_reference_distribution(params):
    """20,000 draws of the GPU sampler against the reference's exact distribution, and
    4,000 draws of the reference sampler against both."""
    logits = torch.randn(48, generator=torch.Generator().manual_seed(11)) * 2
    expected = sampling_distribution(logits.clone(), params)
    expected = (expected / expected.sum()).double().numpy()
    gpu = draws(params, logits, 20_000, seed=1)
    assert_follows(gpu, expected)
    reference = Sampler(seed=2)(logits.expand(4_000, -1).clone(),
                                [request(params, name=f"q{i}") for i in range(4_000)]).token_ids
    reference = np.bincount(reference, minlength=48)
    assert_follows(reference, expected)
    assert_same_law(gpu, reference)


def test_a_top_k_above_the_topk_path_draws_from_the_bisected_threshold():
    """top_k > TOP_K_MAX takes the whole-row path (the k-th logit by bisection)."""
    vocab = TOP_K_MAX + 200
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 0.5
    logits[:8] += 4.0  # most of the mass on a few ids, the rest spread over the kept ones
    params = SamplingParams(temperature=1.0, top_k=TOP_K_MAX + 50, top_p=0.9)
    expected = sampling_distribution(logits.clone(), params)
    expected = (expected / expected.sum()).double().numpy()
    assert_follows(draws(params, logits, 3_000, seed=4), expected)


def random_settings(rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.5, 1.0, 1.7])),
        top_k=int(rng.choice([0, 2, 5, 20, 49, 150, TOP_K_MAX + 1])),
        top_p=float(rng.choice([1.0, 0.05, 0.5, 0.9, 0.99])),
        min_p=float(rng.choice([0.0, 0.05, 0.3])),
    )


def gpu_and_reference(logits: torch.Tensor, settings: list[SamplingParams], device=CPU):
    """(row, params, GPU distribution, reference distribution) per row of `logits`; the
    reference's on the CPU, in float32."""
    sampler, rows = sampler_for([request(p, name=f"r{i}") for i, p in enumerate(settings)], device=device)
    got = sampler.distribution(logits.to(device), rows).cpu()
    for i, params in enumerate(settings):
        reference = sampling_distribution(logits[i].float().cpu().clone(), params)
        yield i, params, got[i], reference / reference.sum()


def test_kept_sets_and_probabilities_equal_the_reference_on_random_logits():
    """Distinct logits: the kept set is exactly the reference's and so are the probabilities,
    on both paths (top-k candidates, and bisection for top-p alone or a large top_k)."""
    rng = np.random.default_rng(0)
    compared = 0
    for trial in range(60):
        vocab = int(rng.choice([50, 300, 1200]))
        logits = torch.from_numpy(rng.normal(size=(8, vocab)).astype(np.float32) * 3)
        for _, params, got, reference in gpu_and_reference(logits, [random_settings(rng) for _ in range(8)]):
            assert torch.equal(got > 0, reference > 0), (trial, params)
            torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-5)
            compared += 1
    assert compared == 480


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_keep_the_reference_sets(dtype):
    """16-bit logits as the LM head gives them (the whole-row path bisects over their 16-bit
    patterns, 16 rounds): the kept sets are the reference's on their float32 copy, but for
    the documented ties (frequent at 8 or 11 mantissa bits), and where they are the same so
    are the probabilities."""
    rng = np.random.default_rng(2)
    kinds = {"same": 0, "ties kept": 0, "beyond candidates": 0}
    for _trial in range(40):
        vocab = int(rng.choice([300, 1200]))
        logits = torch.from_numpy(rng.normal(size=(8, vocab)).astype(np.float32) * 3).to(dtype)
        for row, params, got, reference in gpu_and_reference(logits, [random_settings(rng) for _ in range(8)]):
            kind = kept_as_the_reference(logits[row], params, got, reference)
            kinds[kind] += 1
            if kind == "same":
                torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-5)
    assert kinds["same"] > 250, kinds


def test_ties_at_the_threshold_are_all_kept():
    """Logits with many ties (small integers): where the kept sets differ, the GPU sampler
    keeps every token tied with the smallest value the reference keeps (the reference's
    top-p keeps those of them its sort puts first), or, on the top-k path, leaves out the
    tokens tied with the k-th beyond its `candidates(top_k)` logits (a run of more than
    top_k equal logits). Nothing else differs."""
    rng = np.random.default_rng(1)
    kinds = {"same": 0, "ties kept": 0, "beyond candidates": 0}
    for _trial in range(60):
        vocab = int(rng.choice([50, 300, 1200]))
        logits = torch.from_numpy(rng.integers(-8, 8, size=(8, vocab)).astype(np.float32))
        for row, params, got, reference in gpu_and_reference(logits, [random_settings(rng) for _ in range(8)]):
            kinds[kept_as_the_reference(logits[row], params, got, reference)] += 1
    assert min(kinds.values()) > 0, kinds  # every case was met


def kept_as_the_reference(logits: torch.Tensor, params: SamplingParams, got: torch.Tensor,
                          reference: torch.Tensor) -> str:
    """Asserts the GPU sampler's kept set is the reference's but for the documented ties;
    says which case it was: "same", "ties kept" or "beyond candidates"."""
    kept, kept_reference = got > 0, reference > 0
    if torch.equal(kept, kept_reference):
        return "same"
    scaled = logits.float().cpu() / params.temperature
    smallest = scaled[kept_reference].min()
    if (kept_reference & ~kept).any():  # left out: only ties of the k-th past the candidates
        assert 0 < params.top_k <= TOP_K_MAX, params
        assert int((scaled >= smallest).sum()) > candidates(params.top_k, len(scaled)), params
        assert bool((scaled[kept_reference & ~kept] == smallest).all()), params
        return "beyond candidates"
    # more kept: only ties of the smallest value the reference keeps
    assert bool((scaled[kept & ~kept_reference] == smallest).all()), params
    return "ties kept"


def test_uniform_logits_keep_all_ties_within_the_candidates():
    """The documented edge: equal logits and top_k 5 -- the reference keeps every id (all
    equal the 5th), the top-k path keeps its candidates(5) = 21; without top-k, all."""
    logits = torch.zeros(2, 64)
    settings = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.5)]
    sampler, rows = sampler_for([request(p, name=f"r{i}") for i, p in enumerate(settings)])
    got = sampler.distribution(logits, rows)
    assert int((got[0] > 0).sum()) == candidates(5, 64) == 21
    assert int((got[1] > 0).sum()) == 64  # the reference's top-p keeps 32 of the 64 ties


# ---- penalties ----------------------------------------------------------------------------
PENALTIES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=1.1),
    SamplingParams(),  # no penalties, beside them
    SamplingParams(temperature=0.9, top_k=10, repetition_penalty=1.1, logprobs=True, top_logprobs=3),
]


def reference_adjusted(logits: torch.Tensor, states: list[Request]) -> torch.Tensor:
    adjusted = logits.float().clone()
    sampler = Sampler(seed=0)
    with torch.inference_mode():
        for i, state in enumerate(states):
            sampler._apply_penalties_and_bans(adjusted[i], state)
    return adjusted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_equal_the_reference_adjusted_logits_step_after_step(dtype):
    """Penalty rows are adjusted in one batch from counts on the device; the counts follow
    the sampled ids (no host copy of the tokens): each step's adjusted logits equal the
    reference's for the tokens appended so far, the raw logits stay untouched where a row
    asks for log probs, and rows without penalties are left alone."""
    vocab = 40
    states = [request(p, prompt=(1, 5, 5, 9), outputs=(5, 7) if i != 1 else (), name=f"r{i}")
              for i, p in enumerate(PENALTIES)]
    sampler, rows = sampler_for(states, rows=[4, 0, 6, 2, 1])
    generator = torch.Generator().manual_seed(5)
    for step in range(6):
        logits = (torch.randn(len(states), vocab, generator=generator) * 3).to(dtype)
        raw = logits.clone()
        wants = sampler.params.wants_logprobs[rows]
        with torch.inference_mode():
            adjusted = sampler._apply_penalties(logits, rows, wants, {})
        expected = reference_adjusted(raw, states)
        torch.testing.assert_close(adjusted.float(), expected, atol=0, rtol=0, msg=f"step {step}")
        assert torch.equal(logits, raw)  # a penalty row asks for log probs: the raw logits stay
        result = sampler.sample(logits, rows, states)
        for state, token in zip(states, result.token_ids.tolist()):
            state.token_ids.append(token)


def test_penalty_rows_sample_as_the_reference_does():
    """Greedy penalty rows beside plain ones, several steps: the ids equal the reference
    sampler's (which reads the tokens on the host)."""
    vocab = 30
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=1.5),
              SamplingParams(presence_penalty=2.0), SamplingParams()]
    gpu_states = [request(p, name=f"g{i}") for i, p in enumerate(params)]
    reference_states = [request(p, name=f"c{i}") for i, p in enumerate(params)]
    sampler, rows = sampler_for(gpu_states)
    generator = torch.Generator().manual_seed(8)
    base = torch.randn(len(params), vocab, generator=generator)
    for step in range(8):
        logits = base + 0.1 * torch.randn(len(params), vocab, generator=generator)  # the same few ids lead
        ids = sampler.sample(logits.clone(), rows, gpu_states).token_ids.tolist()
        expected = Sampler(seed=0)(logits.clone(), reference_states).token_ids
        assert ids == expected, step
        for state, token in zip(gpu_states + reference_states, ids + expected):
            state.token_ids.append(token)
    assert len(set(gpu_states[0].output_token_ids)) > 1  # the penalty moved it off its first pick


def test_a_row_that_joins_again_rebuilds_its_counts():
    """remove_row then add_row (a preemption, a reused row): the counts restart from the
    request's tokens, not from the row's previous occupant."""
    params = SamplingParams(frequency_penalty=1.0)
    first = request(params, outputs=(3, 3, 3), name="first")
    sampler, rows = sampler_for([first])
    logits = torch.zeros(1, 10)
    with torch.inference_mode():
        assert sampler._apply_penalties(logits, rows, np.zeros(1, bool), {})[0, 3] == -3.0
    sampler.remove_row(0)
    second = request(params, outputs=(4,), name="second")
    sampler.add_row(0, second)
    with torch.inference_mode():
        adjusted = sampler._apply_penalties(logits, rows, np.zeros(1, bool), {})
    assert adjusted[0, 3] == 0.0 and adjusted[0, 4] == -1.0


def test_penalty_slots_grow_and_keep_the_counts_they_hold():
    """Penalty rows arriving in waves grow the device counts (8 slots, then 16, then the
    20 rows): rows counted before a growth keep their counts, sampled ids included."""
    vocab = 25
    params = SamplingParams(frequency_penalty=0.7, repetition_penalty=1.2)
    states = [request(params, outputs=(i % vocab,), name=f"r{i}") for i in range(20)]
    sampler = GpuSampler(CPU, max_rows=20, seed=0)
    generator = torch.Generator().manual_seed(3)
    previous = 0
    for joined in (3, 12, 20):
        for row in range(previous, joined):
            sampler.add_row(row, states[row])
        previous = joined
        rows = np.arange(joined)
        logits = torch.randn(joined, vocab, generator=generator)
        with torch.inference_mode():
            adjusted = sampler._apply_penalties(logits, rows, np.zeros(joined, bool), {})
        torch.testing.assert_close(adjusted, reference_adjusted(logits, states[:joined]), atol=0, rtol=0)
        ids = sampler.sample(logits, rows, states[:joined]).token_ids.tolist()
        for state, token in zip(states, ids):
            state.token_ids.append(token)
    assert sampler.penalty_counts.output_counts.shape[0] == 20


# ---- log probs ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_equal_log_softmax_of_the_raw_logits(dtype):
    """Chosen and top log probs from one log-sum-exp and a topk of the raw logits equal
    log_softmax's (within 1e-5), for rows with penalties, bans and min_tokens too (their
    log probs are of the model's raw distribution)."""
    params = [
        SamplingParams(logprobs=True),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, top_logprobs=5),
        SamplingParams(),
        SamplingParams(temperature=1.0, repetition_penalty=1.1, top_logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=True, bad_words=((0,),)),
        SamplingParams(min_tokens=3, top_logprobs=2),
        SamplingParams(temperature=1.0, presence_penalty=0.5),
    ]
    states = [request(p, outputs=(4, 9), name=f"r{i}") for i, p in enumerate(params)]
    sampler, rows = sampler_for(states)
    logits = (torch.randn(len(params), 500, generator=torch.Generator().manual_seed(6)) * 4).to(dtype)
    expected = torch.log_softmax(logits.float(), dim=-1)
    ids, logprobs, top_ids, top_values = sampler(logits.clone(), rows, states)
    for i, p in enumerate(params):
        if not (p.logprobs or p.top_logprobs):
            assert logprobs[i] is None and top_ids[i] == []
            continue
        assert logprobs[i] == pytest.approx(float(expected[i, ids[i]]), abs=1e-5)
        values, indices = torch.topk(expected[i], p.top_logprobs)
        assert top_ids[i] == indices.tolist() or torch.equal(expected[i, top_ids[i]], values)  # ties in order
        assert top_values[i] == pytest.approx(values.tolist(), abs=1e-5)


# ---- seeds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=7, seed=11),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11),
    SamplingParams(temperature=1.2, top_k=40, top_p=0.8, min_p=0.01, seed=11),
    SamplingParams(temperature=1.0, top_k=TOP_K_MAX + 3, seed=11),
], ids=["top-k", "top-p", "top-k-top-p-min-p", "large-top-k"])
def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours(params):
    """Its tokens over several steps are the same alone, at another row and batch position,
    beside rows of other settings (other candidate counts, other paths) and another
    sampler seed; another seed draws other tokens."""
    vocab = TOP_K_MAX + 100
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(9))  # step i uses row i

    def run(neighbours, position, sampler_seed, seed_params=params):
        seeded = request(seed_params, name="seeded")
        others = [request(p, name=f"n{i}") for i, p in enumerate(neighbours)]
        states = others[:position] + [seeded] + others[position:]
        sampler, rows = sampler_for(states, seed=sampler_seed, rows=np.arange(len(states)) * 2 + 1)
        tokens = []
        for step in range(6):
            batch = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(100 + step))
            batch[position] = logits[step]
            tokens.append(sampler.sample(batch, rows, states).token_ids[position].item())
        return tokens

    alone = run([], 0, 0)
    neighbours = [SamplingParams(temperature=1.0, top_k=300), SamplingParams(temperature=0.5, top_p=0.5),
                  SamplingParams(), SamplingParams(temperature=1.0, top_k=2, seed=3)]
    assert run(neighbours, 2, 1) == alone
    assert run(neighbours[:1], 1, 7) == alone
    assert run([], 0, 0, dataclasses.replace(params, seed=12)) != alone


def test_seeded_noise_is_exponential_and_a_function_of_seed_draw_and_entry():
    from inflightllm.gpu.sampler import seeded_exponential

    first = seeded_exponential(11, 0, 200_000)
    assert first.dtype == np.float32 and np.array_equal(first, seeded_exponential(11, 0, 200_000))
    assert np.array_equal(seeded_exponential(11, 0, 1000), first[:1000])  # a prefix: the length cuts, no more
    assert (first > 0).all() and abs(first.mean() - 1.0) < 0.01 and abs(first.var() - 1.0) < 0.02
    # P(E > t) = exp(-t) at a few points (Exp(1)), within ~5 standard errors
    for t in (0.1, 1.0, 3.0):
        p = math.exp(-t)
        assert abs((first > t).mean() - p) < 5 * math.sqrt(p * (1 - p) / len(first))
    for other in (seeded_exponential(11, 1, 1000), seeded_exponential(12, 0, 1000),
                  seeded_exponential(2**63 - 1, 5, 1000)):
        assert not np.array_equal(other, first[:1000])
        assert abs(np.corrcoef(other, first[:1000])[0, 1]) < 0.15


def test_a_seeded_rows_draws_follow_its_token_count_not_the_sampler_it_is_on():
    """The k-th draw of a seeded row depends on k (the tokens it generated before), so a
    request preempted and resumed on a fresh row, or run in another batch, draws what it
    would have drawn."""
    params = SamplingParams(temperature=1.0, seed=5)
    vocab = 300
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(4))
    states = [request(params, name="s")]

    def tokens(counts: list[int], sampler_seed: int, row: int) -> list[int]:
        sampler, rows = sampler_for(states, seed=sampler_seed, rows=[row])
        return [sampler.sample(logits[k:k + 1].clone(), rows, states, np.array([k])).token_ids[0].item()
                for k in counts]

    whole = tokens(list(range(8)), 0, 0)
    assert tokens([5, 6, 7], 3, 9) == whole[5:]  # resumed elsewhere at its 5th token
    assert len(set(whole)) > 1
