"""`MessageRing`: rank 0's step messages to the tensor-parallel workers through shared memory.

Each step rank 0 sends the workers its step description. Over the gloo control group that
was two broadcasts (size, then bytes), each a TCP round trip through the kernel: ~0.3 ms of
rank 0's host time per step, and the worker could start its step only after the second
(measured on the H200 host, docs/PERFORMANCE.md). Here rank 0 writes the pickled message
into a ring of slots in a `/dev/shm` file that every worker maps, and the workers poll it:
a message costs its pickling and one copy in, one copy out.

Layout: a header (magic, slot count, slot size, number of readers), then `written` (chunks
written so far), one `read` counter per reader (chunks that reader has consumed), then
the slots. A message is one or more chunks (pickled bytes cut to the slot size); each
chunk's slot starts with its length and a last-chunk flag. The writer fills slot
`written % slots` once every reader has consumed the chunk that was there before, then
increments `written`; a reader copies slot `read % slots` out, then increments its `read`.
The writer is the only one who writes `written`, each reader the only one who writes its
`read`, and each writes the counter after the data: ordered on x86-64 (stores are seen in
program order). Where stores may be reordered (other CPU architectures), `available()`
says no and the runner keeps the gloo broadcast.

Waiting: a reader spins (yielding the CPU) for `spin_s` after its last message, then polls
with short sleeps, so a busy engine hands each step over in microseconds and an idle one
costs no CPU. The writer waits only when the ring is full (a reader behind by `slots`
chunks: a message larger than the ring, or a worker that is stuck); `stop()` (rank 0's
failure check) ends the wait with `RingClosed`.
"""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import secrets
import struct
import time
from pathlib import Path

import numpy as np

MAGIC = 0x494C4C4D52494E47  # "ILLMRING"
HEADER = struct.Struct("=QQQQ")  # magic, slots, slot_bytes, readers
CHUNK = struct.Struct("=QQ")  # payload bytes, last chunk (1) or not (0)
DEFAULT_SLOTS = 8
DEFAULT_SLOT_BYTES = 256 << 10
SHM_DIR = Path("/dev/shm")


class RingClosed(RuntimeError):
    """The ring's writer gave up waiting (`stop()` said so)."""


def available() -> bool:
    """Whether this host can use a ring (x86-64, whose stores other cores see in order, and a
    writable /dev/shm)."""
    return platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class MessageRing:
    """One writer (rank 0), `readers` readers (reader index r = rank - 1)."""

    def __init__(self, path: Path, mapping: mmap.mmap, reader: int | None, spin_s: float):
        self.path = Path(path)
        self._map = mapping
        magic, slots, slot_bytes, readers = HEADER.unpack_from(mapping, 0)
        if magic != MAGIC:
            raise ValueError(f"{path}: not an inflightllm message ring")
        self.slots, self.slot_bytes, self.readers = int(slots), int(slot_bytes), int(readers)
        counters = np.frombuffer(mapping, dtype=np.int64, count=1 + self.readers, offset=HEADER.size)
        self._written = counters[0:1]
        self._read = counters[1:]
        self._data_offset = _data_offset(self.readers)
        self.reader = reader
        self.spin_s = spin_s
        self._last_message = time.monotonic()

    # ---- creating and opening ----------------------------------------------------------
    @classmethod
    def create(cls, readers: int, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES,
               directory: Path = SHM_DIR) -> MessageRing:
        """A new ring file (the writer's end). `slot_bytes` includes a 16-byte chunk header."""
        if readers < 1 or slots < 1 or slot_bytes <= CHUNK.size:
            raise ValueError(f"message ring: readers={readers}, slots={slots}, slot_bytes={slot_bytes}")
        path = Path(directory) / f"inflightllm-tp-{os.getpid()}-{secrets.token_hex(4)}"
        size = _data_offset(readers) + slots * slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        HEADER.pack_into(mapping, 0, MAGIC, slots, slot_bytes, readers)
        return cls(path, mapping, None, 0.0)

    @classmethod
    def open(cls, path: Path | str, reader: int, spin_s: float = 0.05) -> MessageRing:
        """A reader's end of the ring at `path` (reader index 0..readers-1)."""
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        ring = cls(path, mapping, reader, spin_s)
        if not 0 <= reader < ring.readers:
            raise ValueError(f"message ring {path}: reader {reader} of {ring.readers}")
        return ring

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); idempotent."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    # ---- writing -------------------------------------------------------------------------
    def write(self, message, stop=None) -> None:
        """Pickle `message` and append it. `stop()` is asked while the ring is full; when it
        returns true the write ends with RingClosed (readers may then hold a partial message:
        the ring is unusable afterwards)."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        room = self.slot_bytes - CHUNK.size
        view = memoryview(payload)
        start = 0
        while True:
            piece = view[start : start + room]
            start += len(piece)
            last = start >= len(payload)
            self._write_chunk(piece, last, stop)
            if last:
                return

    def _write_chunk(self, piece: memoryview, last: bool, stop) -> None:
        index = int(self._written[0])
        delay = 0.0
        while int(self._read.min()) <= index - self.slots:  # the slot's last chunk not yet read by all
            if stop is not None and stop():
                raise RingClosed("message ring: the writer stopped waiting for a reader")
            delay = min(1e-3, delay + 2e-5)
            time.sleep(delay)
        offset = self._data_offset + (index % self.slots) * self.slot_bytes
        CHUNK.pack_into(self._map, offset, len(piece), 1 if last else 0)
        self._map[offset + CHUNK.size : offset + CHUNK.size + len(piece)] = piece
        self._written[0] = index + 1  # after the data (see the module's docstring)

    # ---- reading -------------------------------------------------------------------------
    def read(self):
        """The next message (blocks until it is there)."""
        parts = []
        while True:
            chunk, last = self._read_chunk()
            parts.append(chunk)
            if last:
                break
        self._last_message = time.monotonic()
        return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def _read_chunk(self) -> tuple[bytes, bool]:
        reader = self.reader
        index = int(self._read[reader])
        delay = 0.0
        while int(self._written[0]) <= index:
            if time.monotonic() - self._last_message < self.spin_s:
                time.sleep(0)  # yield: another thread or process may want the core
            else:
                delay = min(1e-3, delay + 2e-5)
                time.sleep(delay)
        offset = self._data_offset + (index % self.slots) * self.slot_bytes
        length, last = CHUNK.unpack_from(self._map, offset)
        data = bytes(self._map[offset + CHUNK.size : offset + CHUNK.size + length])
        self._read[reader] = index + 1  # after the copy: the writer may reuse the slot now
        return data, bool(last)


def _data_offset(readers: int) -> int:
    counters_end = HEADER.size + 8 * (1 + readers)
    return -(-counters_end // 128) * 128
