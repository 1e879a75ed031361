"""Backpressure from postprocessing to the engine: how many streamed pieces are in between.

Inside the ensemble every engine response is a piece that tritonserver queues for the one
postprocessing instance, which handles the pieces one after another (~1,500-2,000 a
second, docs/PERFORMANCE.md). Triton gives the engine no sign of that queue: `send`
returns once the server has taken the response. So an engine whose sender keeps up sends
a piece per stream per step, the queue behind postprocessing grows, and every token
reaches its client late; coalescing, which would have carried the same tokens in fewer
pieces, never happens because the sender itself is never behind.

The ledger is that sign. Each engine instance owns a small file in /dev/shm, named by
a random 31-bit id (not the process id: containers with their own process ids may share
/dev/shm), of 1 + DONE_SLOTS counters: pieces sent (written by the engine only) and pieces
done, one counter for each postprocessing instance (`done_slot`: each is written by one
process only, so no increment is lost; the engine reads their sum). The engine puts the id in each
packed response (`inflightllm.packed_outputs`, the header's `sender`); postprocessing
counts the pieces it has answered in that ledger. The engine's response sender waits, before each
round, while more than `window` pieces are in between: its outputs queue meanwhile and go
out coalesced. An idle server never waits. The wait is bounded (`max_wait_s`), and a
ledger whose `done` stops moving is re-based, so pieces that never reach postprocessing
(a client that went away) cannot stall the engine. Where /dev/shm is missing, or the file
cannot be made, there is no ledger and no backpressure. The engine model removes its file
when it is unloaded; an engine process killed outright leaves its 64 KiB behind.

The file also holds TICKETS one-byte tickets, the order of a stream's pieces where
postprocessing runs several instances: each packed piece carries a free ticket
(`packed_outputs` header `ticket`), which postprocessing marks once it has sent the piece
on, and the engine's sender keeps a stream's next piece (its outputs coalesce meanwhile)
until its previous piece is marked (ResponseSender). With
several postprocessing instances, which take pieces as they come, a stream's pieces thus
still leave in order. A marked ticket is given back; one written off is never reused.

`window` (64) and `max_wait_s` (50 ms) can be changed for measurements with
INFLIGHTLLM_PIECE_WINDOW (pieces) and INFLIGHTLLM_PIECE_MAX_WAIT_MS (perf/run_sender_gil_ab.sh):
a smaller window coalesces sooner, fewer pieces carrying more tokens each. A wait also ends
when `done` has not moved for `stall_s` (INFLIGHTLLM_PIECE_STALL_MS, 50 ms): with a longer
`max_wait_s` the sender then waits as long as postprocessing makes progress, and no longer.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from pathlib import Path

import numpy as np

from inflightllm.env_settings import env_number

SHM_DIR = Path("/dev/shm")
PREFIX = "inflightllm-pieces-"
WINDOW = 64  # pieces in between before the sender waits
MAX_WAIT_S = 0.05
WINDOW_ENV = "INFLIGHTLLM_PIECE_WINDOW"
MAX_WAIT_ENV = "INFLIGHTLLM_PIECE_MAX_WAIT_MS"
STALL_S = 0.05  # a wait ends when postprocessing answered nothing for this long
STALL_ENV = "INFLIGHTLLM_PIECE_STALL_MS"
DONE_SLOTS = 16  # postprocessing instances with a done counter of their own
TICKETS = 65536  # pieces that can be in flight with a ticket at once
TICKETS_OFFSET = 8 * (1 + DONE_SLOTS)
LEDGER_BYTES = TICKETS_OFFSET + TICKETS


def window_setting() -> int:
    """The ledger's window: INFLIGHTLLM_PIECE_WINDOW (pieces, 1 to 100000), else WINDOW."""
    raw = os.environ.get(WINDOW_ENV)
    if raw is None:
        return WINDOW
    if not (raw.strip().isdigit() and 1 <= int(raw) <= 100000):
        raise ValueError(f"{WINDOW_ENV}={raw!r}: give the pieces in between, an integer from 1 to 100000")
    return int(raw)


def max_wait_setting() -> float:
    """The ledger's longest wait in seconds: INFLIGHTLLM_PIECE_MAX_WAIT_MS (0 to 1000), else MAX_WAIT_S."""
    return env_number(MAX_WAIT_ENV, MAX_WAIT_S * 1000, 0, 1000, "milliseconds") / 1000


def stall_setting() -> float:
    """How long a wait goes on without an answer, in seconds: INFLIGHTLLM_PIECE_STALL_MS (1 to 1000), else STALL_S."""
    return env_number(STALL_ENV, STALL_S * 1000, 1, 1000, "milliseconds") / 1000


def ledger_path(ledger_id: int) -> Path:
    return SHM_DIR / f"{PREFIX}{int(ledger_id)}"


def map_ledger(path: Path) -> tuple[np.memmap, np.memmap]:
    """The ledger file's two parts: [sent, done of postprocessing instance 0, 1, ...] and
    the tickets, one byte each (0 while the piece is on its way, 1 once sent on)."""
    return (np.memmap(path, dtype=np.uint64, mode="r+", shape=(1 + DONE_SLOTS,)),
            np.memmap(path, dtype=np.uint8, mode="r+", offset=TICKETS_OFFSET, shape=(TICKETS,)))


