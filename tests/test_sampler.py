"""Sampler and SamplingParams on hand-made logits and requests (no model).

The sampler modifies the logits it is given in place (penalties and bans), so tests
that inspect penalised logits read them back from the tensor they passed in.
"""

from __future__ import annotations

import math

import pytest
import torch

from inflightllm.request import Request
from inflightllm.sampler import Sampler
from inflightllm.sampling_params import InvalidRequestError, SamplingParams

EOS = 2
NEG_INF = float("-inf")


def make_request(params: SamplingParams, prompt=(10, 11), outputs=(), request_id="r") -> Request:
    """A request with the given prompt and already generated `outputs`."""
    request = Request(request_id=request_id, prompt_token_ids=list(prompt), params=params,
                      eos_token_ids=frozenset({EOS}))
    request.token_ids.extend(outputs)
    return request


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def sample_support(logits_row: torch.Tensor, params: SamplingParams, draws: int = 400, seed: int = 0) -> set[int]:
    """Token ids sampled in `draws` unseeded rows of one batch (the sampler's generator)."""
    logits = logits_row.repeat(draws, 1)
    requests = [make_request(params, request_id=f"r{i}") for i in range(draws)]
    return set(Sampler(seed=seed)(logits, requests).token_ids)


# ---- greedy, top-k, top-p, min-p ----------------------------------------------------

def test_greedy_takes_the_argmax_of_each_row():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 1.0, 2.0, 0.0], [-5.0, -4.0, -3.0, -3.5]])
    requests = [make_request(SamplingParams(), request_id=str(i)) for i in range(3)]
    assert Sampler(seed=0)(logits, requests).token_ids == [1, 0, 2]


def test_temperature_with_top_k_1_is_greedy_whatever_the_seed():
    row = torch.tensor([0.5, 0.4, 0.45, 0.3])  # nearly flat: sampling would pick others
    params = SamplingParams(temperature=5.0, top_k=1)
    for seed in range(20):
        assert Sampler(seed=seed)(row.clone()[None], [make_request(params)]).token_ids == [0]


def test_top_k_keeps_only_the_k_best_tokens():
    row = torch.tensor([0.2, 1.0, 0.1, 0.9, 0.0, 0.8, 0.3, -0.1])  # best three: 1, 3, 5
    assert sample_support(row, SamplingParams(temperature=1.0, top_k=3)) == {1, 3, 5}
    assert sample_support(row, SamplingParams(temperature=1.0, top_k=1)) == {1}
    assert sample_support(row, SamplingParams(temperature=1.0, top_k=0)) == set(range(8))  # off


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    # token:        0     1     2     3
    probs = [0.15, 0.10, 0.50, 0.25]  # sorted: 2 (0.5), 3 (0.75), 0 (0.9), 1 (1.0)
    row = logits_from_probs(probs)
    assert sample_support(row, SamplingParams(temperature=1.0, top_p=0.45)) == {2}
    assert sample_support(row, SamplingParams(temperature=1.0, top_p=0.7)) == {2, 3}
    assert sample_support(row, SamplingParams(temperature=1.0, top_p=0.8)) == {2, 3, 0}
    assert sample_support(row, SamplingParams(temperature=1.0, top_p=0.95)) == {0, 1, 2, 3}


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    probs = [0.08, 0.5, 0.12, 0.3]
    row = logits_from_probs(probs)
    assert sample_support(row, SamplingParams(temperature=1.0, min_p=0.2)) == {1, 2, 3}  # < 0.1 dropped
    assert sample_support(row, SamplingParams(temperature=1.0, min_p=0.5)) == {1, 3}  # < 0.25 dropped
    assert sample_support(row, SamplingParams(temperature=1.0, min_p=0.0)) == {0, 1, 2, 3}


# ---- penalties ----------------------------------------------------------------------

def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(3)
    vocab = 16
    row = torch.randn(vocab) * 3  # positive and negative logits
    prompt, outputs = [1, 3, 3, 9], [5, 12, 1]
    params = SamplingParams(repetition_penalty=1.7)
    logits = row.clone()[None]
    Sampler(seed=0)(logits, [make_request(params, prompt=prompt, outputs=outputs)])

    expected = RepetitionPenaltyLogitsProcessor(penalty=1.7)(torch.tensor([prompt + outputs]), row.clone()[None])
    assert torch.equal(logits, expected)
    seen = {1, 3, 9, 5, 12}
    for token in range(vocab):
        value = float(row[token])
        if token not in seen:
            assert float(logits[0, token]) == value
        elif value < 0:
            assert float(logits[0, token]) == pytest.approx(value * 1.7)  # negatives are multiplied
        else:
            assert float(logits[0, token]) == pytest.approx(value / 1.7)  # positives are divided


