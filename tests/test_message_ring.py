"""The shared-memory message ring that carries rank 0's step messages to the
tensor-parallel workers (inflightllm/parallel/message_ring.py): messages arrive whole and in
order in every reader process, including messages many times larger than the ring; a
writer facing a full ring gives up when told to; a step description survives the trip."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from inflightllm.parallel import message_ring
from inflightllm.parallel.message_ring import MessageRing, RingClosed
from inflightllm.sampling_params import SamplingParams
from inflightllm.step import CachedRequestData, NewRequestData, StepDescription

pytestmark = pytest.mark.skipif(not message_ring.available(), reason="no shared-memory ring on this host")


def _reader(path: str, reader: int, count: int, results) -> None:
    ring = MessageRing.open(path, reader=reader, spin_s=0.01)
    got = [ring.read() for _ in range(count)]
    results.put((reader, got))


def _messages() -> list:
    # Small ones, one exactly a slot's room, and some many times the whole ring (3 slots of 4 KiB).
    big = bytes(range(256)) * 200  # 51,200 bytes
    return [("step", i, list(range(i))) for i in range(20)] + [b"x" * (4096 - 16 - 38), big, ("tail", big * 3), None]


def test_messages_reach_every_reader_whole_and_in_order(tmp_path):
    ring = MessageRing.create(readers=2, slots=3, slot_bytes=4096, directory=tmp_path)
    messages = _messages()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    readers = [context.Process(target=_reader, args=(str(ring.path), r, len(messages), results)) for r in range(2)]
    for process in readers:
        process.start()
    try:
        for message in messages:
            ring.write(message, stop=lambda: not all(p.is_alive() for p in readers))
        got = dict(results.get(timeout=60) for _ in readers)
    finally:
        for process in readers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        ring.unlink()
    assert got[0] == messages
    assert got[1] == messages
    assert not ring.path.exists()


def test_a_full_ring_ends_the_write_when_told_to(tmp_path):
    ring = MessageRing.create(readers=1, slots=2, slot_bytes=1024, directory=tmp_path)
    reader = MessageRing.open(ring.path, reader=0)
    ring.write("first")
    ring.write("second")  # the ring is full now: nobody has read
    asked = []

    def stop():
        asked.append(time.monotonic())
        return len(asked) >= 3

    with pytest.raises(RingClosed, match="stopped waiting"):
        ring.write("third", stop=stop)
    assert len(asked) == 3
    assert reader.read() == "first"
    ring.unlink()


def test_a_step_description_survives_the_ring(tmp_path):
    ring = MessageRing.create(readers=1, directory=tmp_path)
    reader = MessageRing.open(ring.path, reader=0)
    params = SamplingParams(max_tokens=7, temperature=0.5, stop_sequences=((3, 4),), seed=5)
    step = StepDescription(
        new_requests=[NewRequestData("a", list(range(100_000)), [], list(range(6250)), 0, params, (2,))],
        cached_requests=[CachedRequestData("b", [9], 17)],
        scheduled=[("a", 4096), ("b", 1)],
        finished_request_ids=["c"],
    )
    ring.write(("step", step, (3, ["b"], [11])))  # a 100k-token prompt: several slots
    kind, got, last = reader.read()
    assert kind == "step" and last == (3, ["b"], [11])
    assert got == step
    ring.unlink()


def test_opening_something_else_is_refused(tmp_path):
    other = tmp_path / "not-a-ring"
    other.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not an inflightllm message ring"):
        MessageRing.open(other, reader=0)
    ring = MessageRing.create(readers=1, directory=tmp_path)
    with pytest.raises(ValueError, match="reader 1 of 1"):
        MessageRing.open(ring.path, reader=1)
    ring.unlink()
