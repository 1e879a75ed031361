"""The front end's link to Triton: one asyncio gRPC stream per request.

`TritonBackend.generate(values)` sends one ensemble request over
`tritonclient.grpc.aio`'s bidirectional stream and yields each response as a `Piece`.
Closing the generator before the final response (the HTTP client went away, or the
handler was cancelled) cancels the gRPC call, which cancels the request in Triton; the
`postprocessing` model relays that to the engine, which frees the request's KV blocks
(docs/INTERFACE.md, "Cancellation through the ensemble").
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from inflightllm.client import infer_input

# The ensemble inputs the front end sends -> Triton data type (docs/INTERFACE.md).
INPUT_TYPES = {
    "text_input": "BYTES",
    "messages": "BYTES",
    "max_tokens": "INT32",
    "stream": "BOOL",
    "exclude_input_in_output": "BOOL",
    "temperature": "FP32",
    "top_p": "FP32",
    "top_k": "INT32",
    "min_p": "FP32",
    "repetition_penalty": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    "min_tokens": "INT32",
    "seed": "UINT64",
    "stop_words": "BYTES",
    "return_log_probs": "BOOL",
    "num_top_logprobs": "INT32",
    "sampling_parameters": "BYTES",
    "tools": "BYTES",
    "num_return_sequences": "INT32",
}

# Substrings of Triton's messages that mean "too busy, retry" (HTTP 503).
_OVERLOAD_MARKERS = ("Exceeds maximum queue size", "exceeds the maximum queue size", "queue is full")
# Messages of the models' own failures (HTTP 500), not of a bad request.
_INTERNAL_MARKERS = ("preprocessing failed", "postprocessing failed", "engine failed")


class BackendError(Exception):
    """Triton refused or failed a request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def classify_error(message: str) -> BackendError:
    """A Triton error message -> the HTTP status it deserves: 503 for a full queue,
    500 for a model's own failure, else 400 (the models name the bad input)."""
    if any(marker in message for marker in _OVERLOAD_MARKERS):
        return BackendError(503, message)
    if any(marker in message for marker in _INTERNAL_MARKERS):
        return BackendError(500, message)
    return BackendError(400, message)


@dataclass
class Piece:
    """One ensemble response."""

    text: str
    finish_reason: str  # "" until the last response
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    output_log_probs: list[float] = field(default_factory=list)
    top_logprob_ids: list[list[int]] = field(default_factory=list)  # [tokens in this piece][n]
    top_logprobs: list[list[float]] = field(default_factory=list)
    sequence_index: int = 0  # which choice (n > 1)


def _scalar(result, name: str, default):
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return default
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _piece(result) -> Piece:
    ids = result.as_numpy("output_ids")
    log_probs = result.as_numpy("output_log_probs")
    top_ids = result.as_numpy("top_logprob_ids")
    top_values = result.as_numpy("top_logprobs")
    num_ids = 0 if ids is None else ids.size
    width = 0 if top_ids is None or top_ids.ndim < 1 or top_ids.size == 0 else top_ids.shape[-1]
    return Piece(
        text=_scalar(result, "text_output", ""),
        finish_reason=_scalar(result, "finish_reason", ""),
        num_input_tokens=int(_scalar(result, "num_input_tokens", 0)),
        num_output_tokens=int(_scalar(result, "num_output_tokens", 0)),
        num_cached_tokens=int(_scalar(result, "num_cached_tokens", 0)),
        output_ids=[] if ids is None else ids.reshape(-1).tolist(),
        output_log_probs=[] if log_probs is None else log_probs.reshape(-1).tolist(),
        top_logprob_ids=np.asarray(top_ids).reshape(-1, width).tolist() if width else [[] for _ in range(num_ids)],
        top_logprobs=np.asarray(top_values).reshape(-1, width).tolist() if width else [[] for _ in range(num_ids)],
        sequence_index=int(_scalar(result, "sequence_index", 0)),
    )


def _is_final(result) -> bool:
    parameter = result.get_response().parameters.get("triton_final_response")
    return parameter is not None and parameter.bool_param


class TritonBackend:
    """An asyncio gRPC client of one Triton server's ensemble."""

    def __init__(self, grpc_url: str, model: str = "ensemble") -> None:
        self.grpc_url = grpc_url
        self.model = model
        self._client = grpcclient_aio.InferenceServerClient(grpc_url)
        self._request_ids = itertools.count()

    async def close(self) -> None:
        await self._client.close()

    async def is_ready(self) -> bool:
        """True when the server and the ensemble are ready."""
        try:
            return bool(await self._client.is_server_ready(client_timeout=5)) and bool(
                await self._client.is_model_ready(self.model, client_timeout=5)
            )
        except InferenceServerException:
            return False

    async def model_parameters(self, model: str) -> dict[str, str]:
        """A model's config `parameters` (string values)."""
        config = await self._client.get_model_config(model, as_json=True, client_timeout=10)
        parameters = config["config"].get("parameters", {})
        return {key: value.get("string_value", "") for key, value in parameters.items()}

    async def generate(self, values: dict) -> AsyncIterator[Piece]:
        """Send one request (`values`: ensemble input name -> value, a list for
        `stop_words`) and yield its responses; the last has a finish_reason. Raises
        BackendError when Triton refuses it or cannot be reached."""
        inputs = [infer_input(name, INPUT_TYPES[name], value if isinstance(value, list) else [value])
                  for name, value in values.items()]
        answered = asyncio.Event()

        async def requests():
            yield {
                "model_name": self.model,
                "inputs": inputs,
                "request_id": str(next(self._request_ids)),
                "parameters": {"triton_enable_empty_final_response": True},
            }
            # Keep our side of the stream open until the last response: a half-closed
            # stream is how a finished client says goodbye.
            await answered.wait()

        stream = self._client.stream_infer(requests())
        finished = False
        try:
            async for result, error in stream:
                if error is not None:
                    finished = True  # an error response is the request's last
                    raise classify_error(error.message())
                if result.get_response().outputs:  # the empty final response carries none
                    yield _piece(result)
                if _is_final(result):
                    finished = True
                    return
            finished = True
            raise BackendError(503, f"the Triton server at {self.grpc_url} closed the stream before the last response")
        except grpc.aio.AioRpcError as error:
            finished = True
            raise BackendError(503, f"the Triton server at {self.grpc_url} is unavailable: {error.details()}") from None
        finally:
            if not finished:
                stream.cancel()  # the HTTP client went away: cancel the request in Triton
            answered.set()
