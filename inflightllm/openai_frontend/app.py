"""The FastAPI application of the OpenAI-compatible front end (`create_app`).

Routes: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions`. Errors are OpenAI-shaped
(`{"error": {"message", "type", "param", "code"}}`): 400 for a bad request (the message
names the field), 404 for an unknown model, 503 when the front end is at its limit of
concurrent requests, Triton's queue is full or Triton cannot be reached.

Streaming answers are server-sent events, `data: {chunk}` lines ending with
`data: [DONE]`; with `stream_options.include_usage` a last chunk with empty `choices`
carries the usage. A client that disconnects cancels its request in the engine: for a
stream, Starlette cancels the response task and the gRPC call is cancelled; otherwise a
watcher of the connection cancels the handler's generation.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from inflightllm.guided.tools import TOOL_CALL_MARKER, ToolCallStream, parse_tool_calls
from inflightllm.openai_frontend import protocol
from inflightllm.openai_frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from inflightllm.openai_frontend.triton_backend import BackendError, Piece, TritonBackend

# The ensemble is always asked to stream, also for a non-streaming OpenAI request (the
# pieces are joined here). Triton 2.51 shows a client's cancellation only to the pieces
# that reach `postprocessing`, which relays it to the engine: a non-streaming ensemble
# request has no piece until it ends, so a client who left would keep the engine busy.
ALWAYS_STREAM = True


@dataclass(frozen=True)
class ServingLimits:
    """The deployment's limits (from the `preprocessing` model's config parameters)."""

    max_output_len: int
    max_model_len: int

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> ServingLimits:
        max_input_length = int(params.get("max_input_length") or 2048)
        max_output_len = int(params.get("max_output_len") or 1024)
        return cls(
            max_output_len=max_output_len,
            max_model_len=int(params.get("max_model_len") or max_input_length + max_output_len),
        )


class _Slots:
    """A count of requests in progress with a limit (no waiting: over the limit is 503)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def take(self) -> None:
        if self.in_use >= self.limit:
            raise OpenAIError(
                503,
                f"the server is handling its limit of {self.limit} concurrent requests; retry later",
                type="server_error", code="overloaded",
            )
        self.in_use += 1

    def give(self) -> None:
        self.in_use -= 1


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


# Ensemble input names -> the OpenAI field they come from (others have the same name).
_FIELD_OF_INPUT = {"text_input": "prompt", "stop_words": "stop", "num_top_logprobs": "top_logprobs",
                   "return_log_probs": "logprobs", "sampling_parameters": "ignore_eos",
                   "guided_json": "response_format", "guided_json_object": "response_format",
                   "num_return_sequences": "n"}
_NAMED_INPUT = re.compile(r"(?:input|sampling_parameters key) '(\w+)'")
# The engine's own checks name its input first ("n: 9 is out of range; ...").
_ENGINE_NAMED_INPUT = re.compile(r"\b(n): -?\d+ is out of range")


def _from_backend(error: BackendError) -> OpenAIError:
    """Triton's error as OpenAI's; `param` is the field the server's message names."""
    if error.status != 400:
        return OpenAIError(error.status, error.message, type="server_error",
                           code="overloaded" if error.status == 503 else None)
    named = _NAMED_INPUT.search(error.message) or _ENGINE_NAMED_INPUT.search(error.message)
    param = None if named is None else _FIELD_OF_INPUT.get(named[1], named[1])
    return OpenAIError(400, error.message, param=param)


