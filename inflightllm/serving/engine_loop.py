"""The background loop that owns an Engine inside the decoupled `engine` model.

`execute` (Triton's thread) only validates a request and `submit`s it with a response
sink; it returns at once. One loop thread owns the engine: it takes in new requests,
checks cancellations, runs a step, and hands the step's outputs to the sender thread
(a response per `stream_interval` tokens, the final flag on the last one). Finished and
cancelled requests' KV blocks are freed in the same step.

The sender thread builds the response tensors and sends them, off the step thread, so
the GPU is not kept waiting on Python-backend IPC. When a stream falls behind (several
outputs of one request wait in the queue), they go out coalesced as one response. There
is no timer and no minimum batch: an idle sender sends each output at once.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from inflightllm.engine import Engine, EngineStats, RequestOutput, coalesce_outputs
from inflightllm.env_settings import env_number, env_switch
from inflightllm.piece_ledger import PieceLedger
from inflightllm.sampling_params import InvalidRequestError
from inflightllm.serving.engine_io import EngineRequest, output_tensors
from inflightllm.step_trace import SenderTrace

logger = logging.getLogger(__name__)


class ResponseSink(Protocol):
    """Where one request's responses go (a Triton response sender in production)."""

    def send(self, tensors: dict[str, torch.Tensor], final: bool) -> None: ...

    def send_error(self, message: str) -> None: ...

    def is_cancelled(self) -> bool: ...


StepCallback = Callable[[EngineStats, list[RequestOutput]], None]


