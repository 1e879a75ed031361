"""EngineLoop's cancellation polling: which sinks are asked `is_cancelled()` (an IPC round
trip in Triton) in a polling round, on a fake clock, with no engine thread running; and,
with the threads running, that a cancelled sink's request is aborted by the loop."""

from __future__ import annotations

from inflightllm.sampling_params import SamplingParams
from inflightllm.serving.engine_io import EngineRequest
from inflightllm.serving.engine_loop import EngineLoop


class FakeEngine:
    """What `_admit` and `_check_cancellations` use of an Engine."""

    def __init__(self):
        self.added: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request_id, *args, **kwargs):
        self.added.append(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)
        return True


class CountingSink:
    def __init__(self, name: str, log: list[str]):
        self.name = name
        self.log = log
        self.cancelled = False

    def is_cancelled(self):
        self.log.append(self.name)
        return self.cancelled

    def send(self, tensors, final):
        raise AssertionError("nothing is sent here")

    def send_error(self, message):
        raise AssertionError(f"unexpected error response: {message}")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make_loop(num_requests: int, interval: float, per_step: int):
    engine, clock, log = FakeEngine(), Clock(), []
    loop = EngineLoop(engine, cancel_poll_interval_s=interval, max_polls_per_step=per_step, clock=clock)
    sinks = [CountingSink(f"s{i}", log) for i in range(num_requests)]
    request = EngineRequest([1, 2], SamplingParams(max_tokens=4), 0, True, False)
    loop._admit([(loop.request_id(i), request, sink) for i, sink in enumerate(sinks)])
    return loop, engine, clock, sinks, log


def test_admission_polls_once_and_the_next_poll_waits_for_the_interval():
    loop, engine, clock, sinks, log = make_loop(3, interval=0.125, per_step=64)
    assert log == ["s0", "s1", "s2"]  # at admission
    assert engine.added == ["req-0", "req-1", "req-2"]
    log.clear()
    clock.now += 0.0625
    loop._check_cancellations()
    assert log == []  # polled 62.5 ms ago: not due
    clock.now += 0.0625
    loop._check_cancellations()
    assert log == ["s0", "s1", "s2"]
    log.clear()
    loop._check_cancellations()  # same instant: none due again
    assert log == []


def test_a_step_polls_at_most_max_polls_per_step_oldest_first():
    loop, engine, clock, sinks, log = make_loop(5, interval=0.125, per_step=2)
    log.clear()
    clock.now += 1.0
    loop._check_cancellations()
    assert log == ["s0", "s1"]
    clock.now += 0.0625
    loop._check_cancellations()
    assert log == ["s0", "s1", "s2", "s3"]
    clock.now += 0.0625
    loop._check_cancellations()
    # s4 waited longest; s0 was polled 125 ms ago: due again, and the cap stops before s1.
    assert log == ["s0", "s1", "s2", "s3", "s4", "s0"]


def test_a_cancelled_sink_aborts_its_request_and_finished_requests_drop_out():
    loop, engine, clock, sinks, log = make_loop(3, interval=0.125, per_step=64)
    log.clear()
    sinks[1].cancelled = True
    del loop._active["req-2"]  # finished (the loop removes a request when its final output leaves)
    clock.now += 0.125
    assert loop._check_cancellations() == ["req-1"]  # the loop thread aborts it (the poller only finds it)
    assert log == ["s0", "s1"]
    assert engine.aborted == []
    assert [request_id for request_id, _ in loop._poll_ring] == ["req-0", "req-1"]


def test_a_sink_that_raises_counts_as_cancelled():
    loop, engine, clock, sinks, log = make_loop(1, interval=0.0, per_step=64)

    def broken():
        raise ConnectionError("client went away")

    sinks[0].is_cancelled = broken
    assert loop._check_cancellations() == ["req-0"]
