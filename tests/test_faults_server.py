"""Faults, bounded queues, timeouts and priority through the real tritonserver.

One server on a repository rendered from the default profile with a small batch
(`max_batch_size: 2`), a bounded queue (`max_queue_size: 3`) and fault injection on
(inflightllm/faults.py: a request with a magic seed fails on purpose). Expected texts
come from `transformers` on the same weights. Waiting is for events (metrics, responses),
never for a time.
"""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import yaml

from inflightllm.faults import SAMPLING_FAULT_SEED, STEP_FAULT_SEED
from inflightllm.profile import DEFAULT_PROFILE, load_profile
from tests.ensemble_client import make_inputs, metric, run_stream_requests, scrape_metrics, wait_for
from tools import render_configs

pytestmark = [pytest.mark.server, pytest.mark.slow]

QUESTION = "What is the capital of France?"
MAX_TOKENS = 12
LONG_TOKENS = 4096


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory, triton_server_factory):
    folder = tmp_path_factory.mktemp("faults")
    data = yaml.safe_load(Path(DEFAULT_PROFILE).read_text())
    data["name"] = "faults"
    data["engine"]["max_batch_size"] = 2
    data["engine"]["queue_policy"]["max_queue_size"] = 3
    data["engine"]["max_output_len"] = LONG_TOKENS  # long_request's length (the KV cache holds 23k tokens)
    profile_path = folder / "faults.yaml"
    profile_path.write_text(yaml.safe_dump(data))
    repository = folder / "repo"
    render_configs.render(load_profile(profile_path), repository)
    config = repository / "engine" / "config.pbtxt"
    text = config.read_text()
    off = 'key: "fault_injection"\n  value: { string_value: "false" }'
    assert off in text
    config.write_text(text.replace(off, off.replace('"false"', '"true"')))
    return triton_server_factory(repository, timeout=600.0)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def expected_text(smollm2_reference, smollm2_tokenizer) -> str:
    text = smollm2_tokenizer.apply_chat_template(chat(QUESTION), add_generation_prompt=True, tokenize=False)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    return smollm2_tokenizer.decode(smollm2_reference.greedy(ids, MAX_TOKENS), skip_special_tokens=True)


def request(**extra) -> dict:
    return {"messages": chat(QUESTION), "max_tokens": MAX_TOKENS, "stream": True, **extra}


def test_a_sampling_fault_fails_only_its_request(fault_server, expected_text):
    results = run_stream_requests(
        fault_server.grpc_url, [request(), request(seed=SAMPLING_FAULT_SEED), request()], num_streams=3
    )
    assert "sampling failed: InjectedFault: injected sampling fault" in results[1].error
    for result in (results[0], results[2]):
        assert result.error is None and result.text == expected_text and result.finish_reason == "stop"


def test_a_model_step_fault_fails_its_step_and_the_server_goes_on(fault_server, expected_text):
    before = scrape_metrics(fault_server.metrics_url)
    [faulty] = run_stream_requests(fault_server.grpc_url, [request(seed=STEP_FAULT_SEED)])
    assert "engine step failed: InjectedFault: injected model step fault" in faulty.error
    with urllib.request.urlopen(f"http://{fault_server.http_url}/v2/models/engine/ready", timeout=5) as response:
        assert response.status == 200  # the model still reports ready
    [after] = run_stream_requests(fault_server.grpc_url, [request()])
    assert after.error is None and after.text == expected_text
    errors_before = metric(before, "inflightllm_request_failed_total", cause="error")
    assert wait_for(lambda: metric(scrape_metrics(fault_server.metrics_url), "inflightllm_request_failed_total",
                                   cause="error") == errors_before + 1, timeout=60)
    assert metric(scrape_metrics(fault_server.metrics_url), "inflightllm_kv_cache_blocks", state="used") == 0


