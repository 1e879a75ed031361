"""Structured output through the real server (the default ensemble): a burst of
constrained requests in which one has a bad schema; that one alone fails, with an error
naming its input, and the others' outputs validate; a burst of requests with a schema
each beside unconstrained streams, which stay as they are without it
(docs/STRUCTURED-OUTPUT.md)."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from perf.bench_guided import _server_bursts, burst_schema
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


BURST = 200  # requests with a schema each (about 30 s on 2 cores, most of it the 200 compiles)


distinct_schema = burst_schema  # a schema never seen before (its key and values name the index)


def test_burst_of_distinct_schemas_beside_unconstrained_streams(model_repo_server):
    """200 requests, each with its own schema (200 compiles on the engine's compile thread),
    arrive while unconstrained streams run: every constrained output validates, the one bad
    schema of the burst fails alone naming its input, and the unconstrained outputs are
    the same as without the burst (greedy; an unconstrained row's logits are not touched).
    The burst's effect on the unconstrained requests' step rate is measured by
    perf/bench_guided.py (burst run), not asserted here."""
    url = model_repo_server.grpc_url
    free = [{"text_input": prompt, "max_tokens": 24, "stream": True}
            for prompt in ("Once upon a time", "The capital of France is", "def fibonacci(n):", "Dear diary,")]
    alone = run_stream_requests(url, free, num_streams=len(free))
    assert all(result.error is None and result.finish_reason == "length" for result in alone)

    burst = [{"text_input": "Reply in JSON:", "max_tokens": 32, "stream": True,
              "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(distinct_schema(i))}
             for i in range(BURST)]
    bad = {"text_input": "Reply in JSON:", "max_tokens": 32, "stream": True,
           "guided_decoding_guide_type": "json_schema",
           "guided_decoding_guide": json.dumps({"type": "object", "properties": {
               "n": {"type": "integer", "multipleOf": 2}}})}
    outcomes: dict[str, list] = {}

    def send(name: str, requests: list[dict], streams: int) -> None:
        outcomes[name] = run_stream_requests(url, requests, num_streams=streams, timeout=600)

    started = time.monotonic()
    threads = [threading.Thread(target=send, args=("burst", burst, 8)),
               # Alone on its stream: a stream's error is attributed to its only open request.
               threading.Thread(target=send, args=("bad", [bad], 1))]
    for thread in threads:
        thread.start()
    beside = run_stream_requests(url, free, num_streams=len(free), timeout=600)
    for thread in threads:
        thread.join()
    print(f"burst of {BURST} schemas beside {len(free)} streams: {time.monotonic() - started:.1f} s")

    assert [result.text for result in beside] == [result.text for result in alone]
    assert all(result.error is None and result.finish_reason == "length" for result in beside)
    (bad_result,) = outcomes["bad"]
    assert bad_result.error is not None
    assert "guided_decoding_guide" in bad_result.error and "#/properties/n/multipleOf" in bad_result.error, \
        bad_result.error
    failures = []
    for index, result in enumerate(outcomes["burst"]):
        try:
            assert result.error is None and result.finish_reason == "stop", (result.error, result.finish_reason)
            jsonschema.validate(json.loads(result.text), distinct_schema(index))
        except Exception as failure:  # noqa: BLE001 - report every bad output at once
            failures.append(f"{index}: {result.text!r}: {failure!r}")
    assert not failures, "\n".join(failures[:10])


def test_server_burst_bench_measures_the_streams_beside_each_burst(model_repo_server):
    """perf/bench_guided.py --server's measurement at a tiny size (the figure itself is for
    the GPU host): both bursts run to the end beside the long streams, whose rates are
    measured during each; schemas numbered apart from the test above (no cache hits)."""
    import argparse
    import asyncio

    args = argparse.Namespace(server_streams=2, server_stream_tokens=400, burst=6, server_burst_tokens=8,
                              server_quiet_s=0.5, server_first_schema=5000)
    report = asyncio.run(_server_bursts(model_repo_server.grpc_url, args))
    assert report["quiet_tok_s_per_stream"] > 0
    for label in ("no_schema", "distinct_schemas"):
        assert report[label]["errors"] == 0 and report[label]["stream_tok_s_per_stream"] > 0
    assert report["ratio"] == pytest.approx(report["distinct_schemas"]["stream_tok_s_per_stream"]
                                            / report["no_schema"]["stream_tok_s_per_stream"], abs=1e-3)


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
        # required, streamed: the call's id and name first, then its arguments as generated.
        stream = client.chat.completions.create(model="ensemble", messages=messages, tools=[weather],
                                                tool_choice="required", parallel_tool_calls=False,
                                                temperature=0, max_tokens=48, stream=True)
        deltas, reasons = [], []
        for chunk in stream:
            reasons.append(chunk.choices[0].finish_reason)
            deltas.extend(chunk.choices[0].delta.tool_calls or [])
        assert [reason for reason in reasons if reason] == ["tool_calls"]
        first, rest = deltas[0], deltas[1:]
        assert (first.index, first.type, first.function.name, first.function.arguments) == (
            0, "function", "get_weather", "")
        assert first.id.startswith("call-") and len(rest) > 1
        assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
        assert "".join(d.function.arguments for d in rest) == call.function.arguments
    finally:
        frontend.stop()
