"""OpenAI tool calling on top of guided decoding.

`tool_choice` "required" constrains the output to a call of one of the tools (a JSON
object {"name": <one of the names>, "arguments": <that tool's parameters schema>}, or a
non-empty list of them when parallel calls are allowed); a named function constrains it
to that function's arguments alone. "auto" leaves the output free and `parse_tool_calls`
finds calls in it (a JSON call object or list, or Hermes-style <tool_call> blocks);
"none" never calls a tool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from inflightllm.guided.spec import GuidedSpec, GuidedSpecError, check_spec, json_schema_spec

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How a request with tools runs: `mode` is none, auto, required or named; `spec` the
    constraint (required, named); `name` the named function."""

    mode: str
    spec: GuidedSpec | None = None
    name: str | None = None


def parameters_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def check_tools(tools: list[dict]) -> None:
    """Each tool's parameters must be a schema guided decoding enforces; the error names
    `tools[i].function.parameters`."""
    for index, tool in enumerate(tools):
        field = f"tools[{index}].function.parameters"
        try:
            check_spec(json_schema_spec(parameters_of(tool), field))
        except GuidedSpecError as error:
            text = str(error)
            detail = text.split(": ", 1)[1] if ": " in text else text
            raise GuidedSpecError(f"{field}: {detail}") from None


def call_schema(tool: dict) -> dict:
    name = tool["function"]["name"]
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters_of(tool)},
            "required": ["name", "arguments"]}


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool = True) -> ToolPlan:
    """The plan for `tools` and `tool_choice` ("none", "auto", "required", or
    {"type": "function", "function": {"name": ...}}); default auto with tools."""
    if not tools:
        return ToolPlan("none")
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto")
    if tool_choice == "none":
        return ToolPlan("none")
    if tool_choice == "required":
        calls = [call_schema(tool) for tool in tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = one if not parallel_tool_calls else {"type": "array", "items": one, "minItems": 1}
        return ToolPlan("required", json_schema_spec(schema, "tool_choice"))
    name = tool_choice["function"]["name"]
    tool = next((tool for tool in tools if tool["function"]["name"] == name), None)
    if tool is None:
        raise GuidedSpecError(
            f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(t['function']['name'] for t in tools)})"
        )
    return ToolPlan("named", json_schema_spec(parameters_of(tool), "tool_choice"), name)


TOOL_CALL_MARKER = "<tool_call>"  # Hermes-style call blocks (auto)
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _calls_from(value) -> list[dict] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append({"name": item["name"], "arguments": arguments})
    return calls or None


def parse_tool_calls(text: str, plan: ToolPlan, tool_names: list[str]) -> list[dict] | None:
    """The calls in a finished output ({"name", "arguments"} dicts, arguments as a JSON
    value), or None when it is plain content."""
    if plan.mode == "none":
        return None
    if plan.mode == "named":
        try:
            return [{"name": plan.name, "arguments": json.loads(text)}]
        except json.JSONDecodeError:
            return None
    blocks = _TOOL_CALL_BLOCK.findall(text)
    candidates = blocks if blocks else [text.strip()]
    calls: list[dict] = []
    for candidate in candidates:
        try:
            found = _calls_from(json.loads(candidate))
        except json.JSONDecodeError:
            return None
        if found is None:
            return None
        calls.extend(found)
    if plan.mode == "auto" and any(call["name"] not in tool_names for call in calls):
        return None
    return calls or None


# --- streaming -------------------------------------------------------------------------------

_SCALAR_END = frozenset(",}] \t\n\r")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def _string_end(text: str, at: int) -> int | None:
    """The index after the JSON string starting at `at` (a quote), None while it is open."""
    at += 1
    while at < len(text):
        if text[at] == "\\":
            at += 2
            continue
        if text[at] == '"':
            return at + 1
        at += 1
    return None


def _value_end(text: str, at: int) -> int | None:
    """The index after the JSON value starting at `at`, None while it is incomplete (a
    number or literal is complete only once a delimiter follows it)."""
    if at >= len(text):
        return None
    if text[at] == '"':
        return _string_end(text, at)
    if text[at] not in "{[":
        while at < len(text) and text[at] not in _SCALAR_END:
            at += 1
        return at if at < len(text) else None
    depth = 0
    while at < len(text):
        char = text[at]
        if char == '"':
            end = _string_end(text, at)
            if end is None:
                return None
            at = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    return None


@dataclass
class _CallSpan:
    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None  # None: still being generated (up to the text's end)
    sent_header: bool = False
    sent_arguments: int = 0  # characters of the arguments already sent


class ToolCallStream:
    """Turns the growing output of a `required` tool choice (a call object
    {"name": ..., "arguments": ...}, or a list of them) into OpenAI's streamed tool-call
    deltas: for each call, first {"index", "id", "type": "function", "function": {"name",
    "arguments": ""}} once its name is complete, then {"index", "function": {"arguments":
    <fragment>}} as the arguments' text grows. The fragments concatenate to the arguments
    exactly as generated (compact JSON: the grammar allows no free whitespace).

    The output is re-scanned from its start at each feed: it is at most a few thousand
    characters, and re-scanning keeps no half-parsed state to get wrong."""

    def __init__(self, new_id):
        self.new_id = new_id
        self.text = ""
        self.calls: list[_CallSpan] = []

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        for index, span in enumerate(self._scan()):
            if index == len(self.calls):
                self.calls.append(span)
            else:
                call = self.calls[index]
                call.name, call.arguments_start, call.arguments_end = span.name, span.arguments_start, span.arguments_end
        deltas = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                break
            if not call.sent_header:
                call.sent_header = True
                deltas.append({"index": index, "id": self.new_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            if call.arguments_start is None:
                continue
            end = call.arguments_end if call.arguments_end is not None else len(self.text)
            fragment = self.text[call.arguments_start + call.sent_arguments:end]
            if fragment:
                call.sent_arguments += len(fragment)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas

    def _scan(self) -> list[_CallSpan]:
        text = self.text
        spans: list[_CallSpan] = []
        at = _skip_space(text, 0)
        if at < len(text) and text[at] == "[":
            at += 1
        while True:
            at = _skip_space(text, at)
            while at < len(text) and text[at] in ", \t\n\r":
                at += 1
            if at >= len(text) or text[at] != "{":
                return spans
            span = _CallSpan()
            spans.append(span)
            at += 1
            while True:  # the call object's members
                at = _skip_space(text, at)
                if at < len(text) and text[at] == ",":
                    at = _skip_space(text, at + 1)
                if at >= len(text):
                    return spans
                if text[at] == "}":
                    at += 1
                    break
                if text[at] != '"':
                    return spans  # not a call object: nothing more can be streamed
                key_end = _string_end(text, at)
                if key_end is None:
                    return spans
                key = json.loads(text[at:key_end])
                at = _skip_space(text, key_end)
                if at >= len(text) or text[at] != ":":
                    return spans
                at = _skip_space(text, at + 1)
                if at >= len(text):
                    return spans
                end = _value_end(text, at)
                if key in ("arguments", "parameters"):
                    span.arguments_start, span.arguments_end = at, end
                elif key == "name" and end is not None:
                    try:
                        name = json.loads(text[at:end])
                    except json.JSONDecodeError:
                        return spans
                    span.name = name if isinstance(name, str) else None
                if end is None:
                    return spans
                at = end
