"""Structured output through the request interfaces: vLLM's `guided_*` sampling_parameters
keys and TensorRT-LLM's `guided_decoding_guide_type`/`guided_decoding_guide` inputs in
preprocessing, the `guided_type`/`guided_guide` engine tensors, and errors that name the
input (docs/STRUCTURED-OUTPUT.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from inflightllm.guided import GuidedSpec, json_schema_spec
from inflightllm.sampling_params import InvalidRequestError
from inflightllm.serving.engine_io import parse_engine_request
from inflightllm.text.preprocess import RequestError, RequestLimits, build_engine_request

LIMITS = RequestLimits(2048, 1024, 3072, 3, 49152)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]}


def text(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=object)


def build(tokenizer, sampling=None, **tensors):
    inputs = {"text_input": text("Hello"), "max_tokens": np.array([[8]], np.int32), **tensors}
    if sampling is not None:
        inputs["sampling_parameters"] = text(json.dumps(sampling))
    return build_engine_request(inputs, tokenizer, LIMITS)


def engine_spec(request: dict[str, np.ndarray]):
    """The GuidedSpec the engine model parses from preprocessing's tensors."""
    return parse_engine_request({name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in request.items()}).params.guided


@pytest.mark.parametrize(
    "sampling, tensors, expected",
    [
        ({"guided_json": SCHEMA}, {}, json_schema_spec(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, {}, json_schema_spec(SCHEMA)),
        ({"guided_regex": r"\d+", "guided_decoding_backend": "xgrammar"}, {}, GuidedSpec("regex", r"\d+")),
        ({"guided_choice": ["yes", "no"]}, {}, GuidedSpec("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "a" | "b"'}, {}, GuidedSpec("grammar", 'root ::= "a" | "b"')),
        ({"guided_json_object": True}, {}, GuidedSpec("json_object")),
        (None, {"guided_decoding_guide_type": text("json_schema"), "guided_decoding_guide": text(json.dumps(SCHEMA))},
         json_schema_spec(SCHEMA)),
        (None, {"guided_decoding_guide_type": text("regex"), "guided_decoding_guide": text("[a-z]+ é")},
         GuidedSpec("regex", "[a-z]+ é")),
        (None, {"guided_decoding_guide_type": text("ebnf_grammar"), "guided_decoding_guide": text('root ::= "x"')},
         GuidedSpec("grammar", 'root ::= "x"')),
        (None, {"guided_decoding_guide_type": text("json")}, GuidedSpec("json_object")),
        (None, {}, None),
    ],
)
def test_constraint_reaches_the_engine(smollm2_tokenizer, sampling, tensors, expected):
    assert engine_spec(build(smollm2_tokenizer, sampling, **tensors)) == expected


@pytest.mark.parametrize(
    "sampling, tensors, message",
    [
        ({"guided_json": {"type": "objec"}}, {}, "sampling_parameters key 'guided_json': not a valid JSON Schema at #/type"),
        ({"guided_json": "{nope"}, {}, "sampling_parameters key 'guided_json': the schema is not valid JSON"),
        ({"guided_json": {"type": "string", "contentEncoding": "base64"}}, {},
         "sampling_parameters key 'guided_json': #/contentEncoding: the JSON Schema keyword 'contentEncoding' is not supported"),
        ({"guided_regex": "(a"}, {}, "sampling_parameters key 'guided_regex': Regex parsing error"),
        ({"guided_grammar": "root ::= b"}, {}, "sampling_parameters key 'guided_grammar': EBNF parser error"),
        ({"guided_choice": []}, {}, "sampling_parameters key 'guided_choice': expected a non-empty list of strings"),
        ({"guided_choice": "yes"}, {}, "sampling_parameters key 'guided_choice': \"yes\" is a string; expected a list of strings"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, {},
         "sampling_parameters key 'guided_regex' and sampling_parameters key 'guided_choice': more than one"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, {},
         "sampling_parameters key 'guided_decoding_backend': \"outlines\" is not supported; allowed: xgrammar, auto"),
        (None, {"guided_decoding_guide_type": text("structural_tag"), "guided_decoding_guide": text("{}")},
         "input 'guided_decoding_guide_type': \"structural_tag\" is not supported; allowed: json, json_schema, regex, ebnf_grammar"),
        (None, {"guided_decoding_guide_type": text("regex")}, "input 'guided_decoding_guide' is missing or empty"),
        (None, {"guided_decoding_guide": text("x")}, "input 'guided_decoding_guide' was given without 'guided_decoding_guide_type'"),
        (None, {"guided_decoding_guide_type": text("json_schema"), "guided_decoding_guide": text('{"minimum": "x"}')},
         "input 'guided_decoding_guide': not a valid JSON Schema at #/minimum"),
    ],
)
def test_bad_constraint_names_its_input(smollm2_tokenizer, sampling, tensors, message):
    with pytest.raises(RequestError) as info:
        build(smollm2_tokenizer, sampling, **tensors)
    assert str(info.value).startswith(message), str(info.value)


def test_engine_refuses_an_unknown_kind_code(smollm2_tokenizer):
    request = build(smollm2_tokenizer, {"guided_regex": "a"})
    request["guided_type"] = np.array([[9]], np.int32)
    with pytest.raises(InvalidRequestError, match=r"^guided_type: 9 is not a constraint kind"):
        engine_spec(request)


def test_engine_inputs_without_the_guided_pair_are_unconstrained(smollm2_tokenizer):
    request = build(smollm2_tokenizer)
    del request["guided_type"], request["guided_guide"]
    assert engine_spec(request) is None


def test_chat_form_carries_the_constraint(smollm2_tokenizer):
    messages = text(json.dumps([{"role": "user", "content": "Pick one"}]))
    inputs = {"messages": messages, "max_tokens": np.array([[8]], np.int32),
              "sampling_parameters": text(json.dumps({"guided_choice": ["red", "blue"]}))}
    request = build_engine_request(inputs, smollm2_tokenizer, LIMITS)
    assert engine_spec(request) == GuidedSpec("choice", '["red", "blue"]')


def test_tools_reach_a_chat_template_without_a_tool_format(smollm2_tokenizer):
    """SmolLM2's template renders no tools: they come in a system message, and an earlier
    assistant turn of tool calls becomes its JSON text."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    inputs = {"messages": text(json.dumps(messages)), "tools": text(json.dumps(tools)),
              "max_tokens": np.array([[8]], np.int32)}
    prompt = smollm2_tokenizer.decode(build_engine_request(inputs, smollm2_tokenizer, LIMITS)["input_ids"][0])
    assert prompt.startswith("<|im_start|>system\nYou can call these functions")
    assert '"name": "get_time"' in prompt
    assert '<|im_start|>assistant\n{"name": "get_time", "arguments": {}}<|im_end|>' in prompt
    assert "<|im_start|>tool\n12:00<|im_end|>" in prompt
    with pytest.raises(RequestError, match="^input 'tools': allowed only with 'messages'"):
        build(smollm2_tokenizer, tools=text(json.dumps(tools)))


def test_tool_call_parsing():
    """What `parse_tool_calls` finds in a finished output, per tool_choice mode."""
    from inflightllm.guided.tools import ToolPlan, parse_tool_calls

    names = ["get_time", "get_weather"]
    auto, required = ToolPlan("auto"), ToolPlan("required")
    call = {"name": "get_time", "arguments": {"zone": "UTC"}}
    assert parse_tool_calls(json.dumps(call), auto, names) == [call]
    assert parse_tool_calls(json.dumps([call, call]), required, names) == [call, call]
    hermes = f"Sure.<tool_call>{json.dumps(call)}</tool_call>\n<tool_call>{json.dumps(call)}</tool_call>"
    assert parse_tool_calls(hermes, auto, names) == [call, call]
    assert parse_tool_calls("It is noon.", auto, names) is None
    assert parse_tool_calls(json.dumps({"name": "launch", "arguments": {}}), auto, names) is None  # no such tool
    assert parse_tool_calls(json.dumps({"zone": "UTC"}), ToolPlan("named", name="get_time"), names) == [call]
    assert parse_tool_calls(json.dumps(call), ToolPlan("none"), names) is None


def test_tool_plans():
    from inflightllm.guided.tools import plan_tools

    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "b"}}]
    assert plan_tools(tools, None).mode == "auto" and plan_tools(tools, "none").spec is None
    assert plan_tools(None, "required").mode == "none"
    single = json.loads(plan_tools(tools, "required", parallel_tool_calls=False).spec.text)
    assert single["anyOf"][0]["properties"]["name"] == {"const": "a"}
    assert single["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    parallel = json.loads(plan_tools(tools, "required").spec.text)
    assert parallel["type"] == "array" and parallel["minItems"] == 1
    named = plan_tools(tools, {"type": "function", "function": {"name": "a"}})
    assert named.mode == "named" and named.name == "a" and json.loads(named.spec.text)["properties"] == {"x": {"type": "integer"}}
