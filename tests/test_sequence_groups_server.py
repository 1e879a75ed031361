"""Several outputs per request through the real server (docs/SEQUENCE-GROUPS.md): the
`openai` client's `n=3` chat, streamed and not, and TensorRT-LLM's `beam_width` 4 over
gRPC streaming, each checked against the offline engine on the same weights."""

from __future__ import annotations

import pytest

from inflightllm.config import EngineConfig
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


def offline(loaded, prompt: list[int], params: SamplingParams, group: GroupParams) -> list:
    engine = Engine(DEFAULT_MODEL, EngineConfig(num_kv_blocks=256, block_size=16), sampler_seed=0, loaded=loaded)
    engine.add_request("offline", prompt, params, group=group)
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


def test_tensorrt_llm_beam_width_4_over_grpc_streaming_equals_the_offline_engine(model_repo_server, smollm2_loaded,
                                                                                  smollm2_tokenizer):
    prompt = smollm2_tokenizer.encode(STORY)
    group = GroupParams(beam_width=4, length_penalty=1.0, early_stopping=False)
    [final] = [o for o in offline(smollm2_loaded, prompt, SamplingParams(max_tokens=8), group) if o.finished]
    result = run_one(model_repo_server.grpc_url, {"text_input": STORY, "max_tokens": 8, "stream": True,
                                                   "beam_width": 4, "length_penalty": 1.0, "early_stopping": 0})
    assert result.error is None, result.error
    responses = result.responses
    assert int(responses[-1].as_numpy("num_input_tokens").reshape(-1)[0]) == len(prompt)
    # Streaming: every step sent the running beams, each response one beam with its index.
    assert len(responses) > 4
    # The final beams, best first, are the last four responses.
    last = responses[-4:]
    assert [int(r.as_numpy("sequence_index").reshape(-1)[0]) for r in last] == [0, 1, 2, 3]
    assert [r.as_numpy("output_ids").reshape(-1).tolist() for r in last] == final.beam_token_ids
    cums = [float(r.as_numpy("cum_log_probs").reshape(-1)[0]) for r in last]
    assert cums == pytest.approx(final.beam_cum_logprobs, abs=1e-4)
    texts = [r.as_numpy("text_output").reshape(-1)[0].decode() for r in last]
    assert texts == [smollm2_tokenizer.decode(ids, skip_special_tokens=True) for ids in final.beam_token_ids]
    assert result.finish_reason in ("stop", "length")
