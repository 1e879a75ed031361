"""Holding near the end (ResponseSender, inflightllm/serving/engine_loop.py): while postprocessing
is behind, a streaming request that will have finished before the pieces in between are answered
keeps its outputs for its final piece. What is held is never lost: it goes out with the final
output, with the next round that has no backlog, before an error for the request, and when the
sender stops. The ledger's drain estimate (PieceLedger.drain_s) and the switch are tested too."""

from __future__ import annotations

import pytest

from inflightllm.engine import FinishReason, RequestOutput
from inflightllm.piece_ledger import SHM_DIR, PieceCounter, PieceLedger
from inflightllm.serving.engine_loop import SENDER_HOLD_ENV, EngineLoop, ResponseSender
from tests.test_engine_loop import engine_request


class Sink:
    def __init__(self):
        self.events: list = []  # ("response", ids, final) | ("error", message)

    def send(self, tensors, final):
        self.events.append(("response", tensors["output_ids"].reshape(-1).tolist(), final))

    def send_error(self, message):
        self.events.append(("error", message))

    def is_cancelled(self):
        return False


def output(index: int, token: int, done: int, finished: bool = False) -> RequestOutput:
    """Request `index`'s output of one new token, its `done`-th."""
    return RequestOutput(
        request_id=EngineLoop.request_id(index), new_token_ids=[token], context_ids=[], new_logprobs=[],
        new_top_ids=[], new_top_logprobs=[], cum_logprob=0.0, finished=finished,
        finish_reason=FinishReason.LENGTH if finished else FinishReason.NONE,
        num_prompt_tokens=4, num_output_tokens=done, num_cached_tokens=0,
    )


@pytest.fixture
def sender(monkeypatch):
    monkeypatch.delenv(SENDER_HOLD_ENV, raising=False)
    made = ResponseSender(loop=None, yield_s=0.0)
    made._step_s = 0.02  # 20 ms between steps
    return made


def test_a_request_that_ends_before_the_backlog_drains_sends_one_piece(sender):
    near, far = Sink(), Sink()
    near_request, far_request = engine_request([1, 2, 3, 4], 8), engine_request([1, 2, 3, 4], 100)
    for step in range(1, 8):  # 7 of 8 tokens; 0.5 s of backlog: near's 1..7 tokens left take <= 0.14 s
        sender._send_all([("outputs", [(output(0, 100 + step, step), near_request, near),
                                       (output(1, 200 + step, step), far_request, far)])], horizon_s=0.5)
    assert near.events == [] and len(sender._held) == 1 and sender.num_pending == 1
    assert [event[1] for event in far.events] == [[200 + step] for step in range(1, 8)]  # 92+ left: never held
    sender._send_all([("outputs", [(output(0, 108, 8, finished=True), near_request, near)])], horizon_s=0.5)
    assert near.events == [("response", [101, 102, 103, 104, 105, 106, 107, 108], True)]
    assert sender._held == {} and sender.rounds_held == 7


def test_held_outputs_go_out_once_the_backlog_is_gone(sender):
    sink, request = Sink(), engine_request([1, 2, 3, 4], 8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink)])], horizon_s=1.0)
    assert sink.events == []
    sender._send_all([], horizon_s=0.0)  # no new output of it, no backlog: what it held goes
    assert sink.events == [("response", [101], False)] and sender._held == {}


def test_a_short_backlog_holds_nothing(sender):
    sink, request = Sink(), engine_request([1, 2, 3, 4], 8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink)])], horizon_s=0.1)  # 7 x 20 ms > 0.1 s
    assert sink.events == [("response", [101], False)]


def test_an_error_sends_what_was_held_first(sender):
    sink, request = Sink(), engine_request([1, 2, 3, 4], 8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink)])], horizon_s=1.0)
    sender._send_all([("outputs", [(output(0, 102, 2), request, sink)]), ("error", sink, "step failed")],
                     horizon_s=1.0)
    assert sink.events == [("response", [101, 102], False), ("error", "step failed")]


def test_non_streaming_requests_and_sequence_groups_are_never_held(sender):
    plain, request = Sink(), engine_request([1, 2, 3, 4], 8, streaming=False)
    sender._send_all([("outputs", [(output(0, 101, 1), request, plain)])], horizon_s=1.0)
    group, n_request = Sink(), engine_request([1, 2, 3, 4], 8, n=2, best_of=2, temperature=1.0)
    second = output(1, 201, 1)
    second.sequence_index, second.sequence_finished = 1, False
    sender._send_all([("outputs", [(second, n_request, group)])], horizon_s=1.0)
    assert len(plain.events) == 1 and len(group.events) == 1 and sender._held == {}


def test_the_sender_sends_what_it_holds_when_it_stops(sender):
    sink, request = Sink(), engine_request([1, 2, 3, 4], 8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink)])], horizon_s=1.0)
    sender.start()
    sender.stop(5.0)
    assert sink.events == [("response", [101], False)]


def test_the_switch(monkeypatch):
    monkeypatch.setenv(SENDER_HOLD_ENV, "0")
    assert ResponseSender(loop=None).hold is False
    monkeypatch.setenv(SENDER_HOLD_ENV, "1")
    assert ResponseSender(loop=None).hold is True
    monkeypatch.setenv(SENDER_HOLD_ENV, "yes")
    with pytest.raises(ValueError, match="INFLIGHTLLM_SENDER_HOLD='yes': 0 or 1"):
        ResponseSender(loop=None)


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm here")
def test_the_ledger_estimates_the_drain_from_the_recent_answer_rate():
    ledger = PieceLedger.create(window=2, max_wait_s=0.01, stall_s=0.01)
    try:
        counter = PieceCounter()
        ledger.count_sent(1000)
        assert ledger.drain_s(now=10.0) == 0.0  # no rate yet
        counter.count_done(ledger.id, 100)
        assert ledger.drain_s(now=10.1) == pytest.approx(900 / 1000)  # 100 answers in 0.1 s: 1,000 a second
        counter.count_done(ledger.id, 400)
        assert ledger.drain_s(now=10.5) == pytest.approx(500 / 1000)
        assert ledger.drain_s(now=13.0) == 0.0  # no answer over the last second: no estimate
        counter.count_done(ledger.id, 500)
        assert ledger.drain_s(now=13.1) == 0.0  # nothing in between
    finally:
        ledger.close()


def test_outputs_are_never_held_past_the_drain_seen_when_holding_began(sender):
    """A request that ends later than its tokens left say (e.g. preempted) does not keep its
    tokens longer than a piece sent at the first hold would have waited."""
    sink, request = Sink(), engine_request([1, 2, 3, 4], 8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink)])], horizon_s=0.5, now=100.0)
    sender._send_all([("outputs", [(output(0, 102, 2), request, sink)])], horizon_s=0.5, now=100.4)
    assert sink.events == [] and sender._held_until == {EngineLoop.request_id(0): 100.5}
    sender._send_all([("outputs", [(output(0, 103, 3), request, sink)])], horizon_s=0.5, now=100.5)
    assert sink.events == [("response", [101, 102, 103], False)] and sender._held == {}
    assert sender._held_until == {}
