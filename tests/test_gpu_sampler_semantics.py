"""The batched GPU sampler (inflightllm/gpu/sampler.py) run on the CPU device: its
semantics equal the reference sampler's where they are deterministic (greedy, top-k 1,
a tiny top-p, min-p 1, penalties and bans, log probs), seeded rows repeat, and the draw
follows the distribution. CUDA graph buckets are the documented sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflightllm.gpu.runner import graph_buckets
from inflightllm.gpu.sampler import GpuSampler
from inflightllm.request import Request
from inflightllm.sampler import Sampler
from inflightllm.sampling_params import SamplingParams

VOCAB = 64


def request(params: SamplingParams, prompt=(1, 2, 3), outputs=(), name="r") -> Request:
    state = Request(request_id=name, prompt_token_ids=list(prompt), params=params, eos_token_ids=frozenset({2}))
    state.token_ids.extend(outputs)
    return state


def batched(rows_params, logits, seed=0, states=None):
    sampler = GpuSampler(torch.device("cpu"), max_rows=8, seed=seed)
    states = states or [request(p, name=f"r{i}") for i, p in enumerate(rows_params)]
    rows = np.arange(len(states))
    for row, state in zip(rows, states):
        sampler.add_row(int(row), state)
    return sampler(logits.clone(), rows, states)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_graph_buckets_are_powers_of_two_to_16_then_24_then_every_16():
    assert graph_buckets(256) == [1, 2, 4, 8, 16, 24] + list(range(32, 257, 16))
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert graph_buckets(1) == [1]


def test_deterministic_settings_equal_the_reference_sampler():
    params = [
        SamplingParams(),  # greedy
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.3, top_p=1e-6),
        SamplingParams(temperature=0.9, min_p=1.0),
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(min_tokens=3),  # EOS (2) banned while fewer than 3 outputs
        SamplingParams(bad_words=((5,), (1, 7))),
    ]
    logits = random_logits(len(params))
    logits[5, 2] = 50.0  # EOS would win if it were not banned
    states = [request(p, outputs=(7, 7, 9) if i == 4 else (), name=f"r{i}") for i, p in enumerate(params)]
    ids, _, _, _ = batched(params, logits, states=states)
    reference = Sampler(seed=0)(logits.clone(), [request(p, outputs=(7, 7, 9) if i == 4 else ()) for i, p in
                                                  enumerate(params)]).token_ids
    assert ids == reference
    assert ids[5] != 2


def test_log_probs_and_top_logprobs_are_of_the_raw_distribution():
    params = [SamplingParams(logprobs=True), SamplingParams(top_logprobs=3), SamplingParams()]
    logits = random_logits(3, seed=1)
    ids, logprobs, top_ids, top_values = batched(params, logits)
    raw = torch.log_softmax(logits, dim=-1)
    assert logprobs[0] == pytest.approx(float(raw[0, ids[0]]))
    assert logprobs[2] is None and top_ids[0] == [] and top_ids[2] == []
    values, indices = torch.topk(raw[1], 3)
    assert top_ids[1] == indices.tolist() and top_values[1] == pytest.approx(values.tolist())


def test_seeded_rows_repeat_and_unseeded_rows_follow_the_sampler_seed():
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)]
    logits = torch.zeros(2, VOCAB)  # uniform: every draw is random
    first = [batched(params, logits, seed=s)[0] for s in (0, 1)]
    assert first[0][0] == first[1][0]  # the seeded row ignores the sampler's seed
    again = batched(params, logits, seed=0)[0]
    assert again == first[0]


def test_the_draw_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs).expand(512, -1).contiguous()
    sampler = GpuSampler(torch.device("cpu"), max_rows=512, seed=3)
    states = [request(SamplingParams(temperature=1.0), name=f"r{i}") for i in range(512)]
    for row, state in enumerate(states):
        sampler.add_row(row, state)
    ids, _, _, _ = sampler(logits.clone(), np.arange(512), states)
    counts = np.bincount(ids, minlength=3)[:3] / 512
    assert set(ids) <= {0, 1, 2}
    assert abs(counts[0] - 0.6) < 0.08 and abs(counts[1] - 0.3) < 0.08


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.arange(VOCAB, dtype=torch.float32).flip(0).expand(256, -1).contiguous()  # token 0 best
    params = [SamplingParams(temperature=5.0, top_k=3)] * 128 + [SamplingParams(temperature=5.0, top_p=0.2)] * 128
    ids, _, _, _ = batched_many(params, logits)
    assert set(ids[:128]) <= {0, 1, 2}
    kept = torch.softmax(logits[0] / 5.0, -1).cumsum(-1)
    allowed = int((kept - torch.softmax(logits[0] / 5.0, -1) < 0.2).sum())
    assert set(ids[128:]) <= set(range(allowed))


def batched_many(params, logits):
    sampler = GpuSampler(torch.device("cpu"), max_rows=len(params), seed=5)
    states = [request(p, name=f"r{i}") for i, p in enumerate(params)]
    for row, state in enumerate(states):
        sampler.add_row(row, state)
    return sampler(logits.clone(), np.arange(len(params)), states)


def test_a_row_whose_adjustment_fails_is_reported_alone():
    bad = request(SamplingParams(repetition_penalty=1.3), name="bad")
    bad.token_ids.append(VOCAB + 5)  # an id outside the logits: the penalty's indexing raises
    good = request(SamplingParams(), name="good")
    sampler = GpuSampler(torch.device("cpu"), max_rows=2, seed=0)
    sampler.add_row(0, bad)
    sampler.add_row(1, good)
    logits = random_logits(2, seed=4)
    result = sampler.sample(logits.clone(), np.arange(2), [bad, good])
    assert list(result.errors) == [0] and result.errors[0].startswith("sampling failed: IndexError")
    assert result.token_ids[1].item() == int(torch.argmax(logits[1]))


def test_min_tokens_bans_every_stop_id_of_each_row_below_its_minimum_at_once():
    """min_tokens rows are not visited one by one: all their stop ids are banned in one
    indexed write, only while the row has fewer outputs than its minimum (in flight counted)."""
    sampler = GpuSampler(torch.device("cpu"), max_rows=8, seed=0)
    params = [SamplingParams(min_tokens=4, stop_sequences=((9,),)), SamplingParams(min_tokens=2), SamplingParams(),
              SamplingParams(min_tokens=3, ignore_eos=True)]
    states = [request(p, name=f"r{i}") for i, p in enumerate(params)]
    rows = np.array([5, 1, 3, 0])
    for row, state in zip(rows, states):
        sampler.add_row(int(row), state)
    assert not sampler.params.bans[rows].any()  # no row is adjusted one by one
    logits = random_logits(4)
    logits[:, 2] = 50.0  # EOS would win everywhere
    logits[0, 9] = 60.0  # and stop id 9 in row 0
    ids = sampler.sample(logits.clone(), rows, states, output_counts=np.array([3, 1, 0, 0])).to_host().lists()[0]
    assert ids[0] not in (2, 9) and ids[1] != 2  # below their minimums
    assert ids[2] == 2  # no minimum
    assert ids[3] == 2  # ignore_eos: EOS is no stop id, nothing banned
    ids = sampler.sample(logits.clone(), rows, states, output_counts=np.array([4, 2, 0, 5])).to_host().lists()[0]
    assert ids[0] == 9 and ids[1] == 2  # minimums reached
    reference = Sampler(seed=0)(logits.clone(), [request(p, outputs=(7,) * n) for p, n in zip(params, (3, 1, 0, 0))])
    first = sampler.sample(logits.clone(), rows, states, output_counts=np.array([3, 1, 0, 0])).to_host().lists()[0]
    assert first == reference.token_ids


def test_16_bit_logits_give_the_ids_and_log_probs_of_their_float32_copy():
    """The runner hands over the LM head's bf16/fp16 logits. An all-greedy step with no log
    probs or bans takes its argmax on them, others convert them to float32 first: either way
    the ids (and log probs) are those of the float32 copy, ties resolved to the first id."""
    for dtype in (torch.bfloat16, torch.float16):
        logits = random_logits(6, seed=5).to(dtype)
        logits[1, 10] = logits[1, 40] = logits[1].max() + 1  # a tie: the first id wins
        logits[2, VOCAB - 8 :] = float("-inf")  # as mask_unsampleable leaves them
        wide = logits.float()
        greedy = [SamplingParams()] * 6
        assert batched(greedy, logits)[0] == batched(greedy, wide)[0] == wide.argmax(dim=-1).tolist()
        assert batched(greedy, logits)[0][1] == 10
        mixed = greedy[:5] + [SamplingParams(logprobs=True)]
        ids, logprobs, _, _ = batched(mixed, logits)
        assert (ids, logprobs) == batched(mixed, wide)[:2]
        banned = greedy[:5] + [SamplingParams(bad_words=((int(wide[5].argmax()),),))]
        assert batched(banned, logits)[0] == batched(banned, wide)[0]
        assert batched(banned, logits)[0][5] != int(wide[5].argmax())
        stops = [SamplingParams(min_tokens=2)] + greedy[:5]
        states = [request(p, name=f"r{i}") for i, p in enumerate(stops)]
        fast = GpuSampler(torch.device("cpu"), max_rows=8, seed=0)
        for row, state in enumerate(states):
            fast.add_row(row, state)
        row0 = logits.clone()
        row0[0, 2] = 100.0  # EOS wins row 0 unless banned
        got = fast.sample(row0, np.arange(6), states, output_counts=np.zeros(6, np.int64))
        assert got.token_ids.dtype == torch.int64 and got.token_ids[0].item() != 2
