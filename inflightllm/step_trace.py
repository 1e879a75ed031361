"""A per-step timeline of the engine, for finding where a serving run loses time.

With `INFLIGHTLLM_STEP_TRACE=DIR` every `Engine` appends one tab-separated line a step to
`DIR/steps-<pid>-<n>.tsv` (n: the engines of the process in creation order): when the step
began and how long it took (ms, from the first traced step), the host time of its parts
(the asynchronous loop's schedule / launch / wait / emit), the tokens it ran, the running and
waiting requests after it, the requests added since the step before and the outputs it
returned. Comparing the engine alone (`LLM.generate`) with the engine under tritonserver
shows whether requests arrive late, steps run smaller or the loop waits between steps.
Off unless the variable is set; the file is line-buffered, so a killed server leaves
every step it ran.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

FIELDS = ("start_ms", "dur_ms", "gap_ms", "schedule_ms", "launch_ms", "wait_ms", "emit_ms",
          "tokens", "running", "waiting", "added", "outputs")
_COUNTER = itertools.count()


class StepTrace:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the engine
        self._file.write("\t".join(FIELDS) + "\n")
        self._origin: float | None = None
        self._last_end: float | None = None
        self._host = {}
        self.added = 0

    @classmethod
    def from_env(cls) -> StepTrace | None:
        folder = os.environ.get("INFLIGHTLLM_STEP_TRACE", "").strip()
        if not folder:
            return None
        return cls(Path(folder) / f"steps-{os.getpid()}-{next(_COUNTER)}.tsv")

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
                         + f"\t{tokens}\t{running}\t{waiting}\t{self.added}\t{outputs}\n")
        self.added = 0

    def close(self) -> None:
        self._file.close()
