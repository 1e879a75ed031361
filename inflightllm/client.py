"""A gRPC streaming client for the `ensemble` (library function and command line).

    python -m inflightllm.client "Once upon a time" --max-tokens 32
    python -m inflightllm.client --chat "What is the capital of France?"

The text is printed as it arrives; one stats line goes to stderr at the end (time to
first token, output tokens, decode and overall tokens/s, finish reason). Exit status:
0 done, 1 the server rejected the request (its message is printed), 2 the server cannot
be reached, 3 no answer within `--timeout`, 130 interrupted.

The engine is decoupled, so every request goes over the gRPC *stream* API, also with
`--no-stream` (then `stream=false` and the server sends exactly one response).
`stream_generate()` is the reusable part (the demo and the tests call it).
Request names and types: docs/INTERFACE.md; usage: docs/CLIENTS.md.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_URL = "127.0.0.1:8001"
DEFAULT_MODEL = "ensemble"
DEFAULT_MAX_TOKENS = 128

# Optional scalar inputs of the ensemble (docs/INTERFACE.md) -> Triton data type.
SCALAR_INPUT_TYPES = {
    "temperature": "FP32",
    "top_k": "INT32",
    "top_p": "FP32",
    "min_p": "FP32",
    "repetition_penalty": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    "min_tokens": "INT32",
    "seed": "UINT64",
    "end_id": "INT32",
    "priority": "INT32",
    "num_top_logprobs": "INT32",
    "return_log_probs": "BOOL",
}
_NUMPY_TYPES = {
    "BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64,
    "FP32": np.float32,
}

# gRPC status codes that mean "no server there" rather than "the server said no".
_UNREACHABLE_STATUSES = ("StatusCode.UNAVAILABLE",)


class ClientError(Exception):
    """A request that did not produce an answer; `exit_status` is the CLI's exit code."""

    exit_status = 1


class RequestRejectedError(ClientError):
    """The server answered with an error (e.g. an input out of range); the message is the server's."""

    exit_status = 1


class ServerUnavailableError(ClientError):
    """No server answers at the URL (or the connection broke)."""

    exit_status = 2


class GenerationTimeoutError(ClientError):
    """The request did not finish within the timeout (it was cancelled)."""

    exit_status = 3


@dataclass
class GenerationStats:
    """What one request produced and how fast.

    Times are seconds from sending the request. `first_token_s` is the time of the first
    response that carried output tokens (the time to first token); `first_token_count` is
    how many tokens that response carried, so the decode rate counts only the tokens after it.
    """

    text: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_responses: int
    first_token_s: float | None
    first_token_count: int
    total_s: float

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s * 1000.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first response divided by the time after it (None if undefined)."""
        if self.first_token_s is None:
            return None
        tokens = self.num_output_tokens - self.first_token_count
        elapsed = self.total_s - self.first_token_s
        if tokens <= 0 or elapsed <= 0:
            return None
        return tokens / elapsed

    @property
    def overall_tokens_per_s(self) -> float | None:
        """All output tokens divided by the whole request time."""
        if self.total_s <= 0 or self.num_output_tokens <= 0:
            return None
        return self.num_output_tokens / self.total_s

    def summary_line(self) -> str:
        """One human-readable line: TTFT, tokens, tokens/s, finish reason."""

        def rate(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.1f} tok/s"

        ttft = "n/a" if self.ttft_ms is None else f"{self.ttft_ms:.1f} ms"
        return (
            f"[stats] TTFT {ttft} | output tokens {self.num_output_tokens}"
            f" (input {self.num_input_tokens}, cached {self.num_cached_tokens})"
            f" | decode {rate(self.decode_tokens_per_s)} | overall {rate(self.overall_tokens_per_s)}"
            f" | total {self.total_s * 1000.0:.1f} ms | finish_reason {self.finish_reason or 'n/a'}"
        )


def infer_input(name: str, datatype: str, values: Sequence):
    """One input with the batch dimension: shape [1, len(values)] (str values are
    UTF-8 encoded). Serves the sync and the asyncio gRPC clients alike."""
    import tritonclient.grpc as grpcclient

    row = [value.encode("utf-8") if isinstance(value, str) else value for value in values]
    array = np.array([row], dtype=_NUMPY_TYPES[datatype])  # [1, len(values)]
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """A chat with an optional system turn and one user turn."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    return messages


