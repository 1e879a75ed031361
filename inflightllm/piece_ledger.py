"""Backpressure from postprocessing to the engine: how many streamed pieces are in between.

Inside the ensemble every engine response is a piece that tritonserver queues for the one
postprocessing instance, which handles the pieces one after another (~1,500-2,000 a
second, docs/PERFORMANCE.md). Triton gives the engine no sign of that queue: `send`
returns once the server has taken the response. So an engine whose sender keeps up sends
a piece per stream per step, the queue behind postprocessing grows, and every token
reaches its client late; coalescing, which would have carried the same tokens in fewer
pieces, never happens because the sender itself is never behind.

The ledger is that sign. Each engine instance owns a 16-byte file in /dev/shm, named by
a random 31-bit id (not the process id: containers with their own process ids may share
/dev/shm), with two counters: pieces sent (written by the engine only) and pieces done
(written by postprocessing only: it is one instance). The engine puts the id in each
packed response (`inflightllm.packed_outputs`, the header's `sender`); postprocessing
counts the pieces it has answered in that ledger. The engine's response sender waits, before each
round, while more than `window` pieces are in between: its outputs queue meanwhile and go
out coalesced. An idle server never waits. The wait is bounded (`max_wait_s`), and a
ledger whose `done` stops moving is re-based, so pieces that never reach postprocessing
(a client that went away) cannot stall the engine. Where /dev/shm is missing, or the file
cannot be made, there is no ledger and no backpressure. The engine model removes its file
when it is unloaded; an engine process killed outright leaves its 16 bytes behind.

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


class PieceLedger:
    """The engine's side: counts pieces sent, reads pieces done, waits for room."""

    def __init__(self, ledger_id: int, window: int, max_wait_s: float, stall_s: float):
        self.id = ledger_id
        self.path = path = ledger_path(ledger_id)
        self.window = window
        self.max_wait_s = max_wait_s
        self.stall_s = stall_s
        with open(path, "xb") as file:  # a new file: never another engine's ledger
            file.write(bytes(16))
        self._counters = np.memmap(path, dtype=np.uint64, mode="r+", shape=(2,))  # [sent, done]
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
        return int(self._counters[1])

    def count_sent(self, pieces: int = 1) -> None:
        self._counters[0] += pieces

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


class PieceCounter:
    """Postprocessing's side: counts the pieces it has answered, per engine ledger."""

    MAX_LEDGERS = 64

    def __init__(self):
        self._open: dict[int, np.memmap | None] = {}

    def count_done(self, ledger_id: int, pieces: int = 1) -> None:
        """Count `pieces` answered in the ledger with this id (ignored when there is none:
        an engine without /dev/shm, a direct client's made-up id)."""
        counters = self._open.get(ledger_id, False)
        if counters is False:
            counters = None
            if ledger_id > 0:
                try:
                    path = ledger_path(ledger_id)
                    if path.stat().st_size == 16:
                        counters = np.memmap(path, dtype=np.uint64, mode="r+", shape=(2,))
                except (OSError, ValueError):
                    counters = None
            if len(self._open) >= self.MAX_LEDGERS:
                self._open.pop(next(iter(self._open)))
            self._open[ledger_id] = counters
        if counters is not None:
            counters[1] += pieces
