"""OpenAI request bodies, their mapping to ensemble inputs, and the response bodies.

The request models forbid unknown fields: a field the front end would not act on is an
error that names it, never silently dropped. Beside OpenAI's own fields, the vLLM-style
extras `top_k`, `min_p`, `repetition_penalty`, `min_tokens` and `ignore_eos` are accepted
(load generators send them). Ranges are checked by the server's `preprocessing`, whose
message names the input (the same names as here).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from inflightllm.guided.spec import GuidedSpecError, check_spec, json_schema_spec
from inflightllm.guided.tools import ToolPlan, check_tools, plan_tools

# OpenAI's default for /v1/completions when max_tokens is not given.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's default temperature (the ensemble's own default is greedy).
OPENAI_DEFAULT_TEMPERATURE = 1.0
MAX_TOP_LOGPROBS = 20


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system" and is sent as "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn of tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an earlier assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (constrained decoding)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the parameters schema is always enforced when a call is required


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# Integers travel as INT32 tensors: larger ones are refused here, not wrapped.
INT32_MAX = 2**31 - 1
NonNegativeInt = Annotated[int, Field(ge=0, le=INT32_MAX)]
PositiveInt = Annotated[int, Field(ge=1, le=INT32_MAX)]


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: PositiveInt = 1  # choices; the profile's engine.max_n bounds it (the engine names it)
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**64)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Identifies the end user for abuse monitoring at OpenAI; it does not change the output.
    user: str | None = None
    # vLLM-style extras.
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str]
    max_tokens: PositiveInt | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Structured output and tool calling (docs/STRUCTURED-OUTPUT.md).
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def check_common(request: _SamplingFields) -> None:
    """Checks the types alone cannot express; raises OpenAIError (400) naming the field."""
    if request.stream_options is not None and not request.stream:
        raise OpenAIError(400, "stream_options: allowed only with stream=true", param="stream_options")
    if isinstance(request.stop, list) and any(word == "" for word in request.stop):
        raise OpenAIError(400, 'stop: "" is an empty string; allowed: non-empty strings', param="stop")
    if request.stop == "":
        raise OpenAIError(400, 'stop: "" is an empty string; allowed: non-empty strings', param="stop")


def completion_prompt(request: CompletionRequest) -> str:
    if request.echo:
        raise OpenAIError(400, "echo: true is not supported; allowed: false", param="echo")
    if isinstance(request.prompt, list):
        if len(request.prompt) != 1:
            raise OpenAIError(
                400, f"prompt: a list of {len(request.prompt)} prompts; allowed: one prompt per request",
                param="prompt",
            )
        return request.prompt[0]
    return request.prompt


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages as the ensemble's `messages` input takes them."""
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(400, "top_logprobs: allowed only with logprobs=true", param="top_logprobs")
    if request.max_tokens is not None and request.max_completion_tokens is not None \
            and request.max_tokens != request.max_completion_tokens:
        raise OpenAIError(
            400, "max_tokens and max_completion_tokens differ; give one of them", param="max_completion_tokens"
        )
    messages = []
    for index, message in enumerate(request.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise OpenAIError(400, f"messages[{index}].content: required field is missing",
                              param=f"messages[{index}].content")
        item = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        messages.append(item)
    return messages


@dataclass
class StructuredOutput:
    """What response_format and tools add to a chat request: sampling_parameters keys
    (the guided_* constraint), the `tools` input for the chat template, the tool plan."""

    parameters: dict
    tools: list[dict] | None
    plan: ToolPlan


def structured_output(request: ChatCompletionRequest) -> StructuredOutput:
    """response_format and tools/tool_choice checked and turned into a constraint; raises
    OpenAIError (400) naming the field: a bad schema, a tool whose parameters schema is bad
    or uses a keyword guided decoding cannot enforce, a tool_choice naming no tool."""
    parameters: dict = {}
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        parameters["guided_json_object"] = True
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise OpenAIError(400, "response_format.json_schema.schema: required for type json_schema",
                              param="response_format.json_schema.schema")
        field = "response_format.json_schema.schema"
        try:
            spec = json_schema_spec(fmt.json_schema.schema_, field)
            check_spec(spec)
        except GuidedSpecError as error:
            raise OpenAIError(400, f"{field}: {_detail(error)}", param=field) from None
        parameters["guided_json"] = json.loads(spec.text)
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    if request.tool_choice is not None and request.tool_choice != "none" and not tools:
        raise OpenAIError(400, "tool_choice: allowed only with tools", param="tool_choice")
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump()
    try:
        if tools:
            check_tools(tools)
        plan = plan_tools(tools, choice, request.parallel_tool_calls is not False)
    except GuidedSpecError as error:
        text = str(error)
        param = text.split(":", 1)[0]
        raise OpenAIError(400, text, param=param) from None
    if plan.spec is not None:
        if parameters:
            raise OpenAIError(400, "response_format: not allowed with tool_choice required or a named function "
                                   "(the tool call's schema constrains the output)", param="response_format")
        parameters["guided_json"] = json.loads(plan.spec.text)
    return StructuredOutput(parameters, tools if plan.mode != "none" else None, plan)


def _detail(error: Exception) -> str:
    text = str(error)
    return text.split(": ", 1)[1] if ": " in text else text


def sampling_inputs(request: _SamplingFields, parameters: dict | None = None) -> dict:
    """Ensemble inputs (name -> value) of the fields shared by both endpoints; fields not
    given are left out, so the server's defaults apply (temperature: OpenAI's 1.0).
    `parameters`: more sampling_parameters keys (structured output)."""
    inputs: dict = {
        "temperature": OPENAI_DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
    }
    for name in ("top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens"):
        value = getattr(request, name)
        if value is not None:
            inputs[name] = value
    if inputs.get("top_k") == -1:
        inputs["top_k"] = 0  # vLLM's "off"
    if request.stop is not None:
        inputs["stop_words"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    parameters = dict(parameters or {})
    if request.ignore_eos is not None:
        parameters["ignore_eos"] = request.ignore_eos
    if parameters:
        inputs["sampling_parameters"] = json.dumps(parameters, ensure_ascii=False)
    if request.n != 1:  # several choices: each sampled on its own (docs/SEQUENCE-GROUPS.md)
        inputs["num_return_sequences"] = request.n
    return inputs


# ----------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(num_input_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_input_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_input_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def finish_reason(reason: str) -> str | None:
    """The ensemble's finish_reason as OpenAI's: "" (not finished) -> None."""
    return reason or None
