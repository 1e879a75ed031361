"""A per-step timeline of the engine, for finding where a serving run loses time.

With `INFLIGHTLLM_STEP_TRACE=DIR` every `Engine` appends one tab-separated line a step to
`DIR/steps-<pid>-<n>.tsv` (n: the engines of the process in creation order): when the step
began and how long it took (ms, from the first traced step), the host time of its parts
(the asynchronous loop's schedule / launch / wait / emit), the tokens it ran, the running and
waiting requests after it, the requests added since the step before and the outputs it
returned, and the step's start on the process's monotonic clock (`clock_s`, seconds of
`time.perf_counter()`). Comparing the engine alone (`LLM.generate`) with the engine under
tritonserver shows whether requests arrive late, steps run smaller or the loop waits between
steps.

Under the server the response sender (inflightllm/serving/engine_loop.py) writes
`DIR/sender-<pid>-<n>.tsv` beside it, one line a round (SENDER_FIELDS): when the round began
(`clock_s`, the same clock), how long it waited for postprocessing (the piece ledger's
backpressure), the pieces in between and answered then, the responses it sent and how long
sending them took, and the pieces answered by its end. With the step trace it shows whether
the sends or postprocessing's answers set the pace after the last step; `held`: the
requests whose pieces the round kept for their final one (ResponseSender, "holding near the end").
Off unless the variable is set; the files are line-buffered, so a killed server leaves
every line written.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

FIELDS = ("start_ms", "dur_ms", "gap_ms", "schedule_ms", "launch_ms", "wait_ms", "emit_ms",
          "tokens", "running", "waiting", "added", "outputs", "clock_s")
SENDER_FIELDS = ("clock_s", "wait_ms", "in_flight", "answered", "items", "responses", "outputs", "finals",
                 "send_ms", "answered_after", "held")
_COUNTER = itertools.count()
_SENDER_COUNTER = itertools.count()


def trace_path(kind: str, counter: itertools.count) -> Path | None:
    """`<INFLIGHTLLM_STEP_TRACE>/<kind>-<pid>-<n>.tsv` (n from `counter`: this kind's writers in
    the process), or None when the variable names no folder (no trace)."""
    folder = os.environ.get("INFLIGHTLLM_STEP_TRACE", "").strip()
    return Path(folder) / f"{kind}-{os.getpid()}-{next(counter)}.tsv" if folder else None


def open_trace(path: Path, fields: tuple[str, ...]):
    """A new line-buffered TSV file at `path` with its header line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with its writer
    file.write("\t".join(fields) + "\n")
    return file


class StepTrace:
    def __init__(self, path: Path):
        self.path = path
        self._file = open_trace(path, FIELDS)
        self._origin: float | None = None
        self._last_end: float | None = None
        self._host = {}
        self.added = 0

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = trace_path("steps", _COUNTER)
        return None if path is None else cls(path)

    def begin(self, host_seconds: dict) -> float:
        self._host = dict(host_seconds)
        return time.perf_counter()

    def end(self, started: float, host_seconds: dict, tokens: int, running: int, waiting: int, outputs: int) -> None:
        ended = time.perf_counter()
        if self._origin is None:
            self._origin = started
        gap = 0.0 if self._last_end is None else (started - self._last_end) * 1e3
        self._last_end = ended
        parts = [(host_seconds.get(k, 0.0) - self._host.get(k, 0.0)) * 1e3 for k in ("schedule", "launch", "wait", "emit")]
        values = [(started - self._origin) * 1e3, (ended - started) * 1e3, gap, *parts]
        self._file.write("\t".join(f"{v:.3f}" for v in values)
                         + f"\t{tokens}\t{running}\t{waiting}\t{self.added}\t{outputs}\t{started:.6f}\n")
        self.added = 0

    def close(self) -> None:
        self._file.close()


class SenderTrace:
    """The response sender's rounds (SENDER_FIELDS), one line each."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open_trace(path, SENDER_FIELDS)

    @classmethod
    def from_env(cls) -> SenderTrace | None:
        path = trace_path("sender", _SENDER_COUNTER)
        return None if path is None else cls(path)

    def round(self, began: float, waited_s: float, in_flight: int, answered: int, items: int, responses: int,
              outputs: int, finals: int, send_s: float, answered_after: int, held: int = 0) -> None:
        self._file.write(f"{began:.6f}\t{waited_s * 1e3:.3f}\t{in_flight}\t{answered}\t{items}\t{responses}"
                         f"\t{outputs}\t{finals}\t{send_s * 1e3:.3f}\t{answered_after}\t{held}\n")

    def close(self) -> None:
        self._file.close()
