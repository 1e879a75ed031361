"""Triton's HTTP `generate` and `generate_stream` endpoints on the ensemble (urllib only).

What the endpoints need (docs/CLIENTS.md): a JSON object whose keys are input names and
whose values are scalars (a list for `stop_words`/`bad_words`); `max_tokens` is required.
`generate` accepts exactly one response, so it needs `stream` false (the default) and,
for a completion without the prompt in front, `exclude_input_in_output: true`.
`generate_stream` answers with server-sent events (`data: {...}` lines), one per piece.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from inflightllm.client import chat_messages, stream_generate
from tests.ensemble_client import run_one

pytestmark = pytest.mark.server

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # the greedy answer through the chat template
STORY_PROMPT = "Once upon a time"


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, str, str]:
    """POST JSON; returns (HTTP status, content type, body text), also for HTTP errors."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read().decode()


def sse_events(text: str) -> list[dict]:
    """The JSON objects of the `data:` lines of a server-sent-events body."""
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            events.append(json.loads(line[len("data:"):]))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


@pytest.fixture(scope="module")
def endpoint(model_repo_server) -> str:
    return f"http://{model_repo_server.http_url}/v2/models/ensemble"


def chat_body(**extra) -> dict:
    return {"messages": json.dumps(chat_messages(QUESTION)), "max_tokens": 32, **extra}


def test_generate_returns_the_greedy_text(endpoint, model_repo_server):
    status, content_type, body = post(f"{endpoint}/generate", chat_body(stream=False, exclude_input_in_output=True))
    assert status == 200 and content_type == "application/json", body
    answer = json.loads(body)
    assert answer["text_output"] == ANSWER
    assert (answer["finish_reason"], answer["num_output_tokens"], answer["num_input_tokens"]) == ("stop", 7, 37)
    assert answer["model_name"] == "ensemble"
    # The same as over gRPC.
    grpc_text = stream_generate(model_repo_server.grpc_url, messages=chat_messages(QUESTION), max_tokens=32).text
    assert answer["text_output"] == grpc_text
    # `stream` defaults to false, so it may be left out.
    _, _, body = post(f"{endpoint}/generate", chat_body(exclude_input_in_output=True))
    assert json.loads(body)["text_output"] == ANSWER


def test_generate_echoes_the_prompt_unless_excluded(endpoint):
    _, _, body = post(f"{endpoint}/generate", {"text_input": STORY_PROMPT, "max_tokens": 8, "exclude_input_in_output": True})
    completion = json.loads(body)
    assert completion["finish_reason"] == "length" and completion["num_output_tokens"] == 8
    assert completion["text_output"].strip()
    _, _, body = post(f"{endpoint}/generate", {"text_input": STORY_PROMPT, "max_tokens": 8})
    echoed = json.loads(body)
    assert echoed["text_output"] == STORY_PROMPT + completion["text_output"]
    assert echoed["num_output_tokens"] == 8  # the echoed prompt is not counted


def test_generate_stream_pieces_concatenate_to_the_same_text(endpoint):
    status, content_type, body = post(f"{endpoint}/generate_stream", chat_body(stream=True))
    assert status == 200 and content_type.startswith("text/event-stream"), body
    events = sse_events(body)
    pieces = [event["text_output"] for event in events]
    assert pieces == ["The", " capital", " of", " France", " is", " Paris", ".", ""]
    assert "".join(pieces) == ANSWER
    assert [event["finish_reason"] for event in events] == [""] * 7 + ["stop"]
    assert [event["num_output_tokens"] for event in events] == [1, 2, 3, 4, 5, 6, 7, 7]


def test_generate_stream_with_stream_false_sends_one_event(endpoint):
    _, _, body = post(f"{endpoint}/generate_stream", chat_body(stream=False, exclude_input_in_output=True))
    events = sse_events(body)
    assert [(event["text_output"], event["finish_reason"]) for event in events] == [(ANSWER, "stop")]


