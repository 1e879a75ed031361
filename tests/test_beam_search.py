"""Beam search equals `transformers`' `generate(num_beams=...)`: every returned beam's ids,
and its score within 1e-4, with the same length_penalty and early_stopping; beam widths
2, 4 and 8 run together in one engine with staggered arrivals, beside other requests,
through a preemption; on SmolLM2 and on two random-weight Llama shapes."""

from __future__ import annotations

import pytest
import torch

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.sampling_params import SamplingParams
from inflightllm.sequence_group import GroupParams

pytestmark = pytest.mark.slow


def transformers_beams(model, prompt, group: GroupParams, max_new_tokens: int, eos_ids) -> tuple[list, list]:
    """transformers' beams (cut before the stop token, as the engine returns them) and scores."""
    eos = sorted(eos_ids)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            num_beams=group.beam_width, num_return_sequences=group.beam_width, do_sample=False,
            max_new_tokens=max_new_tokens, length_penalty=group.length_penalty,
            early_stopping=group.early_stopping, output_scores=True, return_dict_in_generate=True,
            eos_token_id=eos, pad_token_id=eos[0])
    beams = []
    for sequence in out.sequences.tolist():
        generated = sequence[len(prompt):]
        beams.append(generated[: next((i for i, t in enumerate(generated) if t in eos_ids), len(generated))])
    return beams, out.sequences_scores.tolist()


def run_beams(engine: Engine, requests: list[tuple], arrivals: list[int], max_steps: int = 5000) -> dict:
    """requests: (request id, prompt, params, group); returns request id -> final output."""
    finals = {}
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    step = 0
    while step < max_steps and (pending or engine.has_unfinished()):
        while pending and arrivals[pending[0]] <= step:
            request_id, prompt, params, group = requests[pending.pop(0)]
            engine.add_request(request_id, prompt, params, group=group, streaming=group is not None)
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                finals[output.request_id] = output
        step += 1
    assert not engine.has_unfinished() and not engine.groups
    assert engine.block_manager.num_used_blocks == 0  # no leak
    return finals


def record_group_preemptions(engine: Engine) -> list:
    preempted = []
    preempt = engine.scheduler._preempt

    def record(request, output):
        if request.group is not None:
            preempted.append(request.request_id)
        return preempt(request, output)

    engine.scheduler._preempt = record
    return preempted


def assert_beams_equal(finals, cases, reference):
    mismatches = []
    for request_id, prompt, group, max_tokens in cases:
        expected, scores = reference(prompt, group, max_tokens)
        output = finals[request_id]
        if output.beam_token_ids != expected:
            mismatches.append(f"{request_id}: ours {output.beam_token_ids} != transformers {expected}")
        elif output.beam_scores != pytest.approx(scores, abs=1e-4):
            mismatches.append(f"{request_id}: scores {output.beam_scores} != transformers {scores}")
        assert len(output.beam_cum_logprobs) == group.beam_width
    assert not mismatches, "\n".join(mismatches)


@pytest.fixture(scope="module")
def chat_prompts(smollm2_tokenizer) -> list[list[int]]:
    questions = ["What is 2+2?", "Name a color of the sky.", "Say hello in French."]
    return [smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)) for q in questions]


def test_smollm2_beams_equal_transformers_staggered(smollm2_loaded, smollm2_hf, chat_prompts):
    cases = [
        ("beam2", chat_prompts[0], GroupParams(beam_width=2, length_penalty=1.0, early_stopping=False), 12),
        ("beam4", chat_prompts[1], GroupParams(beam_width=4, length_penalty=0.5, early_stopping=True), 10),
        ("beam8", chat_prompts[2], GroupParams(beam_width=8, length_penalty=1.5, early_stopping="never"), 8),
    ]
    requests = [(rid, prompt, SamplingParams(max_tokens=n), group) for rid, prompt, group, n in cases]
    requests.append(("greedy", chat_prompts[0], SamplingParams(max_tokens=30), None))
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=256, block_size=4, max_num_tokens=64),
                    sampler_seed=0, loaded=smollm2_loaded)
    finals = run_beams(engine, requests, arrivals=[0, 1, 3, 0])
    assert engine.stats().num_cow_copies_total > 0
    eos = smollm2_loaded.eos_token_ids
    assert_beams_equal(finals, cases, lambda p, g, n: transformers_beams(smollm2_hf, p, g, n, eos))
    # The final output has the beams best first.
    assert all(finals[rid].beam_scores == sorted(finals[rid].beam_scores, reverse=True) for rid, *_ in cases)