def build_inputs(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stream: bool = True,
    stop: Sequence[str] = (),
    exclude_input_in_output: bool = True,
    **parameters,
) -> list:
    """The ensemble's input tensors for one request.

    Give `prompt` (sent as `text_input`) or `messages` (sent as the JSON `messages`).
    `parameters` are optional scalar inputs by name (`SCALAR_INPUT_TYPES`); None values
    are left out, so the server's defaults apply. `exclude_input_in_output` defaults to
    True here so that a non-streaming answer does not start with the prompt.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    inputs = []
    if messages is not None:
        inputs.append(infer_input("messages", "BYTES", [json.dumps(messages, ensure_ascii=False)]))
    else:
        inputs.append(infer_input("text_input", "BYTES", [prompt]))
    inputs.append(infer_input("max_tokens", "INT32", [max_tokens]))
    inputs.append(infer_input("stream", "BOOL", [stream]))
    inputs.append(infer_input("exclude_input_in_output", "BOOL", [exclude_input_in_output]))
    if stop:
        inputs.append(infer_input("stop_words", "BYTES", list(stop)))
    for name, value in parameters.items():
        if name not in SCALAR_INPUT_TYPES:
            raise ValueError(f"unknown input {name!r}; known: {', '.join(SCALAR_INPUT_TYPES)}")
        if value is not None:
            inputs.append(infer_input(name, SCALAR_INPUT_TYPES[name], [value]))
    return inputs


def _scalar(result, name: str, default=None):
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return default
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _is_final(result) -> bool:
    parameter = result.get_response().parameters.get("triton_final_response")
    return parameter is not None and parameter.bool_param


def _error_from(error, url: str) -> ClientError:
    status = error.status() if hasattr(error, "status") else None
    message = error.message() if hasattr(error, "message") else str(error)
    if status in _UNREACHABLE_STATUSES:
        return ServerUnavailableError(f"cannot reach the server at {url} (gRPC): {message}")
    if status == "StatusCode.DEADLINE_EXCEEDED":
        return GenerationTimeoutError(f"no answer from {url} in time: {message}")
    return RequestRejectedError(message)


def stream_generate(
    url: str = DEFAULT_URL,
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stream: bool = True,
    model: str = DEFAULT_MODEL,
    timeout: float | None = None,
    on_text: Callable[[str], None] | None = None,
    stop: Sequence[str] = (),
    exclude_input_in_output: bool = True,
    **parameters,
) -> GenerationStats:
    """Send one request over a gRPC stream and return its text and timings.

    `on_text(piece)` is called with each non-empty piece of text as it arrives (with
    `stream=False` there is one). Raises `ServerUnavailableError` when nothing answers at
    `url`, `RequestRejectedError` with the server's message when it rejects the request,
    `GenerationTimeoutError` (after cancelling the request) when `timeout` seconds pass.
    Other keyword arguments are optional inputs (`SCALAR_INPUT_TYPES`), e.g. `temperature`.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inputs = build_inputs(
        prompt,
        messages=messages,
        max_tokens=max_tokens,
        stream=stream,
        stop=stop,
        exclude_input_in_output=exclude_input_in_output,
        **parameters,
    )
    try:
        client = grpcclient.InferenceServerClient(url)
    except InferenceServerException as error:  # e.g. a malformed URL
        raise ServerUnavailableError(f"cannot reach the server at {url} (gRPC): {error.message()}") from None
    try:
        # A cheap call first: a wrong URL then fails at once with a clear message instead
        # of surfacing as an error on the stream.
        try:
            client.is_server_live(client_timeout=10.0 if timeout is None else min(timeout, 10.0))
        except InferenceServerException as error:
            raise ServerUnavailableError(
                f"cannot reach the server at {url} (gRPC): {error.message()}"
            ) from None
        events: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: events.put((time.monotonic(), result, error)))
        finished = False
        try:
            start = time.monotonic()
            deadline = None if timeout is None else start + timeout
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
            stats = _collect(events, start, deadline, on_text, url, timeout)
            finished = True
            return stats
        finally:
            # A finished request closes the stream gracefully; otherwise (timeout, Ctrl-C)
            # the request is cancelled, so the engine stops it and frees its KV blocks.
            client.stop_stream(cancel_requests=not finished)
    finally:
        client.close()


