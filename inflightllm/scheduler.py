"""Which requests run in the next step, and with how many tokens each.

Policy only: the block manager owns blocks, the model runner owns tensors.

In-flight batching (`batching_strategy: inflight`), every step:
1. Running requests first, decodes before prefill chunks, each group oldest admission
   first: each gets the tokens it has not computed yet (1 for a decode, the rest of
   its prompt for a prefill), capped by the step's token budget `max_num_tokens` (so long prompts are prefilled in chunks over
   several steps). When the KV cache has no room, the running request with the lowest
   priority and, among those, the most recent admission is preempted (even if it was
   already scheduled in this step, never one of higher priority than the requester): its blocks are
   freed and it goes back to the head of the waiting queue, to be recomputed later.
2. Then, if nothing was preempted, waiting requests join in queue order (higher
   priority first, then arrival) while the budget, `max_batch_size` and free blocks
   allow. A request that does not fit blocks the ones behind it (no overtaking).

Static batching (`batching_strategy: static`) admits a new batch only when the running
set is empty, and runs that batch to completion: the baseline for comparisons.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from inflightllm.block_manager import BlockManager
from inflightllm.config import EngineConfig
from inflightllm.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens, so the
        step produces a next token for it."""
        request = self.request
        return request.num_computed_tokens + self.num_new_tokens == request.num_tokens + request.num_inflight


@dataclass
class SchedulerOutput:
    """What one step runs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Token-budgeted scheduler with chunked prefill, priorities and preemption."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []  # kept sorted by _queue_key
        self.running: list[Request] = []  # in admission order
        self._next_arrival = 0
        self._next_admission = 0
        self._head_seq = 0  # preempted requests go before every arrival
        self.num_preemptions = 0
        # Fraction of the KV blocks in use when the first preemption was needed (None: never).
        self.kv_usage_at_first_preemption: float | None = None

    # ---- queue ----------------------------------------------------------------------
    @staticmethod
    def _queue_key(request: Request) -> tuple[int, int]:
        return (-request.priority, request.arrival_seq)

    def add_request(self, request: Request) -> None:
        request.arrival_seq = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self._insert_waiting(request)

    def _insert_waiting(self, request: Request) -> None:
        keys = [self._queue_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._queue_key(request)), request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues (finished or aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)

    # ---- scheduling ------------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        if self.kv_usage_at_first_preemption is None:
            manager = self.block_manager
            self.kv_usage_at_first_preemption = manager.num_used_blocks / manager.num_blocks
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the head of the queue: before every waiting request of its priority.
        self._head_seq -= 1
        request.arrival_seq = self._head_seq
        self._insert_waiting(request)

    @staticmethod
    def _unschedule(output: SchedulerOutput, request: Request) -> int:
        """Drop a request already scheduled this step; returns the tokens given back."""
        for index, item in enumerate(output.scheduled):
            if item.request is request:
                del output.scheduled[index]
                return item.num_new_tokens
        return 0

    def _victim(self, candidates: list[Request]) -> Request:
        """Lowest priority first, then the most recently admitted."""
        return min(candidates, key=lambda r: (r.priority, -r.admitted_seq))

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_tokens
        manager = self.block_manager

        # Decodes first (one token each, latency-critical), then prefill chunks; within
        # each group higher priority first, then admission order.
        order = sorted(
            self.running, key=lambda r: (r.num_uncomputed_tokens() > 1, -r.priority, r.admitted_seq)
        )
        for request in order:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if request.final_pending:
                continue  # its token in flight finishes it (asynchronous scheduling)
            num_new = min(request.num_uncomputed_tokens(), budget)
            while not manager.append_slots(request, num_new):
                victim = self._victim(self.running)
                if victim.priority > request.priority:
                    victim = request  # never preempt a higher priority for a lower one
                budget += self._unschedule(output, victim)
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new

        if output.preempted:
            return output
        if self.config.batching_strategy == "static":
            if not self.running:
                self._admit_static_batch(output, budget)
            return output

        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            computed = manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - len(computed) * manager.block_size, budget)
            if not manager.can_allocate(request, computed, num_new):
                break
            self._admit(request, computed, num_new)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return output

    def _admit(self, request: Request, computed: list[int], num_new: int) -> None:
        self.waiting.remove(request)
        self.block_manager.allocate(request, computed, num_new)
        if not request.first_admitted:
            request.num_cached_tokens = request.num_computed_tokens
            request.first_admitted = True
        request.status = RequestStatus.RUNNING
        request.admitted_seq = self._next_admission
        self._next_admission += 1
        self.running.append(request)

    def _admit_static_batch(self, output: SchedulerOutput, budget: int) -> None:
        """Form a new static batch: up to max_batch_size requests, all admitted now even
        if the token budget only lets the first ones start their prefill this step."""
        manager = self.block_manager
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            computed = manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - len(computed) * manager.block_size, budget)
            if not manager.can_allocate(request, computed, num_new):
                break
            self._admit(request, computed, num_new)
            if num_new > 0:
                output.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
