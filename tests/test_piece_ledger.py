"""The piece ledger (inflightllm/piece_ledger.py): the engine's count of pieces sent and
postprocessing's count of pieces answered, in a shared-memory file; the sender's bounded
wait for room, and the write-off of pieces that are never answered."""

from __future__ import annotations

import threading
import time

import pytest

from inflightllm.packed_outputs import PACKED_I32, pack, sender
from inflightllm.piece_ledger import SHM_DIR, PieceCounter, PieceLedger, ledger_path

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm here")


@pytest.fixture
def ledger():
    made = PieceLedger.create(window=2, max_wait_s=0.2, stall_s=0.2)
    assert made is not None and made.path == ledger_path(made.id) and 0 < made.id < 2**31
    yield made
    made.close()
    assert not made.path.exists()


def test_pieces_answered_by_another_process_s_counter_make_room(ledger):
    counter = PieceCounter()  # postprocessing's side (another process there: the same file)
    ledger.count_sent(5)
    assert ledger.in_flight == 5
    counter.count_done(ledger.id, 3)
    assert ledger.in_flight == 2
    start = time.monotonic()
    ledger.wait_for_room()  # 2 <= window: no wait
    assert time.monotonic() - start < 0.05 and ledger.waits == 0


def test_the_sender_waits_until_postprocessing_catches_up(ledger):
    counter = PieceCounter()
    ledger.count_sent(6)
    threading.Timer(0.05, counter.count_done, args=(ledger.id, 4)).start()
    start = time.monotonic()
    ledger.wait_for_room()
    waited = time.monotonic() - start
    assert 0.04 <= waited < 0.19, waited  # until the answers came, not the whole bound
    assert ledger.in_flight == 2 and ledger.waits == 1


def test_pieces_never_answered_are_written_off_after_one_bounded_wait(ledger):
    ledger.count_sent(10)  # e.g. their client went away: postprocessing never sees them
    start = time.monotonic()
    ledger.wait_for_room()
    assert 0.19 <= time.monotonic() - start < 1.0
    assert ledger.in_flight == 0  # written off: the next round does not wait
    ledger.count_sent(1)
    start = time.monotonic()
    ledger.wait_for_room()
    assert time.monotonic() - start < 0.05


def test_two_ledgers_never_share_a_file():
    """Random ids, each file created new (containers with their own process ids may share
    /dev/shm): the second engine's counts are its own."""
    first, second = PieceLedger.create(), PieceLedger.create()
    try:
        assert first.id != second.id and first.path != second.path
        first.count_sent(3)
        assert second.in_flight == 0 and first.in_flight == 3
    finally:
        first.close()
        second.close()


def test_a_counter_ignores_engines_without_a_ledger():
    counter = PieceCounter()
    counter.count_done(0)
    counter.count_done(2**31 - 7)  # no such ledger file
    assert not ledger_path(2**31 - 7).exists()


def test_packed_responses_name_their_engine_process():
    ints, floats = pack(finish_reason=0, num_input_tokens=3, num_output_tokens=1, num_cached_tokens=0,
                        output_ids=[5], context_ids=[], cum_log_probs=0.0, output_log_probs=[],
                        top_logprob_ids=[], top_logprobs=[], top_k=0, num_top_rows=1, sender=4242)
    assert sender({PACKED_I32: ints}) == 4242
    assert sender({}) == 0