def _collect(events: queue.Queue, start: float, deadline, on_text, url: str, timeout) -> GenerationStats:
    pieces: list[str] = []
    finish_reason = ""
    num_input_tokens = num_output_tokens = num_cached_tokens = 0
    num_responses = 0
    first_token_s: float | None = None
    first_token_count = 0
    last_s = 0.0
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise GenerationTimeoutError(f"no complete answer from {url} within {timeout:g} s (request cancelled)")
        try:
            arrived, result, error = events.get(timeout=remaining)
        except queue.Empty:
            continue  # the deadline check above raises
        if error is not None:
            raise _error_from(error, url)
        response = result.get_response()
        if response.outputs:  # the empty final response carries no tensors
            num_responses += 1
            last_s = arrived - start
            text = _scalar(result, "text_output", b"")
            if text:
                pieces.append(text)
                if on_text is not None:
                    on_text(text)
            num_output_tokens = _scalar(result, "num_output_tokens", num_output_tokens)
            num_input_tokens = _scalar(result, "num_input_tokens", num_input_tokens)
            num_cached_tokens = _scalar(result, "num_cached_tokens", num_cached_tokens)
            finish_reason = _scalar(result, "finish_reason", "") or finish_reason
            if first_token_s is None and num_output_tokens > 0:
                first_token_s = last_s
                first_token_count = num_output_tokens
        if _is_final(result):
            break
    if num_responses == 0:
        raise RequestRejectedError(
            "the server finished the request without a response (a required input such as max_tokens missing?)"
        )
    return GenerationStats(
        text="".join(pieces),
        finish_reason=finish_reason,
        num_input_tokens=num_input_tokens,
        num_output_tokens=num_output_tokens,
        num_cached_tokens=num_cached_tokens,
        num_responses=num_responses,
        first_token_s=first_token_s,
        first_token_count=first_token_count,
        total_s=last_s,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m inflightllm.client",
        description="Send one prompt to the ensemble over gRPC and print the answer as it streams.",
        epilog="Exit status: 0 ok, 1 request rejected by the server, 2 server unreachable, 3 timeout.",
    )
    parser.add_argument("prompt", help="the prompt (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true", help="send as `messages` (one user turn; the chat template applies)")
    parser.add_argument("--system", metavar="TEXT", help="a system message (with --chat)")
    parser.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, help="0 = greedy (the server's default)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--presence-penalty", type=float)
    parser.add_argument("--frequency-penalty", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", metavar="WORD", action="append", default=[], help="stop sequence (repeatable)")
    parser.add_argument("--no-stream", action="store_true", help="stream=false: one response with the whole text")
    parser.add_argument("--url", default=DEFAULT_URL, help="gRPC host:port (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="default: %(default)s")
    parser.add_argument("--timeout", type=float, help="seconds before the request is cancelled (default: none)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        parser.error("--seed must be in 0 .. 2**64-1")

    printed: list[str] = []

    def write(piece: str) -> None:
        printed.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    prompt_kwargs = (
        {"messages": chat_messages(args.prompt, args.system)} if args.chat else {"prompt": args.prompt}
    )
    try:
        stats = stream_generate(
            args.url,
            **prompt_kwargs,
            max_tokens=args.max_tokens,
            stream=not args.no_stream,
            model=args.model,
            timeout=args.timeout,
            on_text=write,
            stop=args.stop,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            seed=args.seed,
        )
    except ClientError as error:
        if printed:  # end the partial answer's line before the message
            sys.stdout.write("\n")
            sys.stdout.flush()
        print(f"error: {error}", file=sys.stderr)
        return error.exit_status
    except KeyboardInterrupt:  # stream_generate cancelled the request on the way out
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("interrupted", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats.summary_line(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