def test_repetition_penalty_changes_the_greedy_choice():
    row = torch.tensor([[0.0, 2.0, 1.5, -1.0]])
    params = SamplingParams(repetition_penalty=1.5)
    assert Sampler(seed=0)(row.clone(), [make_request(params, prompt=[0], outputs=[])]).token_ids == [1]
    # Token 1 was seen in the prompt: 2.0 / 1.5 < 1.5.
    assert Sampler(seed=0)(row.clone(), [make_request(params, prompt=[1], outputs=[])]).token_ids == [2]


def test_presence_and_frequency_penalties_use_output_tokens_only():
    row = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 0.25, 4.0])
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5)
    logits = row.clone()[None]
    # Token 1 and 4 are in the prompt; 4 (twice) and 6 (once) were generated.
    Sampler(seed=0)(logits, [make_request(params, prompt=[1, 4], outputs=[4, 6, 4])])
    expected = row.clone()
    expected[4] -= 2 * 0.5 + 0.25
    expected[6] -= 1 * 0.5 + 0.25
    assert logits[0].tolist() == expected.tolist()
    assert logits[0].tolist() == [1.0, 2.0, 0.5, -1.0, 1.75, 0.0, -0.5, 4.0]


def test_negative_presence_and_frequency_penalties_raise_repeated_tokens():
    row = torch.tensor([1.0, 2.0, 0.5, -1.0])
    params = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
    logits = row.clone()[None]
    Sampler(seed=0)(logits, [make_request(params, prompt=[0], outputs=[3, 3, 3])])
    assert logits[0].tolist() == [1.0, 2.0, 0.5, -1.0 + 1.5 + 1.0]


def test_presence_and_frequency_penalties_do_nothing_before_the_first_output():
    row = torch.tensor([1.0, 2.0, 0.5, -1.0])
    logits = row.clone()[None]
    Sampler(seed=0)(logits, [make_request(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0),
                                          prompt=[0, 1, 1])])
    assert logits[0].tolist() == row.tolist()


# ---- bans ---------------------------------------------------------------------------

def test_single_token_bad_words_are_always_banned():
    row = torch.tensor([0.0, 1.0, 5.0, 3.0, 4.0, 0.5])
    params = SamplingParams(bad_words=((2,), (4,)))
    logits = row.clone()[None]
    output = Sampler(seed=0)(logits, [make_request(params)])
    assert output.token_ids == [3]
    assert logits[0].tolist() == [0.0, 1.0, NEG_INF, 3.0, NEG_INF, 0.5]


def test_multi_token_bad_words_ban_the_last_token_only_after_the_prefix():
    row = torch.tensor([0.0, 1.0, 5.0, 3.0, 4.0, 0.5, 0.0, 0.0])
    params = SamplingParams(bad_words=((5, 2), (7, 6, 4)))
    cases = [
        ([10, 11], [], []),  # no prefix matches
        ([10, 11], [5], [2]),  # tail [5] matches (5,)
        ([10, 5], [], [2]),  # the prefix may lie in the prompt
        ([10, 11], [5, 1], []),  # 5 is not the last token
        ([10, 11], [7, 6], [4]),  # tail [7, 6] matches (7, 6)
        ([10, 11], [1, 6], []),  # only half of (7, 6)
        ([7], [6, 5], [2]),  # tail [6, 5]: (5,) matches, (7, 6) does not
    ]
    for prompt, outputs, banned in cases:
        logits = row.clone()[None]
        Sampler(seed=0)(logits, [make_request(params, prompt=prompt, outputs=outputs)])
        got = [token for token in range(8) if logits[0, token] == NEG_INF]
        assert got == banned, (prompt, outputs)


def test_min_tokens_bans_eos_end_id_and_stop_tokens_until_reached():
    row = torch.zeros(12)
    params = SamplingParams(min_tokens=2, end_id=6, stop_sequences=((4,), (8, 9)))
    for outputs, banned in (([], [EOS, 4, 6]), ([1], [EOS, 4, 6]), ([1, 1], []), ([1, 1, 1], [])):
        logits = row.clone()[None]
        Sampler(seed=0)(logits, [make_request(params, outputs=outputs)])
        # Multi-token stop sequences are not banned token by token.
        assert [t for t in range(12) if logits[0, t] == NEG_INF] == banned, outputs


def test_min_tokens_with_ignore_eos_leaves_eos_allowed():
    params = SamplingParams(min_tokens=3, end_id=6, ignore_eos=True)
    logits = torch.zeros(1, 8)
    Sampler(seed=0)(logits, [make_request(params)])
    assert [t for t in range(8) if logits[0, t] == NEG_INF] == [6]