def test_window_and_wait_settings(monkeypatch):
    """INFLIGHTLLM_PIECE_WINDOW and INFLIGHTLLM_PIECE_MAX_WAIT_MS reach a new ledger; values
    out of range are refused by name, with the range."""
    import pytest

    from inflightllm import piece_ledger

    monkeypatch.delenv(piece_ledger.WINDOW_ENV, raising=False)
    monkeypatch.delenv(piece_ledger.MAX_WAIT_ENV, raising=False)
    assert (piece_ledger.window_setting(), piece_ledger.max_wait_setting()) == (64, 0.05)
    monkeypatch.setenv(piece_ledger.WINDOW_ENV, "16")
    monkeypatch.setenv(piece_ledger.MAX_WAIT_ENV, "20")
    ledger = PieceLedger.create()
    if ledger is None:
        pytest.skip("no /dev/shm here")
    try:
        assert (ledger.window, ledger.max_wait_s) == (16, 0.02)
    finally:
        ledger.close()
    for bad in ("0", "", "many"):
        monkeypatch.setenv(piece_ledger.WINDOW_ENV, bad)
        with pytest.raises(ValueError, match=rf"INFLIGHTLLM_PIECE_WINDOW={bad!r}: give the pieces in between"):
            piece_ledger.window_setting()
    monkeypatch.setenv(piece_ledger.MAX_WAIT_ENV, "soon")
    with pytest.raises(ValueError, match=r"INFLIGHTLLM_PIECE_MAX_WAIT_MS='soon': give milliseconds"):
        piece_ledger.max_wait_setting()


def test_a_long_wait_goes_on_while_postprocessing_answers_and_ends_at_a_stall():
    """max_wait_s 1 s, stall_s 0.1 s: answers every 40 ms keep the sender waiting past the
    stall time until the window is reached; when the answers stop short of it, the wait ends
    one stall later (and nothing is written off: some pieces were answered)."""
    made = PieceLedger.create(window=2, max_wait_s=1.0, stall_s=0.1)
    if made is None:
        pytest.skip("no /dev/shm here")
    counter = PieceCounter()
    try:
        made.count_sent(8)
        for i in range(6):  # 8 -> 2 in flight at ~240 ms
            threading.Timer(0.04 * (i + 1), counter.count_done, args=(made.id, 1)).start()
        start = time.monotonic()
        made.wait_for_room()
        waited = time.monotonic() - start
        assert 0.22 <= waited < 0.5, waited
        assert made.in_flight == 2
        made.count_sent(6)  # 8 in flight; two answers, then none
        for i in range(2):
            threading.Timer(0.04 * (i + 1), counter.count_done, args=(made.id, 1)).start()
        start = time.monotonic()
        made.wait_for_room()
        waited = time.monotonic() - start
        assert 0.17 <= waited < 0.5, waited  # the last answer at ~80 ms, then a 100 ms stall
        assert made.in_flight == 6  # not written off
    finally:
        made.close()


def test_stall_setting(monkeypatch):
    from inflightllm import piece_ledger

    monkeypatch.delenv(piece_ledger.STALL_ENV, raising=False)
    monkeypatch.setenv(piece_ledger.MAX_WAIT_ENV, "1000")
    assert piece_ledger.stall_setting() == 0.05
    made = PieceLedger.create()
    if made is None:
        pytest.skip("no /dev/shm here")
    try:
        assert (made.max_wait_s, made.stall_s) == (1.0, 0.05)
    finally:
        made.close()
    monkeypatch.setenv(piece_ledger.STALL_ENV, "0")
    with pytest.raises(ValueError, match="INFLIGHTLLM_PIECE_STALL_MS"):
        piece_ledger.stall_setting()


def test_each_postprocessing_instance_counts_in_a_slot_of_its_own(ledger):
    from inflightllm.piece_ledger import DONE_SLOTS, done_slot

    assert [done_slot(n) for n in ("postprocessing_0_0", "postprocessing_0_3", "postprocessing", "")] == [0, 3, 0, 0]
    assert done_slot(f"postprocessing_0_{DONE_SLOTS + 2}") == 2
    with pytest.raises(ValueError, match="done slot"):
        PieceCounter(DONE_SLOTS)
    ledger.count_sent(7)
    first, second = PieceCounter(0), PieceCounter(3)
    first.count_done(ledger.id, 2)
    second.count_done(ledger.id, 4)  # another process: its own counter, no increment lost
    assert ledger.answered == 6 and ledger.in_flight == 1