def test_generate_refuses_more_than_one_response(endpoint):
    # stream=true makes the decoupled engine send one response per token; `generate`
    # cannot return that (Triton 2.51 answers with HTTP 200 and an error body).
    _, _, body = post(f"{endpoint}/generate", chat_body(stream=True))
    assert json.loads(body) == {
        "error": "generate expects model to produce exactly 1 response, use generate stream for model"
        " that generates various number of responses"
    }


def test_bad_input_is_an_http_error_naming_the_input(endpoint):
    status, content_type, body = post(f"{endpoint}/generate", chat_body(temperature=-1))
    assert status == 400 and content_type == "application/json"
    assert json.loads(body) == {
        "error": "in ensemble 'ensemble', input 'temperature': -1.0 is out of range; allowed: 0 to 100 (0 = greedy)"
    }
    status, content_type, body = post(f"{endpoint}/generate_stream", chat_body(stream=True, max_tokens=5000))
    assert status == 400 and content_type.startswith("text/event-stream")
    [event] = sse_events(body)
    assert event["error"].startswith("in ensemble 'ensemble', input 'max_tokens': 5000 is out of range")


def test_fields_that_are_not_inputs_are_refused_not_ignored(endpoint):
    """A generate body's fields that are not inputs reach the model as request parameters:
    a misspelled input, or vLLM's guided_json at the top level, is an error naming it."""
    status, _, body = post(f"{endpoint}/generate", chat_body(temprature=0.5))
    assert status == 400
    error = json.loads(body)["error"]
    assert "request parameter 'temprature': not an input of this model" in error
    assert "text_input" in error and "temperature" in error  # the inputs are listed
    status, _, body = post(f"{endpoint}/generate", chat_body(guided_json='{"type": "object"}'))
    assert status == 400
    assert "'guided_json'" in json.loads(body)["error"] and "sampling_parameters input" in json.loads(body)["error"]
    # the same constraint where it belongs is served
    status, _, body = post(f"{endpoint}/generate", chat_body(
        sampling_parameters=json.dumps({"guided_json": {"type": "object"}}), max_tokens=16))
    assert status == 200, body


def test_stop_words_as_a_json_list(endpoint):
    _, _, body = post(
        f"{endpoint}/generate", chat_body(stop_words=["Paris", "Rome"], exclude_input_in_output=True)
    )
    answer = json.loads(body)
    assert (answer["text_output"], answer["finish_reason"]) == ("The capital of France is", "stop")


def test_sampling_parameters_is_a_json_string(endpoint):
    # BYTES inputs take JSON strings; a nested JSON object is refused by Triton's parser.
    params = {"temperature": 0, "stop": ["Paris"]}
    _, _, body = post(
        f"{endpoint}/generate", chat_body(sampling_parameters=json.dumps(params), exclude_input_in_output=True)
    )
    assert json.loads(body)["text_output"] == "The capital of France is"
    status, _, body = post(f"{endpoint}/generate", chat_body(sampling_parameters=params))
    assert status == 500
    assert json.loads(body) == {"error": "Unable to parse JSON bytes array: attempt to access JSON non-string as string"}


# --- other backends' request names (TensorRT-LLM and vLLM), over HTTP and gRPC -------------------


def test_tensorrt_llm_random_seed_takes_effect_over_http_and_grpc(endpoint, model_repo_server):
    base = {"text_input": STORY_PROMPT, "max_tokens": 12, "exclude_input_in_output": True, "temperature": 1.0}

    def http_text(**extra) -> str:
        status, _, body = post(f"{endpoint}/generate", {**base, **extra})
        assert status == 200, body
        return json.loads(body)["text_output"]

    seeded = http_text(seed=11)
    assert http_text(random_seed=11) == seeded  # the same setting under TensorRT-LLM's name
    assert len({http_text(random_seed=seed) for seed in (1, 2, 3, 11)}) > 1  # and it changes the sample
    grpc = run_one(model_repo_server.grpc_url, {**base, "random_seed": 11, "stream": True})
    assert grpc.error is None and grpc.text == seeded
    # min_length: TensorRT-LLM's name of min_tokens (the chat answer would stop after 7 tokens).
    _, _, body = post(f"{endpoint}/generate", chat_body(min_length=12, exclude_input_in_output=True))
    answer = json.loads(body)
    assert answer["num_output_tokens"] >= 12 and answer["batch_index"] == 0


