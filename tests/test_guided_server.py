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
