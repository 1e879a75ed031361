"""Several outputs per request through the real server (docs/SEQUENCE-GROUPS.md): the
`openai` client's `n=3` chat, streamed and not, and TensorRT-LLM's `beam_width` 4 over
gRPC, streamed and not (every response carries all the beams, TensorRT-LLM's beam
dimension), each checked against the offline engine on the same weights."""

from __future__ import annotations

import pytest

from inflightllm.config import EngineConfig
from inflightllm.detokenizer import decode_piece
from inflightllm.engine import Engine
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.sampling_params import SamplingParams
from inflightllm.sequence_group import GroupParams
from tests.ensemble_client import run_one
from tests.test_openai_frontend import Frontend, chat

pytestmark = pytest.mark.server

STORY = "Once upon a time"


@pytest.fixture(scope="module")
def frontend(model_repo_server):
    server = Frontend(model_repo_server.grpc_url)
    yield server
    server.stop()


def offline(loaded, prompt: list[int], params: SamplingParams, group: GroupParams, streaming: bool = False) -> list:
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=256, block_size=16), sampler_seed=0, loaded=loaded)
    engine.add_request("offline", prompt, params, group=group, streaming=streaming)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_openai_n3_chat_streamed_and_not_equals_the_offline_engine(frontend, smollm2_loaded, smollm2_tokenizer):
    messages = chat()
    prompt = smollm2_tokenizer.encode(
        smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    expected: dict[int, list[int]] = {}
    for output in offline(smollm2_loaded, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=5),
                          GroupParams(n=3)):
        expected.setdefault(output.sequence_index, []).extend(output.new_token_ids)
    texts = [smollm2_tokenizer.decode(expected[i], skip_special_tokens=True) for i in range(3)]
    assert len(set(texts)) > 1  # three different samples

    client = frontend.client()
    answer = client.chat.completions.create(model="ensemble", messages=messages, max_tokens=10, temperature=1.0,
                                            seed=5, n=3)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert [choice.message.content for choice in answer.choices] == texts
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == sum(len(ids) for ids in expected.values())

    chunks = list(client.chat.completions.create(model="ensemble", messages=messages, max_tokens=10,
                                                 temperature=1.0, seed=5, n=3, stream=True))
    streamed = {i: "" for i in range(3)}
    roles, finishes = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
            if choice.finish_reason:
                finishes.append(choice.index)
    assert [streamed[i] for i in range(3)] == texts
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]  # each choice: one role chunk, one finish


def beams_of(result) -> list[list[int]]:
    """A beam search response's beams: the rows of output_ids [1, beams, longest] cut at
    their sequence_length."""
    rows = result.as_numpy("output_ids")[0].tolist()
    return [row[:length] for row, length in zip(rows, result.as_numpy("sequence_length")[0].tolist(), strict=True)]


def test_tensorrt_llm_beam_width_4_over_grpc_streaming_equals_the_offline_engine(model_repo_server, smollm2_loaded,
                                                                                  smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode(STORY)
    group = GroupParams(beam_width=4, length_penalty=1.0, early_stopping=False)
    steps = offline(smollm2_loaded, prompt, SamplingParams(max_tokens=8), group, streaming=True)
    final = steps[-1]
    assert final.finished and len(final.beam_token_ids) == 4
    assert final.beam_scores == sorted(final.beam_scores, reverse=True)  # score order, best first
    result = run_one(model_repo_server.grpc_url, {"text_input": STORY, "max_tokens": 8, "stream": True,
                                                   "beam_width": 4, "length_penalty": 1.0, "early_stopping": 0})
    assert result.error is None, result.error
    responses = [r for r in result.responses if r.as_numpy("text_output") is not None]  # not an empty final
    assert int(responses[-1].as_numpy("num_input_tokens").reshape(-1)[0]) == len(prompt)
    # Streaming: every response carries the four current beams (TensorRT-LLM's beam dimension).
    assert len(responses) > 1
    for response in responses:
        assert response.as_numpy("text_output").shape == (1, 4)
        assert response.as_numpy("output_ids").shape[:2] == (1, 4)
        assert response.as_numpy("sequence_length").shape == response.as_numpy("cum_log_probs").shape == (1, 4)
        assert int(response.as_numpy("sequence_index").reshape(-1)[0]) == 0
    # Each response is one offline step's beams (a stream that fell behind skips steps), in order.
    at = 0
    for response in responses:
        beams = beams_of(response)
        while [list(b) for b in steps[at].beam_token_ids] != beams:
            at += 1
        assert response.as_numpy("cum_log_probs")[0].tolist() == pytest.approx(steps[at].beam_cum_logprobs,
                                                                                abs=1e-4)
        texts = [text.decode() for text in response.as_numpy("text_output")[0]]
        final_piece = response is responses[-1]  # earlier ones hold back an incomplete character
        assert texts == [decode_piece(smollm2_tokenizer, [], ids, final=final_piece) for ids in beams]
    # The final response: the final beams in score order, with their texts.
    last = responses[-1]
    assert beams_of(last) == final.beam_token_ids
    assert last.as_numpy("cum_log_probs")[0].tolist() == pytest.approx(final.beam_cum_logprobs, abs=1e-4)
    texts = [text.decode() for text in last.as_numpy("text_output")[0]]
    assert texts == [smollm2_tokenizer.decode(ids, skip_special_tokens=True) for ids in final.beam_token_ids]
    assert result.finish_reason in ("stop", "length")


def test_tensorrt_llm_beam_width_4_without_streaming_equals_the_offline_engine(model_repo_server, smollm2_loaded,
                                                                                smollm2_tokenizer):
    """One response with the final beams; the prompt first in each (exclude_input_in_output
    false, TensorRT-LLM's default) and each beam's per-token log probs."""
    prompt = smollm2_tokenizer.encode(STORY)
    group = GroupParams(beam_width=4, length_penalty=0.5, early_stopping=True)
    [final] = [o for o in offline(smollm2_loaded, prompt, SamplingParams(max_tokens=8, logprobs=True), group)
               if o.finished]
    result = run_one(model_repo_server.grpc_url, {
        "text_input": STORY, "max_tokens": 8, "stream": False, "beam_width": 4, "length_penalty": 0.5,
        "early_stopping": 1, "exclude_input_in_output": False, "return_log_probs": True})
    assert result.error is None, result.error
    [response] = [r for r in result.responses if r.as_numpy("text_output") is not None]
    assert beams_of(response) == [prompt + beam for beam in final.beam_token_ids]
    assert response.as_numpy("cum_log_probs")[0].tolist() == pytest.approx(final.beam_cum_logprobs, abs=1e-4)
    texts = [text.decode() for text in response.as_numpy("text_output")[0]]
    assert texts == [smollm2_tokenizer.decode(prompt + beam, skip_special_tokens=True)
                     for beam in final.beam_token_ids]
    log_probs = response.as_numpy("output_log_probs")
    assert log_probs.shape == (1, 4, max(len(beam) for beam in final.beam_token_ids))
    for row, expected in zip(log_probs[0].tolist(), final.beam_logprobs, strict=True):
        assert row[:len(expected)] == pytest.approx(expected, abs=1e-4)
