"""OpenAI structured output and tool calling with the official `openai` client.

The front end (inflightllm.openai_frontend.app) runs in this process, in front of the
ensemble's steps run in this process too: preprocessing's `build_engine_request`, the
engine model's `parse_engine_request`, a real Engine on SmolLM2-135M (CPU), and the
detokenizer. Only Triton's transport is left out, so the front end's request mapping,
the chat template's tools, the constraint and the tool-call parsing (streaming and not)
are all exercised. Through tritonserver the same app talks gRPC (tests/test_openai_frontend.py)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest
import torch
from starlette.testclient import TestClient

from inflightllm.config import EngineConfig
from inflightllm.engine import Engine
from inflightllm.model_source import DEFAULT_MODEL
from inflightllm.openai_frontend.app import ServingLimits, create_app
from inflightllm.openai_frontend.triton_backend import INPUT_TYPES, BackendError, Piece
from inflightllm.sampling_params import InvalidRequestError
from inflightllm.serving.engine_io import parse_engine_request
from inflightllm.text.preprocess import RequestError, RequestLimits, build_engine_request

pytestmark = pytest.mark.slow

_NUMPY = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class InProcessEnsemble:
    """The ensemble's three steps in this process, behind TritonBackend's interface."""

    grpc_url = "in-process"

    def __init__(self, engine: Engine, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = RequestLimits(2048, 1024, 3072, 3, engine.vocab_size)
        self.count = 0

    async def is_ready(self) -> bool:
        return True

    async def generate(self, values: dict):
        inputs = {}
        for name, value in values.items():
            kind = INPUT_TYPES[name]
            if kind == "BYTES":
                items = value if isinstance(value, list) else [value]
                inputs[name] = np.array([[item.encode("utf-8") for item in items]], dtype=object)
            else:
                inputs[name] = np.array([[value]], dtype=_NUMPY[kind])
        try:
            tensors = build_engine_request(inputs, self.tokenizer, self.limits)
            request = parse_engine_request({name: torch.from_numpy(np.ascontiguousarray(array))
                                            for name, array in tensors.items()})
            self.count += 1
            request_id = f"r{self.count}"
            self.engine.add_request(request_id, request.prompt_token_ids, request.params, streaming=request.streaming)
        except (RequestError, InvalidRequestError) as error:
            raise BackendError(400, str(error)) from None
        tokens: list[int] = []
        sent = ""
        while self.engine.has_unfinished():
            for output in self.engine.step():
                assert output.request_id == request_id
                if output.error:
                    raise BackendError(400, output.error)
                tokens.extend(output.new_token_ids)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                piece, sent = text[len(sent):], text
                yield Piece(text=piece, finish_reason=output.finish_reason.text if output.finished else "",
                            num_input_tokens=output.num_prompt_tokens, num_output_tokens=output.num_output_tokens,
                            num_cached_tokens=output.num_cached_tokens, output_ids=list(output.new_token_ids))


@pytest.fixture(scope="module")
def client(smollm2_loaded, smollm2_tokenizer):
    engine = Engine(DEFAULT_MODEL, EngineConfig(max_batch_size=4), sampler_seed=0, loaded=smollm2_loaded)
    engine.grammar_compiler(tokenizer=smollm2_tokenizer)
    app = create_app(InProcessEnsemble(engine, smollm2_tokenizer), smollm2_tokenizer, ServingLimits(1024, 3072))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)


def create(client, **kwargs):
    kwargs.setdefault("max_tokens", 48)
    return client.chat.completions.create(model="ensemble", messages=ASK, temperature=0, **kwargs)


def streamed_calls(stream) -> tuple[list[dict], list[str | None]]:
    """Tool calls accumulated from stream deltas as OpenAI's clients do; finish reasons."""
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[index] for index in sorted(calls)], [reason for reason in reasons if reason]


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_call(client):
    # (With parallel calls, the default, the output is a list of calls that a model this
    # small keeps extending until max_tokens: one call is asked for here.)
    answer = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call-")
        check_call(call.function.name, call.function.arguments)


def tool_call_deltas(stream) -> tuple[list, list[str | None]]:
    """Every tool-call delta of a stream, in order, and the finish reasons."""
    deltas, reasons = [], []
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
        deltas.extend(choice.delta.tool_calls or [])
    return deltas, reasons


