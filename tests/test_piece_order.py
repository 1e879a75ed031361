"""One piece of a stream in flight (ResponseSender, inflightllm/serving/engine_loop.py): a packed
piece goes out with a ticket in the engine's ledger, postprocessing marks the ticket once it has
sent the piece on, and the stream's next piece waits (its outputs coalesce) until then; a
request's final piece waits for every ticket of the request. So several postprocessing
instances keep each stream's pieces in order. Unmarked tickets are written off after a bound."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from inflightllm import packed_outputs
from inflightllm.piece_ledger import SHM_DIR, TICKETS, PieceCounter, PieceLedger
from inflightllm.serving import engine_loop
from inflightllm.serving.engine_loop import SENDER_HOLD_ENV, EngineLoop, ResponseSender
from tests.test_engine_loop import engine_request
from tests.test_sender_hold import output

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm here")


class PackedSink:
    """Records what postprocessing would receive: (ids, final, ticket) per piece."""

    def __init__(self):
        self.pieces: list[tuple[list[int], bool, int]] = []
        self.errors: list[str] = []

    def send(self, tensors, final):
        inputs = {name: tensors[name].numpy() for name in (packed_outputs.PACKED_I32, packed_outputs.PACKED_F32)}
        ids = packed_outputs.unpack(inputs)["output_ids"].reshape(-1).tolist()
        self.pieces.append((ids, final, packed_outputs.ticket(inputs)))

    def send_error(self, message):
        self.errors.append(message)

    def is_cancelled(self):
        return False


def packed_request(max_tokens: int, **overrides):
    request = engine_request([1, 2, 3, 4], max_tokens, **overrides)
    request.packed_outputs = True
    return request


@pytest.fixture
def ledger():
    made = PieceLedger.create(window=100000, max_wait_s=0.05, stall_s=0.05)
    assert made is not None
    yield made
    made.close()


@pytest.fixture
def sender(monkeypatch, ledger):
    monkeypatch.setenv(SENDER_HOLD_ENV, "0")  # holding near the end is tested in test_sender_hold.py
    return ResponseSender(loop=None, ledger=ledger, yield_s=0.0, ordered=True)


def answer(ledger, sink, index=-1):
    """Postprocessing's side: the piece sent on, then its ticket marked."""
    PieceCounter(1).count_done(ledger.id, 1, sink.pieces[index][2])


def test_a_stream_s_next_piece_waits_for_the_previous_piece_s_answer(sender, ledger):
    sink, request = PackedSink(), packed_request(8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink)])])
    assert [piece[:2] for piece in sink.pieces] == [([101], False)] and 0 <= sink.pieces[0][2] < TICKETS
    for step in (2, 3):  # unanswered: the outputs wait and merge
        sender._send_all([("outputs", [(output(0, 100 + step, step), request, sink)])])
    assert len(sink.pieces) == 1 and sender.pieces_waited == 1 and sender._waiting
    answer(ledger, sink)
    sender._send_all([])
    assert [piece[:2] for piece in sink.pieces] == [([101], False), ([102, 103], False)]
    assert sender._waiting == {}
    assert list(sender._tickets) == [sink.pieces[1][2]]  # the first released (and free to take again)


def test_streams_wait_only_for_their_own_pieces(sender, ledger):
    slow, fast = PackedSink(), PackedSink()
    slow_request, fast_request = packed_request(8), packed_request(8)
    sender._send_all([("outputs", [(output(0, 101, 1), slow_request, slow), (output(1, 201, 1), fast_request, fast)])])
    answer(ledger, fast)
    sender._send_all([("outputs", [(output(0, 102, 2), slow_request, slow), (output(1, 202, 2), fast_request, fast)])])
    assert [piece[0] for piece in fast.pieces] == [[201], [202]]
    assert [piece[0] for piece in slow.pieces] == [[101]]


def test_the_final_piece_waits_for_every_piece_of_its_request(sender, ledger):
    sink, request = PackedSink(), packed_request(2, n=2, best_of=2, temperature=1.0)
    first, second = output(0, 101, 1), output(0, 201, 1)
    first.sequence_index, first.sequence_finished = 0, True
    second.sequence_index, second.sequence_finished = 1, False
    sender._send_all([("outputs", [(first, request, sink), (second, request, sink)])])
    assert len(sink.pieces) == 2  # two sequences: a piece each, both in flight
    last = output(0, 202, 2, finished=True)
    last.sequence_index, last.sequence_finished = 1, True
    sender._send_all([("outputs", [(last, request, sink)])])
    assert len(sink.pieces) == 2  # its own sequence's piece is unanswered
    answer(ledger, sink, 1)
    sender._send_all([])
    assert len(sink.pieces) == 2  # sequence 0's piece still is: the final must not pass it
    answer(ledger, sink, 0)
    sender._send_all([])
    assert sink.pieces[-1][:2] == ([202], True) and sender._request_tickets == {last.request_id: 1}


