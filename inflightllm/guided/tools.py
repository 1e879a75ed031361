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