def test_features_this_engine_lacks_are_refused_not_ignored(endpoint, model_repo_server):
    for extra, words in [
        ({"beam_width": 0}, "input 'beam_width': 0 is out of range; allowed: 1 or more"),
        ({"length_penalty": 12.0}, "input 'length_penalty': 12.0 is out of range"),
        ({"return_generation_logits": True}, "input 'return_generation_logits': true is not supported"),
    ]:
        status, _, body = post(f"{endpoint}/generate", chat_body(**extra))
        assert status == 400 and words in json.loads(body)["error"], body
    accepted = {"beam_width": 1, "length_penalty": 1.0, "return_context_logits": False}
    status, _, body = post(f"{endpoint}/generate", chat_body(exclude_input_in_output=True, **accepted))
    assert status == 200 and json.loads(body)["text_output"] == ANSWER
    # Beam search is supported (docs/SEQUENCE-GROUPS.md) up to the profile's max_beam_width.
    result = run_one(model_repo_server.grpc_url, {"messages": chat_messages(QUESTION), "max_tokens": 8,
                                                  "beam_width": 9})
    assert "beam_width: 9 is out of range; allowed: 1 to 8 (engine.max_beam_width)" in result.error


def test_vllm_names_take_effect(endpoint, model_repo_server):
    # genai-perf's vLLM format: numbers as JSON strings, no max_tokens tensor.
    body = {"text_input": STORY_PROMPT, "exclude_input_in_output": True, "stream": False,
            "sampling_parameters": json.dumps({"max_tokens": "6", "min_tokens": "6", "n": 1}),
            "return_cumulative_logprob": True}
    status, _, text = post(f"{endpoint}/generate", body)
    assert status == 200, text
    answer = json.loads(text)
    assert answer["num_output_tokens"] == 6
    assert answer["cumulative_logprob"] == answer["cum_log_probs"] < 0
    result = run_one(model_repo_server.grpc_url, {"text_input": STORY_PROMPT, "max_tokens": 6, "stream": False,
                                                  "exclude_input_in_output": True, "return_logprobs": True})
    assert result.error is None and len(result.last("output_log_probs").reshape(-1)) == 6
    status, _, text = post(f"{endpoint}/generate", {**body, "sampling_parameters": json.dumps({"max_tokens": 6, "n": 0})})
    assert status == 400 and "sampling_parameters key 'n': 0 is out of range; allowed: 1 or more" in text


def test_generate_with_beam_search_returns_every_beam(endpoint, model_repo_server):
    """Beam search answers with one response (every beam in it: docs/INTERFACE.md), so the
    one-response `generate` endpoint takes it: `text_output` and `cum_log_probs` are JSON
    lists of the beams, best first, equal to what gRPC returns."""
    body = {"text_input": STORY_PROMPT, "max_tokens": 6, "stream": False, "exclude_input_in_output": True,
            "beam_width": 3}
    status, _, text = post(f"{endpoint}/generate", body)
    assert status == 200, text
    answer = json.loads(text)
    result = run_one(model_repo_server.grpc_url, body)
    assert result.error is None, result.error
    [response] = [r for r in result.responses if r.as_numpy("text_output") is not None]
    assert answer["text_output"] == [t.decode() for t in response.as_numpy("text_output")[0]]
    assert len(answer["text_output"]) == 3 and len(set(answer["text_output"])) == 3
    assert answer["cum_log_probs"] == pytest.approx(response.as_numpy("cum_log_probs")[0].tolist(), abs=1e-6)
    assert answer["sequence_length"] == response.as_numpy("sequence_length")[0].tolist()
