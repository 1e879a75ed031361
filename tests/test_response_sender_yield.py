"""The response sender's optional pause between the responses of a round
(INFLIGHTLLM_SENDER_YIELD_US, off by default): it releases the GIL so that the engine loop
thread, which launches the GPU's next step, is not held up to Python's 5 ms switch interval
by a long round of sends (docs/GPU-ENGINE.md). The pause comes between responses only,
never before a round's first; a bad setting is refused with the variable's name and range."""

from __future__ import annotations

import time

import pytest

from inflightllm.engine import FinishReason, RequestOutput
from inflightllm.serving.engine_loop import (
    SENDER_YIELD_ENV,
    SENDER_YIELD_US,
    EngineLoop,
    ResponseSender,
    sender_yield_s,
)
from tests.test_engine_loop import engine_request


class TimedSink:
    def __init__(self, times: list):
        self.times = times

    def send(self, tensors, final):
        self.times.append((time.perf_counter(), tensors["output_ids"].reshape(-1).tolist(), final))

    def send_error(self, message):
        raise AssertionError(message)

    def is_cancelled(self):
        return False


def output(request_id: str, token: int, finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, new_token_ids=[token], context_ids=[], new_logprobs=[], new_top_ids=[],
        new_top_logprobs=[], cum_logprob=0.0, finished=finished,
        finish_reason=FinishReason.LENGTH if finished else FinishReason.NONE,
        num_prompt_tokens=4, num_output_tokens=1, num_cached_tokens=0,
    )


def send_round(yield_s: float, requests: int) -> list:
    """One round of `requests` outputs (one step's), each request its own sink."""
    sender = ResponseSender(loop=None, yield_s=yield_s)
    times: list = []
    items = [(output(EngineLoop.request_id(i), 100 + i, finished=False), engine_request([1, 2, 3, 4], 8), TimedSink(times))
             for i in range(requests)]
    start = time.perf_counter()
    sender._send_all([("outputs", items)])
    return [start] + times


def test_the_sender_pauses_between_the_responses_of_a_round():
    pause = 0.03
    start, *sent = send_round(pause, 4)
    assert [ids for _, ids, _ in sent] == [[100], [101], [102], [103]]  # every response, in order
    gaps = [b[0] - a[0] for a, b in zip(sent, sent[1:])]
    assert min(gaps) >= pause, gaps
    assert sent[-1][0] - start >= 3 * pause


def test_a_round_of_one_response_is_not_delayed_and_zero_turns_the_pause_off():
    start, first = send_round(0.5, 1)
    assert first[0] - start < 0.5  # no pause before a round's first (here only) response
    start, *sent = send_round(0.0, 50)
    assert len(sent) == 50 and sent[-1][0] - start < 0.5


def test_the_setting_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv(SENDER_YIELD_ENV, raising=False)
    assert sender_yield_s() == SENDER_YIELD_US / 1e6 == 0.0  # off unless asked for
    assert ResponseSender(loop=None).yield_s == 0.0
    monkeypatch.setenv(SENDER_YIELD_ENV, "200")
    assert sender_yield_s() == pytest.approx(200e-6)
    monkeypatch.setenv(SENDER_YIELD_ENV, "50")
    assert ResponseSender(loop=None).yield_s == pytest.approx(50e-6)
    for bad in ("fast", "-1", "20000", ""):
        monkeypatch.setenv(SENDER_YIELD_ENV, bad)
        with pytest.raises(ValueError, match=rf"{SENDER_YIELD_ENV}={bad!r}: give microseconds, a number from 0 to 10000"):
            sender_yield_s()



def test_the_switch_interval_setting(monkeypatch):
    """INFLIGHTLLM_SWITCH_INTERVAL_US sets the engine process's thread switch interval (unset:
    Python's own, untouched); a bad value is refused by name."""
    import sys

    from inflightllm.serving.engine_loop import SWITCH_INTERVAL_ENV, apply_switch_interval

    before = sys.getswitchinterval()
    try:
        monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
        assert apply_switch_interval() is None and sys.getswitchinterval() == before
        monkeypatch.setenv(SWITCH_INTERVAL_ENV, "500")
        assert apply_switch_interval() == pytest.approx(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        for bad in ("10", "fast"):
            monkeypatch.setenv(SWITCH_INTERVAL_ENV, bad)
            with pytest.raises(ValueError, match=SWITCH_INTERVAL_ENV):
                apply_switch_interval()
    finally:
        sys.setswitchinterval(before)