def test_min_tokens_changes_the_greedy_choice_away_from_eos():
    row = torch.tensor([[0.0, 1.0, 9.0, 2.0]])  # EOS (2) is the best
    assert Sampler(seed=0)(row.clone(), [make_request(SamplingParams(min_tokens=1))]).token_ids == [3]
    assert Sampler(seed=0)(row.clone(), [make_request(SamplingParams(min_tokens=1), outputs=[1])]).token_ids == [2]


def test_penalties_and_bans_apply_to_inference_mode_logits():
    # The model computes logits under torch.inference_mode(); the engine samples outside it.
    with torch.inference_mode():
        logits = torch.tensor([[1.0, 5.0, 6.0, 3.0, -1.0]])
    params = SamplingParams(repetition_penalty=2.0, bad_words=((2,),), min_tokens=1)
    output = Sampler(seed=0)(logits, [make_request(params, prompt=[1], outputs=[])])
    assert logits[0].tolist() == [1.0, 2.5, NEG_INF, 3.0, -1.0]
    assert output.token_ids == [3]


# ---- log probs ----------------------------------------------------------------------

def test_logprobs_are_of_the_raw_logits_before_penalties_and_temperature():
    torch.manual_seed(5)
    raw = torch.randn(3, 16) * 2
    expected = torch.log_softmax(raw, dim=-1)
    requests = [
        make_request(SamplingParams(temperature=0.5, repetition_penalty=2.0, presence_penalty=1.0, seed=1,
                                    bad_words=((3,),), logprobs=True, top_logprobs=3),
                     outputs=[int(raw[0].argmax())], request_id="a"),
        make_request(SamplingParams(), request_id="b"),  # no log probs asked
        make_request(SamplingParams(logprobs=True), request_id="c"),  # chosen token only
    ]
    output = Sampler(seed=0)(raw.clone(), requests)

    chosen = output.token_ids[0]
    assert output.logprobs[0] == pytest.approx(float(expected[0, chosen]), abs=1e-6)
    values, ids = torch.topk(expected[0], 3)
    assert output.top_ids[0] == ids.tolist()
    assert output.top_logprobs[0] == pytest.approx(values.tolist(), abs=1e-6)
    assert output.top_logprobs[0] == sorted(output.top_logprobs[0], reverse=True)

    assert output.logprobs[1] is None and output.top_ids[1] == [] and output.top_logprobs[1] == []

    assert output.token_ids[2] == int(raw[2].argmax())
    assert output.logprobs[2] == pytest.approx(float(expected[2].max()), abs=1e-6)
    assert output.top_ids[2] == [] and output.top_logprobs[2] == []


def test_top_logprobs_without_logprobs_still_reports_the_chosen_token():
    raw = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    output = Sampler(seed=0)(raw.clone(), [make_request(SamplingParams(top_logprobs=2))])
    expected = torch.log_softmax(raw[0], dim=-1)
    assert output.token_ids == [1]
    assert output.top_ids == [[1, 3]]
    assert output.logprobs[0] == pytest.approx(float(expected[1]), abs=1e-6)
    assert output.top_logprobs[0] == pytest.approx([float(expected[1]), float(expected[3])], abs=1e-6)


# ---- seeds --------------------------------------------------------------------------

def _draw_seeded(batch_builder, steps: int, sampler_seed: int) -> list[int]:
    """Samples of the request named 'seeded' over `steps` calls of one sampler."""
    sampler = Sampler(seed=sampler_seed)
    requests = batch_builder()
    row = requests.index(next(r for r in requests if r.request_id == "seeded"))
    flat = torch.zeros(len(requests), 50)
    draws = []
    for _ in range(steps):
        draws.append(sampler(flat.clone(), requests).token_ids[row])
    return draws


def test_seeded_request_samples_the_same_sequence_whatever_else_is_in_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _draw_seeded(lambda: [make_request(seeded, request_id="seeded")], steps=12, sampler_seed=0)
    in_batch = _draw_seeded(
        lambda: [
            make_request(SamplingParams(temperature=1.0), request_id="unseeded"),
            make_request(SamplingParams(temperature=0.7, seed=99), request_id="other-seed"),
            make_request(SamplingParams(), request_id="greedy"),
            make_request(seeded, request_id="seeded"),
        ],
        steps=12,
        sampler_seed=777,
    )
    assert alone == in_batch
    assert len(set(alone)) > 3  # it really samples (50 equally likely tokens)
    other = _draw_seeded(lambda: [make_request(SamplingParams(temperature=1.0, seed=4321), request_id="seeded")],
                         steps=12, sampler_seed=0)
    assert other != alone