class Background:
    """Requests streamed on one gRPC stream each, without waiting; cancelled at the end."""

    def __init__(self, url: str):
        self.url = url
        self.clients = []
        self.first_piece = []
        self.finished = []

    def send(self, req: dict) -> int:
        index = len(self.clients)
        first, done = threading.Event(), threading.Event()
        self.first_piece.append(first)
        self.finished.append(done)

        def callback(result=None, error=None):
            if error is not None:
                done.set()
                return
            if result.as_numpy("text_output") is not None and result.as_numpy("text_output").reshape(-1)[0]:
                first.set()
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()

        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=callback)
        client.async_stream_infer("ensemble", make_inputs(req), request_id=str(index),
                                  enable_empty_final_response=True)
        self.clients.append(client)
        return index

    def cancel_all(self) -> None:
        for client in self.clients:
            client.stop_stream(cancel_requests=True)
            client.close()


def long_request(priority: int = 0) -> dict:
    # As long as the fixture's profile allows (LONG_TOKENS): the queue-full check below needs the
    # running requests still running. With 400 tokens, and later with 1,024 once the response
    # path got cheaper, a fast step loop finished one first, admitted a waiting request and
    # left the queue no longer full. They are cancelled at the end.
    return {"messages": chat("Write a very long story about a dragon."), "max_tokens": LONG_TOKENS,
            "min_tokens": LONG_TOKENS, "stream": True, "priority": priority}


def test_full_queue_refuses_at_once_timeouts_fail_waiting_requests_and_priority_goes_first(
        fault_server, expected_text):
    metrics_url = fault_server.metrics_url
    background = Background(fault_server.grpc_url)
    try:
        # Two long low-priority requests fill the batch.
        running = [background.send(long_request()) for _ in range(2)]
        assert wait_for(lambda: all(background.first_piece[i].is_set() for i in running), timeout=120)

        # A request that may wait 1 ms fails with its own error; it never started.
        [late] = run_stream_requests(fault_server.grpc_url, [request(timeout_ms=1)], timeout=300)
        assert "more than its timeout of 1 ms; it was not started" in (late.error or "")

        # A high-priority request goes ahead of waiting low-priority ones and preempts a running one.
        waiting = [background.send(long_request()) for _ in range(2)]
        assert wait_for(lambda: metric(scrape_metrics(metrics_url), "inflightllm_requests", state="waiting") == 2,
                        timeout=60)
        [high] = run_stream_requests(fault_server.grpc_url, [request(priority=2)], timeout=300)
        assert high.error is None and high.text == expected_text
        assert not any(background.first_piece[i].is_set() for i in waiting)  # they still wait
        assert metric(scrape_metrics(metrics_url), "inflightllm_preemptions_total") >= 1

        # The preempted request runs again once the high-priority one is done. Until then it
        # waits too, and "3 waiting" would be true before the third long request below is in:
        # that request and the one meant to be refused then race for the last place.
        assert wait_for(lambda: (values := scrape_metrics(metrics_url))
                        and metric(values, "inflightllm_requests", state="running") == 2
                        and metric(values, "inflightllm_requests", state="waiting") == 2, timeout=60)
        # Three waiting: the queue is full, a new request is refused at once with a clear error.
        waiting.append(background.send(long_request()))
        assert wait_for(lambda: metric(scrape_metrics(metrics_url), "inflightllm_requests", state="waiting") == 3,
                        timeout=60)
        [refused] = run_stream_requests(fault_server.grpc_url, [request()])
        assert "the engine's queue is full: 3 requests are waiting (max_queue_size 3); try again later" in (
            refused.error or "")
        assert not any(background.finished[i].is_set() for i in running + waiting)
        # The metrics are updated after the next step.
        assert wait_for(lambda: metric(scrape_metrics(metrics_url), "inflightllm_request_failed_total",
                                       cause="rejected") >= 1, timeout=60)
        assert metric(scrape_metrics(metrics_url), "inflightllm_request_failed_total", cause="timeout") >= 1
    finally:
        background.cancel_all()

    def drained():
        values = scrape_metrics(metrics_url)
        return (metric(values, "inflightllm_kv_cache_blocks", state="used") == 0
                and metric(values, "inflightllm_requests", state="running") == 0
                and metric(values, "inflightllm_requests", state="waiting") == 0)

    assert wait_for(drained, timeout=300), scrape_metrics(metrics_url)