async def parse_body(request: Request, model_class):
    """The JSON body validated as `model_class` (whatever the Content-Type, as OpenAI's
    API does); raises OpenAIError (400) naming the field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OpenAIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model_class.model_validate(data)
    except ValidationError as error:
        raise _validation_error(error) from None


def _validation_error(error: ValidationError) -> OpenAIError:
    """Pydantic's first complaint as a 400 that names the field."""
    problems = error.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request", "type": ""}
    loc = list(first.get("loc", ()))
    # Union members add their type names to the path (e.g. "str", "list[str]"): drop them.
    loc = [part for part in loc if not (isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")))]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    if first.get("type") == "extra_forbidden":
        return OpenAIError(400, f"{param}: unknown field; this server does not support it", param=param)
    if first.get("type") == "missing":
        return OpenAIError(400, f"{param}: required field is missing", param=param)
    shown = json.dumps(first.get("input"), ensure_ascii=False, default=str)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return OpenAIError(400, f"{param}: {first.get('msg')} (got {shown})", param=param)


class _Generation:
    """One request's pieces folded into the OpenAI fields."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.finish_reason = ""
        self.num_input_tokens = self.num_output_tokens = self.num_cached_tokens = 0
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_values: list[list[float]] = []

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.num_input_tokens = piece.num_input_tokens
        self.num_output_tokens = piece.num_output_tokens
        self.num_cached_tokens = piece.num_cached_tokens
        self.token_ids.extend(piece.output_ids)
        self.log_probs.extend(piece.output_log_probs)
        self.top_ids.extend(piece.top_logprob_ids)
        self.top_values.extend(piece.top_logprobs)

    def usage(self) -> dict:
        return protocol.usage(self.num_input_tokens, self.num_output_tokens, self.num_cached_tokens)


class _Choices:
    """One request's pieces by choice (`sequence_index`; n > 1 gives several)."""

    def __init__(self) -> None:
        self.by_index: dict[int, _Generation] = {}

    def add(self, piece: Piece) -> None:
        self.by_index.setdefault(piece.sequence_index, _Generation()).add(piece)

    def finished(self) -> int:
        return sum(1 for generation in self.by_index.values() if generation.finish_reason)

    def items(self) -> list[tuple[int, _Generation]]:
        return sorted(self.by_index.items())

    def usage(self) -> dict:
        """The prompt once; the completion tokens of every choice."""
        generations = list(self.by_index.values()) or [_Generation()]
        first = generations[0]
        return protocol.usage(first.num_input_tokens, sum(g.num_output_tokens for g in generations),
                              first.num_cached_tokens)


class _AutoToolText:
    """The output of tool_choice auto while it streams: text that cannot begin a call goes
    out as content at once; from the first point where a call may begin (the output starts
    with `{` or `[`, or a `<tool_call>` marker starts, or the text ends with a prefix of
    one) the rest is `held` until the output ends."""

    def __init__(self) -> None:
        self.held = ""
        self.holding = False
        self.started = False  # some non-space text went out as content

    def feed(self, text: str) -> str:
        if self.holding:
            self.held += text
            return ""
        pending = self.held + text
        self.held = ""
        if not self.started:
            stripped = pending.lstrip()
            if not stripped or TOOL_CALL_MARKER.startswith(stripped[: len(TOOL_CALL_MARKER)]):
                if stripped.startswith(TOOL_CALL_MARKER):
                    self.holding = True
                self.held = pending
                return ""
            if stripped[0] in "{[":
                self.holding, self.held = True, pending
                return ""
            self.started = True
        marker = pending.find(TOOL_CALL_MARKER)
        if marker >= 0:
            self.holding, self.held = True, pending[marker:]
            return pending[:marker]
        # Keep back a tail that may be the start of a marker.
        for keep in range(min(len(TOOL_CALL_MARKER) - 1, len(pending)), 0, -1):
            if TOOL_CALL_MARKER.startswith(pending[-keep:]):
                self.held = pending[-keep:]
                return pending[:-keep]
        return pending


async def _first_disconnect(request: Request) -> None:
    """Returns when the HTTP client has gone (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(backend: TritonBackend, tokenizer, limits: ServingLimits, served_model: str = "ensemble",
               max_concurrent_requests: int = 64) -> FastAPI:
    """The application. `tokenizer` turns token ids into the token strings of log probs
    and counts chat prompts for the default `max_tokens`."""
    app = FastAPI(title="inflightllm OpenAI-compatible API")
    slots = _Slots(max_concurrent_requests)
    created = protocol.now()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, error: OpenAIError):
        return _error_response(error)

    @app.exception_handler(404)
    async def _not_found(request: Request, _error):
        return _error_response(OpenAIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def _not_allowed(request: Request, _error):
        return _error_response(OpenAIError(405, f"method {request.method} is not allowed on {request.url.path}"))

    def model_card() -> dict:
        return {"id": served_model, "object": "model", "created": created, "owned_by": "inflightllm"}

    def check_model(model: str) -> None:
        if model != served_model:
            raise OpenAIError(404, f"The model '{model}' does not exist; this server serves '{served_model}'",
                              param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if await backend.is_ready():
            return {"status": "ok"}
        raise OpenAIError(503, f"the Triton server at {backend.grpc_url} is not ready", type="server_error",
                          code="unavailable")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    # ------------------------------------------------------------------ log probs

    def completion_logprobs(ids, log_probs, top_ids, top_values, offset: int) -> dict:
        tokens = [token_text(i) for i in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": log_probs[: len(ids)],
            "top_logprobs": [
                {token_text(i): v for i, v in zip(row_ids, row_values)}
                for row_ids, row_values in zip(top_ids, top_values)
            ] if top_ids and top_ids[0] else None,
            "text_offset": offsets,
        }

    def chat_logprobs(ids, log_probs, top_ids, top_values) -> dict:
        def entry(token_id: int, value: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        content = []
        for position, token_id in enumerate(ids):
            item = entry(token_id, log_probs[position] if position < len(log_probs) else 0.0)
            row_ids = top_ids[position] if position < len(top_ids) else []
            row_values = top_values[position] if position < len(top_values) else []
            item["top_logprobs"] = [entry(i, v) for i, v in zip(row_ids, row_values)]
            content.append(item)
        return {"content": content}

    # ------------------------------------------------------------------ running

    async def collect(http_request: Request, values: dict) -> _Choices:
        """Run a non-streaming request; the client's disconnect cancels it."""
        generation = _Choices()

        async def run():
            async for piece in backend.generate(values):
                generation.add(piece)

        work = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(_first_disconnect(http_request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()  # the client went away (or we were cancelled): cancel the request
            await asyncio.wait({work, watcher})
        if work.cancelled():
            raise OpenAIError(499, "the client closed the connection")
        try:
            work.result()
        except BackendError as error:
            raise _from_backend(error) from None
        return generation

    async def open_stream(values: dict) -> tuple[Piece, AsyncIterator[Piece]]:
        """Start a streaming request and wait for its first response, so that a refused
        request is answered with an HTTP error rather than inside a 200 stream."""
        pieces = backend.generate(values)
        try:
            first = await pieces.__anext__()
        except BackendError as error:
            raise _from_backend(error) from None
        except StopAsyncIteration:
            raise OpenAIError(500, "the server finished the request without a response", type="server_error") from None
        return first, pieces

    def sse(chunk) -> str:
        return "data: " + (chunk if isinstance(chunk, str) else json.dumps(chunk, ensure_ascii=False)) + "\n\n"

    def streaming_response(first: Piece, pieces: AsyncIterator[Piece], make_chunk, include_usage: bool,
                           base: dict, num_choices: int = 1) -> StreamingResponse:
        async def events():
            generation = _Choices()
            try:
                piece = first
                while True:
                    generation.add(piece)
                    for chunk in make_chunk(piece):
                        if include_usage:
                            chunk["usage"] = None
                        yield sse(chunk)
                    if piece.finish_reason and generation.finished() >= num_choices:
                        break
                    try:
                        piece = await pieces.__anext__()
                    except StopAsyncIteration:
                        break
                if include_usage:
                    yield sse({**base, "choices": [], "usage": generation.usage()})
            except BackendError as error:
                yield sse(_from_backend(error).body())
            finally:
                await pieces.aclose()  # cancels the request if it is still running
                slots.give()
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def serve(http_request: Request, body, values: dict, respond, stream_chunks, base: dict):
        slots.take()
        handed_over = False
        try:
            if body.stream:
                first, pieces = await open_stream(values)
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                handed_over = True  # the stream gives the slot back when it ends
                return streaming_response(first, pieces, stream_chunks, include_usage, base, body.n)
            return respond(await collect(http_request, values))
        finally:
            if not handed_over:
                slots.give()

    # ------------------------------------------------------------------ completions

    @app.post("/v1/completions")
    async def completions(http_request: Request):
        body = await parse_body(http_request, CompletionRequest)
        check_model(body.model)
        protocol.check_common(body)
        prompt = protocol.completion_prompt(body)
        values = {
            "text_input": prompt,
            "max_tokens": body.max_tokens or protocol.COMPLETIONS_DEFAULT_MAX_TOKENS,
            "stream": True,  # also for stream=false: see ALWAYS_STREAM
            "exclude_input_in_output": True,
            **protocol.sampling_inputs(body),
        }
        if body.logprobs is not None:
            values["return_log_probs"] = True
            values["num_top_logprobs"] = body.logprobs
        base = {"id": protocol.new_id("cmpl"), "object": "text_completion", "created": protocol.now(),
                "model": served_model}
        offsets: dict[int, int] = {}  # text offset of each choice

        def logprobs_of(ids, log_probs, top_ids, top_values, index: int = 0):
            if body.logprobs is None:
                return None
            result = completion_logprobs(ids, log_probs, top_ids, top_values, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(token) for token in result["tokens"])
            return result

        def respond(generations: _Choices) -> dict:
            return {
                **base,
                "choices": [{
                    "index": index,
                    "text": "".join(generation.text),
                    "logprobs": logprobs_of(generation.token_ids, generation.log_probs, generation.top_ids,
                                            generation.top_values, index),
                    "finish_reason": protocol.finish_reason(generation.finish_reason),
                } for index, generation in generations.items()],
                "usage": generations.usage(),
            }

        def chunks(piece: Piece):
            if not piece.text and not piece.finish_reason and not piece.output_ids:
                return []
            return [{
                **base,
                "choices": [{
                    "index": piece.sequence_index,
                    "text": piece.text,
                    "logprobs": logprobs_of(piece.output_ids, piece.output_log_probs, piece.top_logprob_ids,
                                            piece.top_logprobs, piece.sequence_index),
                    "finish_reason": protocol.finish_reason(piece.finish_reason),
                }],
            }]

        return await serve(http_request, body, values, respond, chunks, base)

    # ------------------------------------------------------------------ chat

    def default_chat_max_tokens(messages: list[dict]) -> int:
        """As many tokens as the context leaves, up to the profile's max_output_len."""
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
        return max(1, min(limits.max_output_len, limits.max_model_len - prompt_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: Request):
        body = await parse_body(http_request, ChatCompletionRequest)
        check_model(body.model)
        protocol.check_common(body)
        messages = protocol.chat_messages(body)
        structured = protocol.structured_output(body)
        plan = structured.plan
        if (plan.mode != "none" or structured.parameters) and body.n != 1:
            raise protocol.OpenAIError(
                400, f"n: {body.n} with tools or response_format is not supported; allowed: 1 (one constrained "
                "output per request)", param="n")
        tool_names = [tool["function"]["name"] for tool in structured.tools or []]
        max_tokens = body.max_completion_tokens or body.max_tokens or default_chat_max_tokens(messages)
        values = {
            "messages": json.dumps(messages, ensure_ascii=False),
            "max_tokens": max_tokens,
            "stream": True,  # also for stream=false: see ALWAYS_STREAM
            "exclude_input_in_output": True,
            **protocol.sampling_inputs(body, structured.parameters),
        }
        if structured.tools:
            values["tools"] = json.dumps(structured.tools, ensure_ascii=False)
        if body.logprobs:
            values["return_log_probs"] = True
            values["num_top_logprobs"] = body.top_logprobs or 0
        base = {"id": protocol.new_id("chatcmpl"), "object": "chat.completion.chunk", "created": protocol.now(),
                "model": served_model}

        def logprobs_of(ids, log_probs, top_ids, top_values):
            return chat_logprobs(ids, log_probs, top_ids, top_values) if body.logprobs else None

        def tool_calls_of(text: str, reason: str) -> list[dict] | None:
            """OpenAI's tool_calls of a finished output (None: plain content)."""
            if plan.mode == "none" or reason != "stop":
                return None
            calls = parse_tool_calls(text, plan, tool_names)
            if calls is None:
                return None
            return [{"id": protocol.new_id("call"), "type": "function",
                     "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
                    for call in calls]

        def respond(generations: _Choices) -> dict:
            choices = []
            for index, generation in generations.items():
                text = "".join(generation.text)
                calls = tool_calls_of(text, generation.finish_reason)
                message = {"role": "assistant", "content": text}
                reason = protocol.finish_reason(generation.finish_reason)
                if calls:
                    message = {"role": "assistant", "content": None, "tool_calls": calls}
                    reason = "tool_calls"
                choices.append({
                    "index": index,
                    "message": message,
                    "logprobs": logprobs_of(generation.token_ids, generation.log_probs, generation.top_ids,
                                            generation.top_values),
                    "finish_reason": reason,
                })
            return {
                **base,
                "object": "chat.completion",
                "choices": choices,
                "usage": generations.usage(),
            }

        sent_role: set[int] = set()  # choices whose first chunk (with the role) went out
        named_id = protocol.new_id("call")
        call_stream = ToolCallStream(lambda: protocol.new_id("call"))  # required: calls as they grow
        auto = _AutoToolText()  # auto: content until a call may start, then held to the end

        def delta_chunk(delta: dict, reason=None, logprobs=None) -> dict:
            return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

        def call_reason(piece: Piece) -> str:
            return "tool_calls" if piece.finish_reason == "stop" else protocol.finish_reason(piece.finish_reason)

        def tool_chunks(piece: Piece) -> list[dict]:
            """Tool calls streamed as OpenAI streams them. Named: the arguments as they are
            generated (the first chunk carried the call's id and name). Required: each call's
            id and name once its name is complete, then its arguments as they grow. Auto:
            content as generated until the output may be a call (it starts as JSON, or a
            `<tool_call>` marker begins); from there it is held to the end and sent as calls
            when it parses as calls of known tools, else as content."""
            result = []
            if plan.mode == "named":
                if piece.text:
                    result.append(delta_chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece.text}}]}))
                if piece.finish_reason:
                    result.append(delta_chunk({}, call_reason(piece)))
                return result
            if plan.mode == "required":
                for delta in call_stream.feed(piece.text):
                    result.append(delta_chunk({"tool_calls": [delta]}))
                if piece.finish_reason:
                    result.append(delta_chunk({}, call_reason(piece)))
                return result
            content = auto.feed(piece.text)
            if content:
                result.append(delta_chunk({"content": content}))
            if not piece.finish_reason:
                return result
            calls = tool_calls_of(auto.held, piece.finish_reason) if auto.held else None
            if calls:
                for index, call in enumerate(calls):
                    result.append(delta_chunk({"tool_calls": [{"index": index, **call}]}))
                result.append(delta_chunk({}, "tool_calls"))
            else:
                if auto.held:
                    result.append(delta_chunk({"content": auto.held}))
                result.append(delta_chunk({}, protocol.finish_reason(piece.finish_reason)))
            return result

        def chunks(piece: Piece):
            result = []
            index = piece.sequence_index
            if index not in sent_role:  # OpenAI's first chunk of a choice carries the role
                sent_role.add(index)
                if plan.mode == "named":
                    result.append(delta_chunk({"role": "assistant", "content": None, "tool_calls": [{
                        "index": 0, "id": named_id, "type": "function",
                        "function": {"name": plan.name, "arguments": ""}}]}))
                else:
                    result.append({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
            if plan.mode != "none":  # tools: one choice (n > 1 is refused with them)
                return result + tool_chunks(piece)
            if piece.text or piece.output_ids:
                result.append({**base, "choices": [{
                    "index": index, "delta": {"content": piece.text},
                    "logprobs": logprobs_of(piece.output_ids, piece.output_log_probs, piece.top_logprob_ids,
                                            piece.top_logprobs),
                    "finish_reason": None,
                }]})
            if piece.finish_reason:
                result.append({**base, "choices": [{"index": index, "delta": {}, "logprobs": None,
                                                    "finish_reason": protocol.finish_reason(piece.finish_reason)}]})
            return result

        return await serve(http_request, body, values, respond, chunks, base)

    return app