class EngineLoop:
    """Runs `engine.step()` on its own thread while there is work."""

    # Each admitted request's sink is asked `is_cancelled()` (an IPC round trip in Triton)
    # at most once per CANCEL_POLL_INTERVAL_S, oldest poll first, and at most
    # MAX_POLLS_PER_STEP sinks per polling round (one round every POLL_TICK_S): a bounded
    # number of round trips per second, not one per request per step (which was one per
    # generated token). The rounds run on their own thread: a round trip waits (without the
    # GIL) for the server, which is slow exactly when the server is busy streaming, and on
    # the loop thread that wait held up the GPU's next step. Cancellations through the
    # ensemble arrive as control requests (`cancel`) and are not delayed by this; Triton's
    # TensorRT-LLM backend checks cancellation every 100 ms too.
    CANCEL_POLL_INTERVAL_S = 0.1
    MAX_POLLS_PER_STEP = 64
    POLL_TICK_S = 0.01

    def __init__(self, engine: Engine, on_step: StepCallback | None = None, idle_wait_s: float = 0.5,
                 cancel_poll_interval_s: float | None = None, max_polls_per_step: int | None = None,
                 clock: Callable[[], float] = time.monotonic, piece_ledger: PieceLedger | None = None,
                 ordered_pieces: bool = False):
        """`ordered_pieces`: postprocessing runs several instances, so keep one piece of a
        stream in flight (ResponseSender; needs `piece_ledger`)."""
        self.engine = engine
        self.on_step = on_step
        self.idle_wait_s = idle_wait_s
        self.cancel_poll_interval_s = (self.CANCEL_POLL_INTERVAL_S if cancel_poll_interval_s is None
                                       else cancel_poll_interval_s)
        self.max_polls_per_step = self.MAX_POLLS_PER_STEP if max_polls_per_step is None else max_polls_per_step
        self.clock = clock
        self._inbox: deque[tuple[str, EngineRequest, ResponseSink]] = deque()
        self._cancels: deque[int] = deque()  # handles of requests to abort
        self._active: dict[str, tuple[EngineRequest, ResponseSink]] = {}
        self._wakeup = threading.Condition()
        self._stopping = False
        self._ids = itertools.count()
        # (request id, when its sink was last polled) of admitted requests, oldest poll first;
        # finished ones drop out when they reach the front.
        self._poll_ring: deque[tuple[str, float]] = deque()
        self._polled_cancels: deque[str] = deque()  # found cancelled by the poller; aborted by the loop
        self._poll_stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflightllm-engine-loop", daemon=True)
        self._poller = threading.Thread(target=self._poll, name="inflightllm-cancel-poller", daemon=True)
        self._sender = ResponseSender(self, piece_ledger, ordered=ordered_pieces)

    def start(self) -> EngineLoop:
        self._sender.start()
        self._thread.start()
        self._poller.start()
        return self

    def validate(self, request: EngineRequest) -> None:
        """Raise InvalidRequestError for a request the engine would refuse."""
        self.engine.validate_request(request.prompt_token_ids, request.params, request.priority, request.group,
                                     request.streaming)

    @staticmethod
    def request_id(handle: int) -> str:
        return f"req-{handle}"

    @staticmethod
    def handle(request_id: str) -> int:
        return int(request_id.removeprefix("req-"))

    def cancel(self, handle: int) -> None:
        """Abort the request with this handle at the next iteration; thread-safe. Unknown
        or finished handles are ignored."""
        with self._wakeup:
            self._cancels.append(handle)
            self._wakeup.notify()

    def submit(self, request: EngineRequest, sink: ResponseSink) -> str:
        """Queue a validated request; thread-safe. Returns its engine request id. Refused
        at once (an error response) when the engine is stopping or its queue is full."""
        request_id = self.request_id(next(self._ids))
        with self._wakeup:
            if self._stopping:
                sink.send_error("the engine is shutting down; request not accepted")
                return request_id
            limit = self.engine.config.max_queue_size
            waiting = len(self._inbox) + self.engine.num_waiting  # a read of a length: safe across threads
            if limit and waiting >= limit:
                self.engine.count_rejected()
                sink.send_error(
                    f"the engine's queue is full: {waiting} requests are waiting (max_queue_size {limit}); "
                    "try again later"
                )
                return request_id
            self._inbox.append((request_id, request, sink))
            self._wakeup.notify()
        return request_id

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel everything in flight (each gets its final response) and join."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._poll_stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._poller.is_alive():
            self._poller.join(timeout_s)
        self._sender.stop(timeout_s)

    @property
    def num_active(self) -> int:
        return len(self._active) + len(self._inbox) + self._sender.num_pending

    # ---- the loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._stopping and not self._inbox and not self.engine.has_unfinished():
                    self._wakeup.wait(self.idle_wait_s)
                stopping = self._stopping
                arrivals = list(self._inbox)
                self._inbox.clear()
                cancels = list(self._cancels)
                self._cancels.clear()
                polled = list(self._polled_cancels)
                self._polled_cancels.clear()
            self._admit(arrivals)
            for handle in cancels:
                self.engine.abort(self.request_id(handle))
            for request_id in polled:
                self.engine.abort(request_id)
            for request_id in self._sender.take_failed():
                self.engine.abort(request_id)
            if stopping:
                self._cancel_all()
                return
            try:
                outputs = self.engine.step()
            except Exception as error:  # keep serving: fail the requests in flight only
                logger.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(error).__name__}: {error}")
                outputs = []
            self._deliver(outputs)
            if self.on_step is not None:
                try:
                    self.on_step(self.engine.stats(), outputs)
                except Exception:
                    logger.exception("step callback failed")

    def _admit(self, arrivals) -> None:
        for request_id, request, sink in arrivals:
            try:
                cancelled = sink.is_cancelled()
            except Exception:
                cancelled = True
            if cancelled:  # cancelled before it reached the engine: it never runs
                self._safe_error(sink, "the request was cancelled before it started")
                continue
            try:
                self.engine.add_request(
                    request_id,
                    request.prompt_token_ids,
                    request.params,
                    priority=request.priority,
                    streaming=request.streaming,
                    arrival_time=request.arrival_time if request.arrival_time is not None else time.monotonic(),
                    timeout_s=request.timeout_ms / 1e3 if request.timeout_ms else None,
                    group=request.group,
                )
            except InvalidRequestError as error:
                self._safe_error(sink, str(error))
                continue
            except Exception as error:  # never let one request end the loop thread
                logger.exception("adding request %s failed", request_id)
                self._safe_error(sink, f"engine could not accept the request: {type(error).__name__}: {error}")
                continue
            self._active[request_id] = (request, sink)
            self._poll_ring.append((request_id, self.clock()))  # polled just above

    # ---- the poller thread -------------------------------------------------------------
    def _poll(self) -> None:
        """Polling rounds until stopped; the loop thread aborts what they find cancelled."""
        while not self._poll_stop.wait(self.POLL_TICK_S):
            try:
                cancelled = self._check_cancellations()
            except Exception:  # never let the poller die: the requests would not be polled again
                logger.exception("cancellation polling failed")
                continue
            if cancelled:
                with self._wakeup:
                    self._polled_cancels.extend(cancelled)
                    self._wakeup.notify()

    def _check_cancellations(self) -> list[str]:
        """Poll the sinks that are due (see CANCEL_POLL_INTERVAL_S); return the ids of the
        requests found cancelled (or whose sink raised). Reads `_active` (written by the
        loop thread: single dict reads are atomic) and owns the front of `_poll_ring`
        (the loop thread only appends admitted requests at its back)."""
        found: list[str] = []
        now = self.clock()
        ring = self._poll_ring
        polls = 0
        for _ in range(len(ring)):  # each at most once a step, whatever the interval
            request_id, polled_at = ring[0]
            if polls >= self.max_polls_per_step:
                break
            if now - polled_at < self.cancel_poll_interval_s:
                break  # the rest were polled later still
            ring.popleft()
            entry = self._active.get(request_id)
            if entry is None:
                continue  # finished: it drops out
            polls += 1
            ring.append((request_id, now))
            try:
                cancelled = entry[1].is_cancelled()
            except Exception:
                cancelled = True
            if cancelled:
                found.append(request_id)
        return found

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand the outputs to the sender thread; a finished request leaves `_active` now.
        A beam search output carries all its beams: one response with a beam dimension
        (docs/SEQUENCE-GROUPS.md)."""
        batch = []
        for output in outputs:
            entry = self._active.get(output.request_id)
            if entry is None:
                continue
            request, sink = entry
            if output.error is not None:  # this request failed alone; the others go on
                del self._active[output.request_id]
                if batch:
                    self._sender.put(batch)
                    batch = []
                self._sender.put_error(sink, output.error)
                continue
            batch.append((output, request, sink))
            if output.finished:
                del self._active[output.request_id]
        if batch:
            self._sender.put(batch)

    def _cancel_all(self) -> None:
        for request_id in list(self._active):
            self.engine.abort(request_id)
        self._deliver(self.engine.step() if self.engine.has_unfinished() else [])
        for request_id, (_, sink) in list(self._active.items()):
            self._sender.put_error(sink, "the engine is shutting down")
            del self._active[request_id]

    def _fail_all(self, message: str) -> None:
        for request_id, (_, sink) in list(self._active.items()):
            self.engine.abort(request_id)
            self._sender.put_error(sink, message)
        self._active.clear()
        if self.engine.has_unfinished():
            self.engine.step()  # drains the aborted requests' final outputs (nobody to send them to)

    @staticmethod
    def _safe_error(sink: ResponseSink, message: str) -> None:
        try:
            sink.send_error(message)
        except Exception:
            logger.exception("sending an error response failed")


SENDER_HOLD_ENV = "INFLIGHTLLM_SENDER_HOLD"  # 0: no holding near the end (ResponseSender)
# A stream's piece whose ticket postprocessing has not marked in this long is written off: the
# stream's next piece goes without waiting for it (its ticket is never reused).
TICKET_WRITE_OFF_S = 10.0
# While pieces wait for an earlier piece's answer, the sender looks for answers this often.
ANSWER_POLL_S = 0.001
SENDER_YIELD_ENV = "INFLIGHTLLM_SENDER_YIELD_US"
# Off by default. 200 raised stream=true through Triton on the H200 by about 4 % (0.84-0.89x
# to 0.88-0.95x of engine-only), but with any pause Triton 2.51 intermittently kept the
# ensemble "live" at shutdown, which then waited its whole exit timeout (30 s) (docs/GPU-ENGINE.md).
SENDER_YIELD_US = 0


def sender_yield_s() -> float:
    """Seconds the sender sleeps between two responses of a round: INFLIGHTLLM_SENDER_YIELD_US
    (microseconds), else SENDER_YIELD_US (0: no pause)."""
    return env_number(SENDER_YIELD_ENV, SENDER_YIELD_US, 0, 10000, "microseconds") / 1e6


SWITCH_INTERVAL_ENV = "INFLIGHTLLM_SWITCH_INTERVAL_US"


def apply_switch_interval() -> float | None:
    """Set Python's thread switch interval to INFLIGHTLLM_SWITCH_INTERVAL_US (50 to 100000
    microseconds) when it is set; returns the interval set (seconds) or None. A thread that
    wants the GIL back (the sender after each send) waits for the holder (the loop thread)
    to drop it, at most this long (Python's default: 5 ms)."""
    if not os.environ.get(SWITCH_INTERVAL_ENV, "").strip():
        return None
    interval = env_number(SWITCH_INTERVAL_ENV, 5000, 50, 100000, "microseconds") / 1e6
    sys.setswitchinterval(interval)
    logger.info("Python's thread switch interval set to %.0f us", interval * 1e6)
    return interval


class ResponseSender:
    """The thread that turns outputs into responses and sends them.

    Items are queued per step; a request's pending outputs are merged into one response
    when more than one waits (the stream fell behind). Errors keep their place in the
    order. A send that raises marks the request failed; the loop thread aborts it.

    Holding near the end: while postprocessing is behind, a piece sent now is answered only
    once the pieces already in between are (the ledger's `drain_s`). A streaming request
    that will have finished by then (its tokens left to `max_tokens`, at the recent time
    between steps) gains nothing from a piece now: its outputs are kept and go out with its
    final one, one piece instead of several, and the queue in front of the finals is shorter.
    With 1,024 streams that end in one step the finals then wait behind fewer pieces. Never
    past the time a piece sent when the holding began would have been answered (a preempted
    request may end later than its tokens left say): then what is kept goes out. Single
    sequences only (not n, best_of or beams); an error for the request, a round with no
    backlog, or the sender stopping sends what is kept. INFLIGHTLLM_SENDER_HOLD=0 turns it
    off (measurements).

    One piece of a stream in flight (`ordered`: postprocessing runs several instances): a
    packed piece (the ensemble's) goes out with a ticket in the ledger, which postprocessing
    marks once it has sent the piece on; the stream's next piece waits (its outputs coalesce)
    until then, and a request's final piece until every piece of the request is marked. So
    several postprocessing instances, each taking pieces as they come, still deliver a
    stream's pieces in order (`instances.postprocessing`, docs/INTERFACE.md). A ticket
    unmarked for TICKET_WRITE_OFF_S is written off.

    With `yield_s` the sender sleeps that long after each response but a round's last,
    which releases the GIL: a loop thread waiting for it takes it then, instead of after
    Python's switch interval (5 ms).
    """

    def __init__(self, loop: EngineLoop, ledger: PieceLedger | None = None, yield_s: float | None = None,
                 ordered: bool = False):
        self.loop = loop
        self.yield_s = sender_yield_s() if yield_s is None else yield_s
        if self.yield_s:
            logger.info("the response sender sleeps %.0f us between responses", self.yield_s * 1e6)
        # Backpressure from postprocessing (inflightllm/piece_ledger.py): before each round the
        # sender waits, bounded, while too many of its packed pieces are still unanswered.
        self.ledger = ledger
        self.ledger_id = ledger.id if ledger is not None else 0
        self._queue: deque = deque()  # ("outputs", [(output, request, sink)]) | ("error", sink, message)
        self._failed: deque[str] = deque()
        self._condition = threading.Condition()
        self._stopping = False
        self._busy = 0
        self._thread = threading.Thread(target=self._run, name="inflightllm-response-sender", daemon=True)
        self.responses_sent = 0
        self.outputs_coalesced = 0
        # Holding near the end (above): key -> [outputs, request, sink] kept for a later round.
        self.hold = env_switch(SENDER_HOLD_ENV)
        self._held: dict = {}
        # key -> when the held outputs would have been answered had they been sent when first
        # held (that round's clock + drain): past it they go, whatever the request's end.
        self._held_until: dict = {}
        self._last_put: float | None = None
        self._step_s = 0.0  # the time between two steps' outputs, smoothed
        self.rounds_held = 0  # requests kept by a round, summed over rounds
        # One piece of a stream in flight (above): ticket -> (request id, key, sent at); a
        # key's ticket still unmarked; how many of a request's tickets are still unmarked.
        self.ordered = ordered and ledger is not None
        self._tickets: dict[int, tuple[str, object, float]] = {}
        self._key_ticket: dict = {}
        self._request_tickets: dict[str, int] = {}
        # Outputs waiting for an answer: key -> [outputs, request, sink] (their new outputs join
        # them), and a request's waiting keys; a round looks only at those an answer released.
        self._waiting: dict = {}
        self._waiting_keys: dict[str, set] = {}
        self._answered_seen = -1
        self._last_write_off = 0.0
        self.pieces_waited = 0  # times a stream's outputs began to wait for its previous piece's answer
        self.tickets_written_off = 0
        # INFLIGHTLLM_STEP_TRACE: one line a round (inflightllm/step_trace.py's SenderTrace)
        self._trace = SenderTrace.from_env()

    def start(self) -> None:
        self._thread.start()

    def put(self, batch) -> None:
        now = time.monotonic()
        if self._last_put is not None:  # the loop thread's calls only: one a step
            gap = min(now - self._last_put, 1.0)
            self._step_s = gap if not self._step_s else 0.8 * self._step_s + 0.2 * gap
        self._last_put = now
        with self._condition:
            self._queue.append(("outputs", batch))
            self._condition.notify()

    def put_error(self, sink: ResponseSink, message: str) -> None:
        with self._condition:
            self._queue.append(("error", sink, message))
            self._condition.notify()

    def take_failed(self) -> list[str]:
        failed = []
        while self._failed:
            failed.append(self._failed.popleft())
        return failed

    @property
    def num_pending(self) -> int:
        return len(self._queue) + self._busy + len(self._held) + len(self._waiting)

    def stop(self, timeout_s: float) -> None:
        """Send everything queued, then end the thread."""
        with self._condition:
            self._stopping = True
            self._condition.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                with self._condition:
                    while not self._queue and not self._stopping:
                        if not self._waiting:
                            self._condition.wait()
                            continue
                        # Pieces wait for an earlier piece's answer: a round once one comes.
                        self._condition.wait(ANSWER_POLL_S)
                        if self._queue or self._stopping or self._answers_moved():
                            break
                    if not self._queue and self._stopping and not self._held and not self._waiting:
                        return
                trace = self._trace
                if trace is not None:
                    began = time.perf_counter()
                    in_flight, answered = (self.ledger.in_flight, self.ledger.answered) if self.ledger else (0, 0)
                horizon_s = 0.0
                if self.ledger is not None and not self._stopping:
                    self.ledger.wait_for_room()  # meanwhile outputs queue up: they go out coalesced
                    if self.hold:
                        horizon_s = self.ledger.drain_s()
                with self._condition:
                    items = list(self._queue)
                    self._queue.clear()
                    self._busy = len(items)  # counted down as each response is handed over
                if trace is not None:
                    sending = time.perf_counter()
                    sent_before = self.responses_sent
                try:
                    self._send_all(items, horizon_s)
                finally:
                    self._busy = 0
                if trace is not None:
                    batches = [item[1] for item in items if item[0] == "outputs"]
                    trace.round(began, sending - began, in_flight, answered, len(items),
                                self.responses_sent - sent_before, sum(len(batch) for batch in batches),
                                sum(1 for batch in batches for output, _, _ in batch if output.finished),
                                time.perf_counter() - sending, self.ledger.answered if self.ledger else 0,
                                len(self._held))
        finally:
            if self._trace is not None:
                self._trace.close()

    def _answers_moved(self) -> bool:
        """Whether postprocessing answered anything since the last round looked (or a
        waiting piece's ticket is due to be written off)."""
        answered = self.ledger.answered if self.ledger is not None else 0
        return (answered != self._answered_seen
                or time.monotonic() - self._last_write_off >= TICKET_WRITE_OFF_S / 10)

    def _collect_answers(self, now: float) -> set[str]:
        """Release the tickets postprocessing has marked; write off those unmarked for
        TICKET_WRITE_OFF_S (looked at every tenth of that). Returns the requests that had a
        ticket answered or written off: their waiting outputs may go now."""
        ledger = self.ledger
        self._answered_seen = ledger.answered
        requests: set[str] = set()
        if not self._tickets:
            return requests
        ids = np.fromiter(self._tickets, dtype=np.int64, count=len(self._tickets))
        for ticket in ids[ledger.answered_tickets(ids)].tolist():
            requests.add(self._forget_ticket(ticket))
            ledger.release_ticket(ticket)
        if now - self._last_write_off >= TICKET_WRITE_OFF_S / 10:
            self._last_write_off = now
            stale = [ticket for ticket, (_, _, sent) in self._tickets.items() if now - sent >= TICKET_WRITE_OFF_S]
            for ticket in stale:  # never released: a late mark must not answer another piece
                requests.add(self._forget_ticket(ticket))
            if stale:
                self.tickets_written_off += len(stale)
                logger.warning("%d piece(s) unanswered by postprocessing for %.0f s: their streams go on without them",
                               len(stale), TICKET_WRITE_OFF_S)
        return requests

    def _forget_ticket(self, ticket: int) -> str:
        request_id, key, _ = self._tickets.pop(ticket)
        if self._key_ticket.get(key) == ticket:
            del self._key_ticket[key]
        left = self._request_tickets.get(request_id, 0) - 1
        if left > 0:
            self._request_tickets[request_id] = left
        else:
            self._request_tickets.pop(request_id, None)
        return request_id

    def _release_waiting(self, request_ids) -> list:
        """Take these requests' waiting keys out of waiting (they are looked at again)."""
        keys = []
        for request_id in request_ids:
            for key in self._waiting_keys.pop(request_id, ()):
                keys.append((key, self._waiting.pop(key)))
        return keys

    def _wait(self, key, entry) -> None:
        self._waiting[key] = entry
        self._waiting_keys.setdefault(entry[0][-1].request_id, set()).add(key)
        self.pieces_waited += 1

    def _waits_for_answer(self, key, entry, erred: set[int]) -> bool:
        """Whether this stream's outputs wait for an earlier piece's answer (the class docstring)."""
        outputs, request, sink = entry
        if not (self.ordered and request.packed_outputs) or self._stopping or id(sink) in erred:
            return False
        if key in self._key_ticket:
            return True
        return outputs[-1].finished and self._request_tickets.get(outputs[-1].request_id, 0) > 0

    def _holds(self, entry, horizon_s: float, erred: set[int]) -> bool:
        """Whether this request's outputs wait for its final one (the class docstring)."""
        outputs, request, sink = entry
        last = outputs[-1]
        if (last.finished or last.sequence_finished is not None or last.beam_token_ids is not None
                or request.group is not None or not request.streaming or id(sink) in erred):
            return False
        left = request.params.max_tokens - last.num_output_tokens
        return 0 < left and left * self._step_s <= horizon_s

    def _send_all(self, items, horizon_s: float = 0.0, now: float | None = None) -> None:
        # Merge each request's outputs across the queued steps; keep first-seen order. The
        # outputs of one request with several (n, beams) merge per sequence, never across.
        # What earlier rounds held comes first, merged with the request's newer outputs.
        merged: dict = self._held
        deadlines = self._held_until
        self._held, self._held_until = {}, {}
        now = time.monotonic() if now is None else now
        if self._waiting or self._tickets:  # outputs an answer (or the sender stopping) lets go
            answered = self._collect_answers(now) if self.ledger is not None else set()
            released = self._release_waiting(list(self._waiting_keys) if self._stopping else answered)
            for key, entry in released:
                merged[key] = entry
        order: list = [("request", key) for key in merged]
        finals = False
        erred: set[int] = set()  # id() of sinks with an error in this round: nothing of theirs is held
        for item in items:
            if item[0] == "error":
                sink_id = id(item[1])
                waiting = {entry[0][-1].request_id for entry in self._waiting.values() if id(entry[2]) == sink_id}
                for key, entry in self._release_waiting(waiting):  # what waited goes before the error
                    merged[key] = entry
                    order.append(("request", key))
                order.append(item)
                erred.add(sink_id)
                continue
            for output, request, sink in item[1]:
                key = output.request_id if not output.sequence_index else (output.request_id, output.sequence_index)
                waiting = self._waiting.get(key)
                if waiting is not None:  # it waits on: its outputs join what waits
                    waiting[0].append(output)
                    continue
                entry = merged.get(key)
                if entry is None:
                    entry = [[output], request, sink]
                    merged[key] = entry
                    order.append(("request", key))
                else:
                    entry[0].append(output)
                finals = finals or (output.finished and output.sequence_finished is not None)
        if finals:  # a request's final response goes after its other sequences' responses
            order.sort(key=lambda item: item[0] == "request" and merged[item[1]][0][-1].finished)
        if horizon_s > 0.0 and self._step_s > 0.0:
            kept = [item for item in order if item[0] == "request" and now < deadlines.get(item[1], float("inf"))
                    and self._holds(merged[item[1]], horizon_s, erred)]
            if kept:
                for item in kept:
                    self._held[item[1]] = merged[item[1]]
                    self._held_until[item[1]] = deadlines.get(item[1], now + horizon_s)
                self.rounds_held += len(kept)
                order = [item for item in order if not (item[0] == "request" and item[1] in self._held)]
        self._busy = len(order)
        pause = self.yield_s
        for index, item in enumerate(order):
            if pause and index:
                time.sleep(pause)
            self._busy -= 1
            if item[0] == "error":
                EngineLoop._safe_error(item[1], item[2])
                continue
            key = item[1]
            entry = merged[key]
            if self._waits_for_answer(key, entry, erred):
                self._wait(key, entry)
                continue
            outputs, request, sink = entry
            output = outputs[0] if len(outputs) == 1 else coalesce_outputs(outputs)
            self.outputs_coalesced += len(outputs) - 1
            ticket = -1
            if self.ordered and request.packed_outputs:
                ticket = self.ledger.take_ticket()  # -1 when none is free: sent without
            try:
                tensors = output_tensors(output, request, EngineLoop.handle(output.request_id), self.ledger_id, ticket)
                sink.send(tensors, final=output.finished)
                self.responses_sent += 1
                if request.packed_outputs and self.ledger is not None:
                    self.ledger.count_sent()
                    if ticket >= 0:
                        self._tickets[ticket] = (output.request_id, key, now)
                        self._key_ticket[key] = ticket
                        self._request_tickets[output.request_id] = self._request_tickets.get(output.request_id, 0) + 1
            except Exception:
                if ticket >= 0 and ticket not in self._tickets:  # not sent: nobody will mark it
                    self.ledger.release_ticket(ticket)
                logger.exception("sending a response failed; cancelling request %s", output.request_id)
                if not output.finished:
                    self._failed.append(output.request_id)
                    with self.loop._wakeup:
                        self.loop._wakeup.notify()