def check_delta_shapes(deltas) -> None:
    """OpenAI's shapes: a call's first delta has its index, id, type "function", the name and
    arguments ""; the later ones only the index and an arguments fragment."""
    seen: set[int] = set()
    for delta in deltas:
        if delta.index not in seen:
            seen.add(delta.index)
            assert delta.id.startswith("call-") and delta.type == "function", delta
            assert delta.function.name in SCHEMAS and delta.function.arguments == "", delta
        else:
            assert delta.id is None and delta.type is None and delta.function.name is None, delta
            assert delta.function.arguments, delta
    assert seen == set(range(len(seen)))


def test_required_tool_call_streamed(client):
    whole = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    deltas, reasons = tool_call_deltas(create(client, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, stream=True))
    assert reasons == ["tool_calls"]
    check_delta_shapes(deltas)
    assert {delta.index for delta in deltas} == {0}
    fragments = [delta.function.arguments for delta in deltas[1:]]
    assert len(fragments) > 3  # streamed as generated, not held to the end
    arguments = "".join(fragments)
    check_call(deltas[0].function.name, arguments)
    # Greedy: the same call as the non-streamed answer.
    assert (deltas[0].function.name, arguments) == (whole.tool_calls[0].function.name,
                                                    whole.tool_calls[0].function.arguments)


def test_required_parallel_tool_calls_stream_each_call(client):
    """With parallel calls a model this small keeps adding calls until max_tokens: every
    complete call streamed validates, each under its own index and id; the stream ends with
    finish_reason length (OpenAI's, for an output cut short)."""
    deltas, reasons = tool_call_deltas(create(client, tools=TOOLS, tool_choice="required", stream=True,
                                              max_tokens=64))
    check_delta_shapes(deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        calls.setdefault(delta.index, [delta.function.name, ""])[1] += delta.function.arguments
    assert reasons in (["tool_calls"], ["length"])
    complete = calls if reasons == ["tool_calls"] else dict(list(calls.items())[:-1])
    assert complete, calls
    for name, arguments in complete.values():
        check_call(name, arguments)
    assert len({delta.id for delta in deltas if delta.id}) == len(calls)


def test_auto_streams_content_as_generated(client):
    """tool_choice auto: text that cannot begin a call streams as content; the streamed
    pieces make the non-streamed answer (content or calls)."""
    whole = create(client, tools=TOOLS, max_tokens=16).choices[0]
    contents, deltas, reasons = [], [], []
    for chunk in create(client, tools=TOOLS, max_tokens=16, stream=True):
        choice = chunk.choices[0]
        contents.append(choice.delta.content or "")
        deltas.extend(choice.delta.tool_calls or [])
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    assert reasons == [whole.finish_reason]
    if whole.message.tool_calls:
        assert [d.function.name for d in deltas] == [c.function.name for c in whole.message.tool_calls]
    else:
        assert "".join(contents) == whole.message.content
        assert sum(1 for c in contents if c) > 1  # more than one content chunk: not held


def test_named_tool_call(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = create(client, tools=TOOLS, tool_choice=choice)
    call = answer.choices[0].message.tool_calls[0]
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    check_call("get_time", call.function.arguments)
    calls, reasons = streamed_calls(create(client, tools=TOOLS, tool_choice=choice, stream=True))
    assert reasons == ["tool_calls"] and [c["name"] for c in calls] == ["get_time"]
    assert calls[0]["arguments"] == call.function.arguments  # greedy: the same arguments, streamed
    check_call("get_time", calls[0]["arguments"])


def test_tool_choice_none_answers_in_text(client):
    answer = create(client, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    answer = create(client, response_format=fmt)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in create(client, response_format=fmt, stream=True))
    assert text == answer.choices[0].message.content


def test_response_format_json_object(client):
    answer = create(client, response_format={"type": "json_object"}, max_tokens=48)
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
          "tool_choice": "required"}, "tools[0].function.parameters", "not a valid JSON Schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}}}]},
         "tools[0].function.parameters", "'multipleOf' is not supported"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "is not one of the tools"),
        ({"tool_choice": "required"}, "tool_choice", "allowed only with tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format.json_schema.schema", "not a valid JSON Schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "required"),
    ],
)
def test_bad_tools_and_formats_are_refused_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kwargs)
    error = info.value.body
    assert error["param"] == param, error
    assert words in error["message"], error
