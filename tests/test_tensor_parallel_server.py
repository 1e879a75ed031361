"""Tensor parallelism through the real server, on CPU (gloo): the tiny fp32 profile
`tiny-llama3-tp2-cpu` (rank 0 in the engine model's stub, rank 1 a worker process).

- Greedy token ids through the ensemble equal the single-rank engine's on the same weights.
- Killing the worker mid-stream gives every in-flight request an error that names the
  worker, later requests a clear "engine not ready" error (and inflightllm_engine_ready 0),
  and the server then shuts down cleanly (no SIGKILL needed), leaving no worker behind.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from inflightllm.engine import Engine
from inflightllm.llm import LLM
from inflightllm.profile import load_profile
from inflightllm.sampling_params import SamplingParams
from tests.conftest import start_triton_server
from tests.ensemble_client import make_inputs, metric, run_stream_requests, scrape_metrics, wait_for
from tools.render_configs import render

pytestmark = [pytest.mark.server]

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILE = REPO_ROOT / "profiles" / "tiny-llama3-tp2-cpu.yaml"
TEXTS = ["The capital of France is", "Once upon a time", "import numpy as np\n", "Dear diary, today I"]
MAX_TOKENS = [12, 20, 8, 16]
WORKER_MODULE = "inflightllm.parallel.worker"


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def worker_pids(server_pid: int) -> list[int]:
    """Tensor-parallel worker processes started under this server (and nobody else's)."""
    pids, frontier = [], [server_pid]
    while frontier:
        pid = frontier.pop()
        for child in _children(pid):
            frontier.append(child)
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if WORKER_MODULE in cmdline:
                pids.append(child)
    return pids


def assert_stops_without_hanging(server) -> None:
    """SIGTERM; the engine model unloads (its workers stopped) and the server exits by
    itself: within its --exit-timeout-secs=30 at most, so no SIGKILL is needed. (On a busy
    machine the tokenizer models alone can take most of those 30 s to unload: the bound
    given to stop() is wider than the server's own, and the engine's unload is checked in
    the log.)"""
    status = server.stop(timeout=90)
    assert status is not None and status != -signal.SIGKILL, f"tritonserver needed SIGKILL (status {status})"
    assert "successfully unloaded 'engine'" in server.log_text(), server.log_text()[-3000:]


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repo-tp2")
    profile = load_profile(PROFILE)
    render(profile, repository)
    server = start_triton_server(repository, timeout=600.0)
    yield server, profile
    server.stop()


def test_tp2_through_the_server_equals_tp1(tp_server, smollm2_tokenizer):
    server, profile = tp_server
    results = run_stream_requests(
        server.grpc_url,
        [
            {"text_input": text, "max_tokens": n, "stream": False, "exclude_input_in_output": True}
            for text, n in zip(TEXTS, MAX_TOKENS)
        ],
        num_streams=len(TEXTS),
    )
    served = [r.last("output_ids").reshape(-1).tolist() for r in results]
    assert all(r.error is None for r in results), [r.error for r in results]
    # The same model on one rank, in process.
    single = Engine(profile.model, dataclasses.replace(profile.engine, tensor_parallel_size=1), sampler_seed=0)
    prompts = [smollm2_tokenizer.encode(text, add_special_tokens=True) for text in TEXTS]
    expected = LLM(profile.model, engine=single, load_tokenizer_too=False).generate(
        prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    )
    assert served == [r.token_ids for r in expected]
    assert all(len(ids) == n for ids, n in zip(served, MAX_TOKENS))


def test_killing_the_worker_mid_stream_fails_in_flight_requests_and_shuts_down(tp_server):
    server, _ = tp_server
    (worker,) = worker_pids(server.process.pid)
    num_requests = 4
    pieces = [0] * num_requests
    errors: list[str | None] = [None] * num_requests
    done = [threading.Event() for _ in range(num_requests)]
    clients = []
    for index in range(num_requests):
        client = grpcclient.InferenceServerClient(server.grpc_url)

        def callback(result=None, error=None, _index=index):
            if error is not None:
                errors[_index] = str(error)
                done[_index].set()
                return
            pieces[_index] += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                done[_index].set()

        client.start_stream(callback=callback)
        client.async_stream_infer(
            "ensemble", make_inputs({"text_input": f"Story number {index}:", "max_tokens": 500, "stream": True}),
            request_id=str(index), enable_empty_final_response=True,
        )
        clients.append(client)
    try:
        assert wait_for(lambda: all(count >= 2 for count in pieces), timeout=120), pieces
        os.kill(worker, signal.SIGKILL)
        for event in done:
            assert event.wait(60), "an in-flight request got no final response or error"
    finally:
        for client in clients:
            client.stop_stream()
            client.close()
    assert all(error is not None and "tensor-parallel worker rank 1" in error for error in errors), errors
    assert all(count < 500 for count in pieces)

    # Later requests are refused at once with the reason; the engine reports not ready.
    later = run_stream_requests(server.grpc_url, [{"text_input": "Hello", "max_tokens": 4}])[0]
    assert later.error is not None and "engine not ready" in later.error, later.error
    assert metric(scrape_metrics(server.metrics_url), "inflightllm_engine_ready") == 0

    assert_stops_without_hanging(server)
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]


def test_server_shutdown_ends_a_healthy_worker(tmp_path):
    repository = tmp_path / "repo"
    render(load_profile(PROFILE), repository)
    server = start_triton_server(repository, timeout=600.0)
    try:
        (worker,) = worker_pids(server.process.pid)
    finally:
        assert_stops_without_hanging(server)
    assert wait_for(lambda: not Path(f"/proc/{worker}").exists(), timeout=10), "the worker outlived the server"