def test_unseeded_requests_follow_the_sampler_seed():
    params = SamplingParams(temperature=1.0)

    def draws(sampler_seed: int) -> list[int]:
        requests = [make_request(params, request_id=str(i)) for i in range(20)]
        return Sampler(seed=sampler_seed)(torch.zeros(20, 50), requests).token_ids

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)


# ---- SamplingParams.validate --------------------------------------------------------

VOCAB = 100


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: 0 is out of range; allowed: 1 to 64"),
        ({"max_tokens": 65}, "max_tokens: 65 is out of range; allowed: 1 to 64"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens: 5 is out of range; allowed: 0 to max_tokens (4)"),
        ({"min_tokens": -1}, "min_tokens: -1 is out of range; allowed: 0 to max_tokens (16)"),
        ({"temperature": -0.5}, "temperature: -0.5 is out of range; allowed: 0 to 100 (0 = greedy)"),
        ({"temperature": 100.5}, "temperature: 100.5 is out of range; allowed: 0 to 100 (0 = greedy)"),
        ({"top_k": -1}, "top_k: -1 is out of range; allowed: 0 (off) or more"),
        ({"top_p": 0.0}, "top_p: 0.0 is out of range; allowed: greater than 0, up to 1 (1 = off)"),
        ({"top_p": 1.5}, "top_p: 1.5 is out of range; allowed: greater than 0, up to 1 (1 = off)"),
        ({"min_p": -0.1}, "min_p: -0.1 is out of range; allowed: 0 to 1 (0 = off)"),
        ({"min_p": 1.5}, "min_p: 1.5 is out of range; allowed: 0 to 1 (0 = off)"),
        ({"repetition_penalty": 0.0},
         "repetition_penalty: 0.0 is out of range; allowed: greater than 0, up to 100 (1 = off)"),
        ({"repetition_penalty": 101.0},
         "repetition_penalty: 101.0 is out of range; allowed: greater than 0, up to 100 (1 = off)"),
        ({"presence_penalty": -2.5}, "presence_penalty: -2.5 is out of range; allowed: -2 to 2"),
        ({"presence_penalty": 2.5}, "presence_penalty: 2.5 is out of range; allowed: -2 to 2"),
        ({"frequency_penalty": -3.0}, "frequency_penalty: -3.0 is out of range; allowed: -2 to 2"),
        ({"frequency_penalty": 2.01}, "frequency_penalty: 2.01 is out of range; allowed: -2 to 2"),
        ({"seed": -1}, "seed: -1 is out of range; allowed: 0 to 2**63 - 1"),
        ({"seed": 2**63}, f"seed: {2**63} is out of range; allowed: 0 to 2**63 - 1"),
        ({"end_id": 100}, "end_id: 100 is out of range; allowed: 0 to 99 (the vocabulary)"),
        ({"end_id": -1}, "end_id: -1 is out of range; allowed: 0 to 99 (the vocabulary)"),
        ({"top_logprobs": 21}, "num_top_logprobs: 21 is out of range; allowed: 0 to 20"),
        ({"top_logprobs": -1}, "num_top_logprobs: -1 is out of range; allowed: 0 to 20"),
        ({"stop_sequences": ((1, 2), ())}, "stop_words: an empty token sequence is not allowed"),
        ({"stop_sequences": ((1, 100),)}, "stop_words: token id 100 is out of range; allowed: 0 to 99"),
        ({"bad_words": ((),)}, "bad_words: an empty token sequence is not allowed"),
        ({"bad_words": ((-1,),)}, "bad_words: token id -1 is out of range; allowed: 0 to 99"),
    ],
)
def test_validate_names_the_bad_setting(settings, message):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**settings).validate(VOCAB, max_output_len=64)
    assert str(error.value) == message


def test_validate_without_a_max_output_len_allows_up_to_int32():
    SamplingParams(max_tokens=2**31 - 1).validate(VOCAB)
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: 2147483648 is out of range; allowed: 1 to 2147483647$"):
        SamplingParams(max_tokens=2**31).validate(VOCAB)


def test_validate_accepts_the_boundaries():
    SamplingParams().validate(VOCAB, max_output_len=64)
    SamplingParams(
        max_tokens=64, min_tokens=64, temperature=100.0, top_k=VOCAB * 10, top_p=1.0, min_p=1.0,
        repetition_penalty=100.0, presence_penalty=-2.0, frequency_penalty=2.0, seed=2**63 - 1, end_id=99,
        top_logprobs=20, stop_sequences=((99,), (0, 1)), bad_words=((0,),),
    ).validate(VOCAB, max_output_len=64)
    SamplingParams(temperature=0.0, top_p=1e-6, min_p=0.0, seed=0, end_id=0, top_logprobs=0).validate(VOCAB)