def test_smollm2_beams_equal_transformers_through_a_preemption(smollm2_loaded, smollm2_hf, chat_prompts):
    cases = [("beam4", chat_prompts[1], GroupParams(beam_width=4, length_penalty=1.0, early_stopping=False), 10)]
    requests = [(rid, prompt, SamplingParams(max_tokens=n), group) for rid, prompt, group, n in cases]
    # A long prompt admitted before the group: the cache fills while the beams run, and the
    # group, admitted last (its beams keep their sequences, and so their admission), is the
    # one preempted.
    requests.append(("greedy", chat_prompts[0] * 4, SamplingParams(max_tokens=16, ignore_eos=True), None))
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=48, block_size=4, max_num_tokens=64),
                    sampler_seed=0, loaded=smollm2_loaded)
    preempted = record_group_preemptions(engine)
    finals = run_beams(engine, requests, arrivals=[2, 0])
    assert preempted, "no group was preempted"
    eos = smollm2_loaded.eos_token_ids
    assert_beams_equal(finals, cases, lambda p, g, n: transformers_beams(smollm2_hf, p, g, n, eos))


@pytest.fixture(scope="module", params=["tiny-llama3", "tiny-llama-mha"])
def random_llama(request, tmp_path_factory):
    """A random-weight Llama of the named shape, saved as an HF folder, and its transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from inflightllm.model_source import ModelSpec
    from inflightllm.models.loader import load_model
    from inflightllm.models.shapes import shape_config

    config_dict = shape_config("tiny-llama3")
    config_dict["initializer_range"] = 0.25  # peaked logits: beams are not near-ties
    if request.param == "tiny-llama-mha":  # no grouped-query attention, three layers, plain RoPE
        config_dict.update(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, hidden_size=96,
                           head_dim=24, rope_scaling=None, rope_theta=10000.0)
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(99)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    spec = ModelSpec(source="hf_folder", path=str(folder))
    return request.param, spec, load_model(spec), model


def test_random_llama_beams_equal_transformers(random_llama):
    """The MHA shape runs with asynchronous scheduling (the GPU default): the engine then
    waits for a beam step's candidates before it schedules the group's next step."""
    import random

    name, spec, loaded, hf_model = random_llama
    rng = random.Random(5)
    lengths = [7, 16, 21, 33]
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]
    cases = [
        ("b2", prompts[0], GroupParams(beam_width=2, length_penalty=1.0, early_stopping=False), 9),
        ("b4", prompts[1], GroupParams(beam_width=4, length_penalty=2.0, early_stopping=True), 8),
        ("b8", prompts[2], GroupParams(beam_width=8, length_penalty=0.0, early_stopping="never"), 7),
        ("b8-lp", prompts[3], GroupParams(beam_width=8, length_penalty=1.0, early_stopping=False), 6),
    ]
    requests = [(rid, prompt, SamplingParams(max_tokens=n), group) for rid, prompt, group, n in cases]
    requests.append(("greedy", prompts[1] * 6, SamplingParams(max_tokens=20, ignore_eos=True), None))
    requests.append(("greedy2", prompts[3] * 3, SamplingParams(max_tokens=20, ignore_eos=True), None))
    config = EngineConfig(num_kv_blocks=80, block_size=4, max_num_tokens=48,
                          async_scheduling=name == "tiny-llama-mha")
    engine = Engine(spec, config, sampler_seed=0, loaded=loaded)
    preempted = record_group_preemptions(engine)
    finals = run_beams(engine, requests, arrivals=[0, 2, 3, 5, 0, 1])
    assert preempted, "no group was preempted"
    eos = loaded.eos_token_ids
    assert_beams_equal(finals, cases, lambda p, g, n: transformers_beams(hf_model, p, g, n, eos))


def test_smollm2_beam_log_probs_are_the_models_per_token_log_probs(smollm2_loaded, smollm2_hf, chat_prompts):
    """With log probs asked, every final beam (and every running beam of every streamed
    step) carries one log prob per generated token: log-softmax of `transformers`' logits
    for that token after the prompt and the beam's earlier tokens. A beam that ended on a
    stop token leaves that token's log prob out of them but in its cumulative log prob."""
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=128, block_size=16), sampler_seed=0,
                    loaded=smollm2_loaded)
    prompt = chat_prompts[0]
    engine.add_request("beams", prompt, SamplingParams(max_tokens=12, logprobs=True),
                       group=GroupParams(beam_width=4), streaming=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and len(final.beam_logprobs) == 4

    def model_log_probs(beam: list[int]) -> list[float]:
        with torch.no_grad():
            logits = smollm2_hf(torch.tensor([prompt + beam])).logits[0].float()
        rows = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
        return rows[torch.arange(len(beam)), torch.tensor(beam)].tolist()

    checked = 0
    for output in outputs:
        for beam, log_probs, cum in zip(output.beam_token_ids, output.beam_logprobs, output.beam_cum_logprobs,
                                        strict=True):
            assert len(log_probs) == len(beam)
            assert log_probs == pytest.approx(model_log_probs(beam), abs=1e-4)
            if not output.finished or len(beam) == 12:  # no stop token stripped
                assert sum(log_probs) == pytest.approx(cum, abs=1e-4)
            checked += 1
    assert checked >= 4 * 3
    # Without log probs asked, no beam carries them.
    engine.add_request("quiet", prompt, SamplingParams(max_tokens=4), group=GroupParams(beam_width=2))
    quiet = []
    while engine.has_unfinished():
        quiet += engine.step()
    assert quiet[-1].beam_logprobs == [[], []]
