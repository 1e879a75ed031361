"""A small gRPC streaming client for the ensemble, for the server tests.

Sends many requests concurrently over one or more streams and collects each request's
responses in order (docs/INTERFACE.md names and types).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from tools.render_configs import ENSEMBLE_INPUTS

_NUMPY_TYPES = {"BYTES": object, "BOOL": bool, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32}
# Ensemble input name -> (Triton type, NumPy dtype), from the renderer's table.
INPUT_TYPES = {
    tensor.name: (datatype, _NUMPY_TYPES[datatype])
    for tensor in ENSEMBLE_INPUTS
    for datatype in [tensor.data_type.removeprefix("TYPE_").replace("STRING", "BYTES")]
}


def make_inputs(request: dict) -> list[grpcclient.InferInput]:
    """`{"text_input": "hi", "max_tokens": 8, "stop_words": ["a", "b"], "messages": [...]}`
    -> InferInputs with the batch dimension of 1."""
    inputs = []
    for name, value in request.items():
        triton_type, np_type = INPUT_TYPES[name]
        if name == "messages" and not isinstance(value, str):
            value = json.dumps(value)
        if name == "sampling_parameters" and not isinstance(value, str):
            value = json.dumps(value)
        values = value if isinstance(value, list) else [value]
        if np_type is object:
            array = np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in values]], dtype=object)
        else:
            array = np.array([values], dtype=np_type)
        tensor = grpcclient.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@dataclass
class StreamResult:
    pieces: list[str] = field(default_factory=list)
    finish_reason: str = ""
    error: str | None = None
    responses: list = field(default_factory=list)  # the raw InferResult objects
    first_piece_time: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def last(self, name: str):
        return self.responses[-1].as_numpy(name)


def run_stream_requests(url: str, requests: list[dict], num_streams: int = 1, timeout: float = 300.0,
                        model: str = "ensemble") -> list[StreamResult]:
    """Send all requests at once (spread over `num_streams` gRPC streams) and wait for every
    final response or error. Results come back in request order."""
    results = [StreamResult() for _ in requests]
    done = threading.Semaphore(0)
    clients = []
    open_requests: list[set[int]] = [set() for _ in range(num_streams)]
    lock = threading.Lock()
    stopping = threading.Event()  # set before the streams are cancelled below
    for stream_index in range(num_streams):
        client = grpcclient.InferenceServerClient(url)

        def callback(result=None, error=None, _stream=stream_index):
            if error is not None and stopping.is_set():
                return  # our own cancellation of the stream, after every answer (below)
            if error is not None:
                # tritonclient drops the request id of an error response: attribute it to
                # the stream's only open request (send error-prone requests one per stream).
                with lock:
                    if len(open_requests[_stream]) != 1:
                        raise RuntimeError(f"cannot attribute a stream error: {error}")
                    index = open_requests[_stream].pop()
                results[index].error = str(error)
                done.release()
                return
            response = result.get_response()
            index = int(response.id)
            item = results[index]
            item.responses.append(result)
            text = result.as_numpy("text_output")
            if text is not None:
                item.pieces.append(text.reshape(-1)[0].decode("utf-8"))
                if item.first_piece_time is None:
                    item.first_piece_time = time.monotonic()
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason.reshape(-1)[0]:
                item.finish_reason = reason.reshape(-1)[0].decode()
            if response.parameters["triton_final_response"].bool_param:
                with lock:
                    open_requests[_stream].discard(index)
                done.release()

        client.start_stream(callback=callback)
        clients.append(client)
    try:
        for index, request in enumerate(requests):
            with lock:
                open_requests[index % num_streams].add(index)
            clients[index % num_streams].async_stream_infer(
                model, make_inputs(request), request_id=str(index), enable_empty_final_response=True
            )
        deadline = time.monotonic() + timeout
        for _ in requests:
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"not every request finished within {timeout} s")
    finally:
        # Every request has its final response or error, or the wait timed out: cancel the
        # streams rather than wait for the server to close them (after a timeout, a request
        # still queued or running would hold its stream open until it ends).
        stopping.set()
        for client in clients:
            client.stop_stream(cancel_requests=True)
            client.close()
    return results


def cancel_after_pieces(url: str, request: dict, pieces: int = 3, before_cancel=None, timeout: float = 60.0) -> list:
    """Stream `request` to the ensemble and cancel the stream (`stop_stream(cancel_requests=True)`)
    once `pieces` responses arrived, after `before_cancel()` where given; returns the responses
    received up to the cancellation."""
    received = []
    got_some = threading.Event()

    def callback(result=None, error=None):
        if result is not None:
            received.append(result)
            if len(received) >= pieces:
                got_some.set()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("ensemble", make_inputs(request), request_id="cancel-me")
        assert got_some.wait(timeout), "no tokens arrived"
        if before_cancel is not None:
            before_cancel()
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return received


def run_one(url: str, request: dict, timeout: float = 120.0) -> StreamResult:
    return run_stream_requests(url, [request], timeout=timeout)[0]


def scrape_metrics(metrics_url: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} for the inflightllm_* series."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("inflightllm_"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels) -> float:
    """The value of one series; labels given must all match (others ignored)."""
    for key, value in values.items():
        series, _, label_text = key.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return value
    raise KeyError(f"no series {name} with {labels}")


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


__all__ = [
    "StreamResult",
    "make_inputs",
    "metric",
    "queue",
    "run_one",
    "run_stream_requests",
    "scrape_metrics",
    "wait_for",
]
