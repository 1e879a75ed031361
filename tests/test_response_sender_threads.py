"""The response sender's parallel sends (INFLIGHTLLM_SENDER_THREADS): a round's responses
go out from several threads at once, each request's on one thread and in order; every
response is sent once and counted once; small rounds stay on the sender's own thread; a bad
setting is refused with the variable's name and range."""

from __future__ import annotations

import threading
import time

import pytest

from inflightllm.serving.engine_loop import (
    PARALLEL_SEND_MIN,
    SENDER_THREADS_ENV,
    EngineLoop,
    ResponseSender,
    sender_threads_setting,
)
from tests.test_engine_loop import engine_request
from tests.test_response_sender_yield import output


class BlockingSink:
    """Like the Python backend's send: blocks a while (with the GIL released)."""

    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def __init__(self, log: list):
        self.log = log

    def send(self, tensors, final):
        with BlockingSink.lock:
            BlockingSink.in_flight += 1
            BlockingSink.most_in_flight = max(BlockingSink.most_in_flight, BlockingSink.in_flight)
        time.sleep(0.002)
        with BlockingSink.lock:
            BlockingSink.in_flight -= 1
        self.log.append((threading.current_thread().name, tensors["output_ids"].reshape(-1).tolist(), final))

    def send_error(self, message):
        self.log.append((threading.current_thread().name, message, True))

    def is_cancelled(self):
        return False


@pytest.fixture
def sender():
    sender = ResponseSender(loop=None, yield_s=0.0, threads=4)
    BlockingSink.most_in_flight = 0
    yield sender
    sender._pool.shutdown(wait=True)


def test_a_round_goes_out_from_several_threads_each_request_in_order(sender):
    logs = [[] for _ in range(80)]
    sinks = [BlockingSink(log) for log in logs]
    request = engine_request([1, 2, 3, 4], 8)
    for step in range(3):  # three rounds; the last one finishes every request
        sender._send_all([("outputs", [(output(EngineLoop.request_id(i), 100 * step + i, finished=step == 2),
                                        request, sink) for i, sink in enumerate(sinks)])])
    assert BlockingSink.most_in_flight > 1  # sends overlapped
    for i, log in enumerate(logs):
        assert [(ids, final) for _, ids, final in log] == [([i], False), ([100 + i], False), ([200 + i], True)]
    assert sender.responses_sent == 3 * 80 and sender._busy == 0
    assert len({name for log in logs for name, _, _ in log}) > 1


def test_coalesced_outputs_and_errors_stay_with_their_request(sender):
    logs = [[] for _ in range(PARALLEL_SEND_MIN + 8)]
    sinks = [BlockingSink(log) for log in logs]
    request = engine_request([1, 2, 3, 4], 8)
    first = [(output(EngineLoop.request_id(i), 10 + i, False), request, sink) for i, sink in enumerate(sinks)]
    second = [(output(EngineLoop.request_id(i), 50 + i, False), request, sink) for i, sink in enumerate(sinks[1:], 1)]
    sender._send_all([("outputs", first), ("error", sinks[0], "request 0 failed"), ("outputs", second)])
    assert [(ids, final) for _, ids, final in logs[0]] == [([10], False), ("request 0 failed", True)]
    for i, log in enumerate(logs[1:], 1):
        assert [ids for _, ids, _ in log] == [[10 + i, 50 + i]]  # two steps' outputs in one response
    assert sender.outputs_coalesced == len(sinks) - 1 and sender.responses_sent == len(sinks)


def test_a_small_round_stays_on_the_senders_thread(sender):
    logs = [[] for _ in range(PARALLEL_SEND_MIN - 1)]
    request = engine_request([1, 2, 3, 4], 8)
    sender._send_all([("outputs", [(output(EngineLoop.request_id(i), i, False), request, BlockingSink(log))
                                   for i, log in enumerate(logs)])])
    assert {name for log in logs for name, _, _ in log} == {threading.current_thread().name}
    assert BlockingSink.most_in_flight == 1


def test_one_thread_by_default_and_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.delenv(SENDER_THREADS_ENV, raising=False)
    assert sender_threads_setting() == 1 and ResponseSender(loop=None)._pool is None
    monkeypatch.setenv(SENDER_THREADS_ENV, "8")
    assert ResponseSender(loop=None).threads == 8
    for bad in ("0", "65", "two", ""):
        monkeypatch.setenv(SENDER_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"{SENDER_THREADS_ENV}.*threads"):
            sender_threads_setting()