def test_requests_without_packed_outputs_are_not_held(sender, ledger):
    direct = PackedSink()
    request = engine_request([1, 2, 3, 4], 8)  # a direct caller: documented outputs, no postprocessing
    events = []
    direct.send = lambda tensors, final: events.append((tensors["output_ids"].reshape(-1).tolist(), final))
    for step in (1, 2, 3):
        sender._send_all([("outputs", [(output(0, 100 + step, step), request, direct)])])
    assert events == [([101], False), ([102], False), ([103], False)] and sender._tickets == {}


def test_an_unmarked_ticket_is_written_off_after_the_bound_and_never_reused(sender, ledger, monkeypatch):
    monkeypatch.setattr(engine_loop, "TICKET_WRITE_OFF_S", 0.2)
    sink, request = PackedSink(), packed_request(8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink)])])
    lost = sink.pieces[0][2]
    sender._send_all([("outputs", [(output(0, 102, 2), request, sink)])])
    assert len(sink.pieces) == 1
    time.sleep(0.25)
    sender._send_all([])
    assert [piece[0] for piece in sink.pieces] == [[101], [102]] and sender.tickets_written_off == 1
    assert lost not in ledger._free_tickets and sink.pieces[1][2] != lost


def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)


def second_piece_waiting(sender, sink, request) -> None:
    """The sender thread has sent the stream's first piece and holds its second."""
    sender.start()
    sender.put([(output(0, 101, 1), request, sink)])
    until(lambda: sink.pieces)
    sender.put([(output(0, 102, 2), request, sink)])
    until(lambda: sender.pieces_waited > 0)
    assert len(sink.pieces) == 1


def test_stopping_sends_what_waits(sender, ledger):
    sink, request = PackedSink(), packed_request(8)
    second_piece_waiting(sender, sink, request)
    sender.stop(5.0)
    assert [piece[0] for piece in sink.pieces] == [[101], [102]]


def test_the_sender_thread_sends_a_waiting_piece_once_the_answer_comes(sender, ledger):
    sink, request = PackedSink(), packed_request(8)
    try:
        second_piece_waiting(sender, sink, request)
        threading.Timer(0.05, answer, args=(ledger, sink, 0)).start()
        until(lambda: len(sink.pieces) >= 2)  # no new output: the answer alone wakes the sender
        assert [piece[0] for piece in sink.pieces] == [[101], [102]]
    finally:
        sender.stop(5.0)


def test_tickets_run_out_then_pieces_go_without(ledger):
    taken = [ledger.take_ticket() for _ in range(TICKETS)]
    assert sorted(taken) == list(range(TICKETS)) and ledger.take_ticket() == -1
    marks = np.array(taken[:3])
    assert not ledger.answered_tickets(marks).any()
    PieceCounter(2).count_done(ledger.id, 1, taken[1])
    assert ledger.answered_tickets(marks).tolist() == [False, True, False]
    ledger.release_ticket(taken[1])
    assert ledger.take_ticket() == taken[1] and not ledger.answered_tickets(np.array([taken[1]])).any()


def test_an_error_sends_what_waits_before_it(sender, ledger):
    sink, other_sink = PackedSink(), PackedSink()
    request, other = packed_request(8), packed_request(8)
    sender._send_all([("outputs", [(output(0, 101, 1), request, sink), (output(1, 201, 1), other, other_sink)])])
    sender._send_all([("outputs", [(output(0, 102, 2), request, sink), (output(1, 202, 2), other, other_sink)])])
    assert len(sender._waiting) == 2
    sender._send_all([("error", sink, "step failed")])
    assert [piece[0] for piece in sink.pieces] == [[101], [102]] and sink.errors == ["step failed"]
    assert list(sender._waiting) == [EngineLoop.request_id(1)]  # the other stream still waits


def test_with_one_postprocessing_instance_pieces_carry_no_ticket_and_never_wait(ledger):
    sender = ResponseSender(loop=None, ledger=ledger, yield_s=0.0)  # ordered=False: one instance keeps order
    sink, request = PackedSink(), packed_request(8)
    for step in (1, 2, 3):
        sender._send_all([("outputs", [(output(0, 100 + step, step), request, sink)])])
    assert sink.pieces == [([101], False, -1), ([102], False, -1), ([103], False, -1)] and sender._tickets == {}
