"""Backpressure from postprocessing to the engine: how many streamed pieces are in between.

Inside the ensemble every engine response is a piece that tritonserver queues for the one
postprocessing instance, which handles the pieces one after another (~1,500-2,000 a
second, docs/PERFORMANCE.md). Triton gives the engine no sign of that queue: `send`
returns once the server has taken the response. So an engine whose sender keeps up sends
a piece per stream per step, the queue behind postprocessing grows, and every token
reaches its client late; coalescing, which would have carried the same tokens in fewer
pieces, never happens because the sender itself is never behind.

The ledger is that sign. Each engine instance owns a 16-byte file in /dev/shm, named by
its process id, with two counters: pieces sent (written by the engine only) and pieces
done (written by postprocessing only: it is one instance). The engine puts its process id
in each packed response (`inflightllm.packed_outputs`); postprocessing counts the pieces
it has answered in that engine's ledger. The engine's response sender waits, before each
round, while more than `window` pieces are in between: its outputs queue meanwhile and go
out coalesced. An idle server never waits. The wait is bounded (`max_wait_s`), and a
ledger whose `done` stops moving is re-based, so pieces that never reach postprocessing
(a client that went away) cannot stall the engine. Where /dev/shm is missing, or the file
cannot be made, there is no ledger and no backpressure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
PREFIX = "inflightllm-pieces-"


def ledger_path(pid: int) -> Path:
    return SHM_DIR / f"{PREFIX}{int(pid)}"


class PieceLedger:
    """The engine's side: counts pieces sent, reads pieces done, waits for room."""

    def __init__(self, path: Path, window: int, max_wait_s: float):
        self.path = path
        self.window = window
        self.max_wait_s = max_wait_s
        self._counters = np.memmap(path, dtype=np.uint64, mode="w+", shape=(2,))  # [sent, done]
        self._counters[:] = 0
        self._base = 0  # pieces written off as lost (see wait_for_room)
        self.waits = 0
        self.seconds_waited = 0.0

    @classmethod
    def create(cls, window: int = 64, max_wait_s: float = 0.05) -> PieceLedger | None:
        """This process's ledger, or None where shared memory is not available."""
        try:
            return cls(ledger_path(os.getpid()), window, max_wait_s)
        except OSError:
            return None

    @property
    def sent(self) -> int:
        return int(self._counters[0])

    @property
    def in_flight(self) -> int:
        return int(self._counters[0]) - max(int(self._counters[1]), self._base)

    def count_sent(self, pieces: int = 1) -> None:
        self._counters[0] += pieces

    def wait_for_room(self, sleep_s: float = 0.0002) -> None:
        """Return once at most `window` pieces are in between, or after `max_wait_s`. When
        `done` did not move during a whole bounded wait, the pieces still counted in between
        are written off (they will not be answered: e.g. their client went away)."""
        if self.in_flight <= self.window:
            return
        start = time.monotonic()
        done_at_start = int(self._counters[1])
        self.waits += 1
        while self.in_flight > self.window:
            if time.monotonic() - start >= self.max_wait_s:
                if int(self._counters[1]) == done_at_start:
                    self._base = int(self._counters[0])
                break
            time.sleep(sleep_s)
        self.seconds_waited += time.monotonic() - start

    def close(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


class PieceCounter:
    """Postprocessing's side: counts the pieces it has answered, per engine process."""

    MAX_LEDGERS = 64

    def __init__(self):
        self._open: dict[int, np.memmap | None] = {}

    def count_done(self, pid: int, pieces: int = 1) -> None:
        """Count `pieces` answered for the engine with this process id (ignored when that
        engine has no ledger: another server's, a direct client's made-up id)."""
        counters = self._open.get(pid, False)
        if counters is False:
            counters = None
            if pid > 0:
                try:
                    path = ledger_path(pid)
                    if path.stat().st_size == 16:
                        counters = np.memmap(path, dtype=np.uint64, mode="r+", shape=(2,))
                except (OSError, ValueError):
                    counters = None
            if len(self._open) >= self.MAX_LEDGERS:
                self._open.pop(next(iter(self._open)))
            self._open[pid] = counters
        if counters is not None:
            counters[1] += pieces