class PieceLedger:
    """The engine's side: counts pieces sent, reads pieces done, waits for room."""

    def __init__(self, ledger_id: int, window: int, max_wait_s: float, stall_s: float):
        self.id = ledger_id
        self.path = path = ledger_path(ledger_id)
        self.window = window
        self.max_wait_s = max_wait_s
        self.stall_s = stall_s
        with open(path, "xb") as file:  # a new file: never another engine's ledger
            file.write(bytes(LEDGER_BYTES))
        self._counters, self._marks = map_ledger(path)
        self._free_tickets = list(range(TICKETS - 1, -1, -1))
        self._base = 0  # pieces written off as lost (see wait_for_room)
        self.waits = 0
        self._samples: deque[tuple[float, int]] = deque()  # (time, answered), for drain_s

    @classmethod
    def create(cls, window: int | None = None, max_wait_s: float | None = None,
               stall_s: float | None = None) -> PieceLedger | None:
        """A new ledger under a random id, or None where shared memory is not available.
        `window`, `max_wait_s` and `stall_s` default to window_setting(), max_wait_setting()
        and stall_setting() (the stall never longer than the whole wait)."""
        window = window_setting() if window is None else window
        max_wait_s = max_wait_setting() if max_wait_s is None else max_wait_s
        stall_s = min(stall_setting() if stall_s is None else stall_s, max_wait_s)
        for _ in range(8):  # an id already taken (FileExistsError): draw another
            try:
                return cls(1 + secrets.randbelow(2**31 - 2), window, max_wait_s, stall_s)
            except FileExistsError:
                continue
            except OSError:
                return None
        return None

    @property
    def in_flight(self) -> int:
        return int(self._counters[0]) - max(self.answered, self._base)

    @property
    def answered(self) -> int:
        """The pieces postprocessing has answered so far (its side of the ledger)."""
        return int(self._counters[1:].sum())

    def count_sent(self, pieces: int = 1) -> None:
        self._counters[0] += pieces

    def take_ticket(self) -> int:
        """A free ticket, marked unanswered, for a piece about to be sent; -1 when none is free."""
        if not self._free_tickets:
            return -1
        ticket = self._free_tickets.pop()
        self._marks[ticket] = 0
        return ticket

    def answered_tickets(self, tickets: np.ndarray) -> np.ndarray:
        """Which of these tickets postprocessing has marked (a bool array like `tickets`)."""
        return self._marks[tickets] != 0

    def release_ticket(self, ticket: int) -> None:
        """Give back a ticket whose piece was answered (never one written off: a late mark
        would then answer the next piece that takes it)."""
        self._free_tickets.append(ticket)

    def wait_for_room(self, sleep_s: float = 0.0002) -> None:
        """Return once at most `window` pieces are in between, after `max_wait_s`, or when
        `done` has not moved for `stall_s`. When `done` did not move during the whole wait,
        the pieces still counted in between are written off (they will not be answered:
        e.g. their client went away)."""
        if self.in_flight <= self.window:
            return
        start = progress_at = time.monotonic()
        done_at_start = last_done = self.answered
        self.waits += 1
        while self.in_flight > self.window:
            now = time.monotonic()
            done = self.answered
            if done != last_done:
                last_done, progress_at = done, now
            if now - start >= self.max_wait_s or now - progress_at >= self.stall_s:
                if done == done_at_start:
                    self._base = int(self._counters[0])
                break
            time.sleep(sleep_s)

    def drain_s(self, now: float | None = None, span_s: float = 1.0) -> float:
        """Seconds until the pieces now in between are answered, at the rate postprocessing
        answered them over the last `span_s` (sampled at each call); 0 while in between is
        empty or no rate is known yet (fewer than 50 ms of samples, or no answer in them)."""
        now = time.monotonic() if now is None else now
        answered = self.answered
        samples = self._samples
        samples.append((now, answered))
        while len(samples) > 2 and now - samples[1][0] >= span_s:
            samples.popleft()
        in_flight = self.in_flight
        then, answered_then = samples[0]
        if in_flight <= 0 or now - then < 0.05 or answered <= answered_then:
            return 0.0
        return in_flight * (now - then) / (answered - answered_then)

    def close(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def done_slot(instance_name: str) -> int:
    """The done counter of a postprocessing instance named by Triton (`postprocessing_0_3`:
    group 0, instance 3): its instance index modulo DONE_SLOTS (0 where the name has none)."""
    tail = instance_name.rsplit("_", 1)[-1]
    return int(tail) % DONE_SLOTS if tail.isdigit() else 0


class PieceCounter:
    """Postprocessing's side: counts the pieces it has answered, per engine ledger, in the
    done counter `slot` (done_slot(): one of its own for each instance)."""

    MAX_LEDGERS = 64

    def __init__(self, slot: int = 0):
        if not 0 <= slot < DONE_SLOTS:
            raise ValueError(f"done slot {slot}: allowed 0 to {DONE_SLOTS - 1}")
        self.slot = slot
        self._open: dict[int, tuple[np.memmap, np.memmap] | None] = {}

    def count_done(self, ledger_id: int, pieces: int = 1, ticket: int = -1) -> None:
        """Count `pieces` answered in the ledger with this id and mark `ticket` (when one,
        0 to TICKETS - 1); ignored when there is no such ledger: an engine without
        /dev/shm, a direct client's made-up id. Called once the piece has been sent on, so
        that the engine sends the stream's next piece only after it (ResponseSender)."""
        opened = self._open.get(ledger_id, False)
        if opened is False:
            opened = None
            if ledger_id > 0:
                try:
                    path = ledger_path(ledger_id)
                    if path.stat().st_size == LEDGER_BYTES:
                        opened = map_ledger(path)
                except (OSError, ValueError):
                    opened = None
            if len(self._open) >= self.MAX_LEDGERS:
                self._open.pop(next(iter(self._open)))
            self._open[ledger_id] = opened
        if opened is not None:
            counters, marks = opened
            counters[1 + self.slot] += pieces
            if 0 <= ticket < TICKETS:
                marks[ticket] = 1
