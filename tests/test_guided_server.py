"""Structured output through the real server (the default ensemble): a burst of
constrained requests in which one has a bad schema; that one alone fails, with an error
naming its input, and the others' outputs validate (docs/STRUCTURED-OUTPUT.md)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.ensemble_client import run_stream_requests

pytestmark = pytest.mark.server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


def test_bad_schema_in_a_burst_fails_alone(model_repo_server):
    base = {"text_input": "Reply in JSON:", "max_tokens": 48, "stream": True}
    requests = [
        {**base, "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA)},
        {**base, "sampling_parameters": {"guided_json": {"type": "objec"}}},
        {**base, "sampling_parameters": {"guided_regex": r"\d{3}-\d{4}"}},
        {**base, "sampling_parameters": {"guided_choice": ["yes", "no"]}},
        {**base, "text_input": "Once upon a time", "max_tokens": 8},
    ]
    results = run_stream_requests(model_repo_server.grpc_url, requests, num_streams=len(requests))
    assert results[1].error is not None
    assert "sampling_parameters key 'guided_json': not a valid JSON Schema at #/type" in results[1].error
    for index in (0, 2, 3, 4):
        assert results[index].error is None, results[index].error
    assert results[0].finish_reason == "stop"
    jsonschema.validate(json.loads(results[0].text), SCHEMA)
    assert re.fullmatch(r"\d{3}-\d{4}", results[2].text)
    assert results[3].text in ("yes", "no")
    assert results[4].finish_reason == "length"


def test_openai_tool_calls_through_the_server(model_repo_server):
    from tests.test_openai_frontend import Frontend

    frontend = Frontend(model_repo_server.grpc_url)
    try:
        client = frontend.client()
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}}
        schema = weather["function"]["parameters"]
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        answer = client.chat.completions.create(model="ensemble", messages=messages, tools=[weather],
                                                tool_choice="required", parallel_tool_calls=False,
                                                temperature=0, max_tokens=48)
        assert answer.choices[0].finish_reason == "tool_calls"
        call = answer.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema)
        stream = client.chat.completions.create(model="ensemble", messages=messages, tools=[weather],
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=0, max_tokens=48, stream=True)
        arguments, reasons = "", []
        for chunk in stream:
            reasons.append(chunk.choices[0].finish_reason)
            for delta in chunk.choices[0].delta.tool_calls or []:
                arguments += (delta.function.arguments or "") if delta.function else ""
        assert [reason for reason in reasons if reason] == ["tool_calls"]
        jsonschema.validate(json.loads(arguments), schema)
    finally:
        frontend.stop()
