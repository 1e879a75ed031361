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
   allow. A request that does not fit blocks the ones behind it (no overtaking), unless
   running requests of lower priority than it exist: the lowest of them is preempted
   to make room (so a flood of low-priority work does not delay a high-priority one).

Capacity policies (`capacity_policy`, docs/KV-PRESSURE.md):
- `max_utilization` (the default): admission takes what fits now, keeping
  `kv_watermark` of the blocks free while other requests run (vLLM's watermark: a decode
  step right after an admission does not preempt at once); the running requests grow
  into the rest, and preemption (above) frees blocks when they run out.
- `guaranteed_no_evict` (TensorRT-LLM's GUARANTEED_NO_EVICT): every running request (a
  sequence group as one: the shared prompt counted once, each sequence's tail and its
  copy-on-write copy apart) is guaranteed the blocks of its prompt + max_tokens; a waiting
  request is admitted only when its own worst case, less the prefix-cache blocks others
  already hold, fits in the free blocks beside those guarantees. A running request is
  never preempted (not for a higher priority either); a request that does not fit waits.

Static batching (`batching_strategy: static`) admits a new batch only when the running
set is empty, and runs that batch to completion: the baseline for comparisons.

Preemption modes: `recompute` frees a victim's blocks and recomputes its tokens later
(from the prefix cache, as far as its freed blocks are still cached); `swap` copies its
computed blocks to host memory (the runner's attention backend does the copies, before
the step's forward) and copies them back into fresh blocks on readmission, falling back
to recompute when the host pool is full; `auto` chooses per victim by the
measured costs (inflightllm.kv_pressure.PreemptionCostModel): swap when copying its full
computed blocks out and back is cheaper than computing their tokens again.

Sequence groups (several outputs of one request, inflightllm.sequence_group) move as a
whole: a group's first sequence is admitted only with room in the batch for all its
sequences; preempting one sequence preempts the group's running sequences; the group's
waiting sequences are admitted together or not at all, their blocks counted once where
the prefix cache shares them. A first sequence with `fork_at` computes only that many
tokens (the engine then forks the group).

Bookkeeping is constant-cost per request: the waiting queue is one insertion-ordered
map per priority level (push, push-to-head, remove by id and peek are O(1)), and
requests are compared by identity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter

from inflightllm.block_manager import BlockManager
from inflightllm.config import EngineConfig
from inflightllm.kv_pressure import PreemptionCostModel
from inflightllm.request import Request, RequestStatus

_priority = attrgetter("priority")


@dataclass(slots=True)
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
    # swap mode: (request, device block ids to copy to host) for victims swapped out this
    # step, and (request, fresh block ids to copy back into) for requests swapped in.
    swapped_out: list[tuple[Request, list[int]]] = field(default_factory=list)
    swapped_in: list[tuple[Request, list[int]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """Waiting requests in scheduling order: higher priority first, then queue order.

    One insertion-ordered map (request id -> request) per priority level: append, push to
    the head, remove and peek cost O(1) whatever the queue's depth."""

    def __init__(self):
        self._levels: dict[int, OrderedDict[str, Request]] = {}
        self._priorities: list[int] = []  # levels present, highest first
        self._count = 0

    def _level(self, priority: int) -> OrderedDict[str, Request]:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = OrderedDict()
            self._priorities = sorted(self._levels, reverse=True)
        return level

    def append(self, request: Request) -> None:
        self._level(request.priority)[request.request_id] = request
        self._count += 1

    def push_front(self, request: Request) -> None:
        level = self._level(request.priority)
        level[request.request_id] = request
        level.move_to_end(request.request_id, last=False)
        self._count += 1

    def remove(self, request: Request) -> bool:
        level = self._levels.get(request.priority)
        if level is None or level.get(request.request_id) is not request:
            return False
        del level[request.request_id]
        self._count -= 1
        return True

    def __contains__(self, request: Request) -> bool:
        level = self._levels.get(request.priority)
        return level is not None and level.get(request.request_id) is request

    def peek(self) -> Request:
        for priority in self._priorities:
            level = self._levels[priority]
            if level:
                return next(iter(level.values()))
        raise IndexError("the waiting queue is empty")

    def __getitem__(self, index: int) -> Request:
        if index == 0:
            return self.peek()
        for position, request in enumerate(self):
            if position == index:
                return request
        raise IndexError(index)

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Request]:
        for priority in self._priorities:
            yield from list(self._levels[priority].values())


class Scheduler:
    """Token-budgeted scheduler with chunked prefill, priorities and preemption."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 costs: PreemptionCostModel | None = None):
        """`costs`: what `preemption_mode: auto` decides by (the engine's, fed with its step
        timings and the runner's host link); None: auto recomputes."""
        self.config = config
        self.block_manager = block_manager
        self.costs = costs
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # in admission order (at most max_batch_size)
        self._next_arrival = 0
        self._next_admission = 0
        self.num_preemptions = 0
        # Fraction of the KV blocks in use when the first preemption was needed (None: never).
        self.kv_usage_at_first_preemption: float | None = None
        self.num_swapped_out = 0  # preemptions that swapped (the others recompute)
        # Tokens computed again after a preemption: those it had computed less those it got
        # back (swapped in, or found in the prefix cache) on readmission.
        self.num_recomputed_tokens = 0
        self.swap_space_blocks = 0
        if config.preemption_mode in ("swap", "auto"):
            self.swap_space_blocks = config.swap_space_blocks or block_manager.num_blocks
        self.num_free_swap_blocks = self.swap_space_blocks
        self.no_evict = config.capacity_policy == "guaranteed_no_evict"
        # max_utilization: blocks an admission leaves free while others run (vLLM rounds down too).
        self.watermark_blocks = 0 if self.no_evict else int(config.kv_watermark * block_manager.num_blocks)
        self._outstanding = 0  # guaranteed_no_evict: running units' reservations not yet held (per step)

    # ---- queue ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.arrival_seq = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues (finished or aborted) and free its blocks
        (and its host-memory blocks if it was swapped out)."""
        if not self.waiting.remove(request) and request in self.running:
            self.running.remove(request)  # identity comparison; at most max_batch_size entries
        self.block_manager.free(request)
        self._release_swap(request)

    def _release_swap(self, request: Request) -> None:
        self.num_free_swap_blocks += request.num_swapped_blocks
        request.num_swapped_blocks = 0

    # ---- scheduling ------------------------------------------------------------------
    def _preempt_group(self, victim: Request, output: SchedulerOutput) -> int:
        """Preempt the victim, and the other running sequences of its group; returns the
        step tokens given back by unscheduling them."""
        members = [victim]
        if victim.group is not None:
            members += [r for r in victim.group.sequences if r is not victim and r.status is RequestStatus.RUNNING]
        tokens = 0
        for member in members:
            tokens += self._unschedule(output, member)
            self._preempt(member, output)
        return tokens

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        if self.kv_usage_at_first_preemption is None:
            manager = self.block_manager
            self.kv_usage_at_first_preemption = manager.num_used_blocks / manager.num_blocks
        self.running.remove(request)
        request.num_computed_before_preemption = request.num_computed_tokens
        num_swap = request.num_computed_tokens // self.block_manager.block_size  # full computed blocks
        if self.swap_space_blocks and 0 < num_swap <= self.num_free_swap_blocks and self._swaps(request, num_swap):
            # Keep the K/V of its full computed blocks: the runner copies them to host memory
            # before this step's forward overwrites anything.
            output.swapped_out.append((request, list(request.block_table[:num_swap])))
            self.num_free_swap_blocks -= num_swap
            request.num_swapped_blocks = num_swap
            request.num_computed_tokens = num_swap * self.block_manager.block_size
            self.num_swapped_out += 1
        else:
            request.num_computed_tokens = 0
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        output.preempted.append(request)
        # Back to the head of the queue: before every waiting request of its priority.
        self.waiting.push_front(request)

    def _swaps(self, request: Request, num_swap: int) -> bool:
        """Whether a victim with `num_swap` full computed blocks is swapped (rather than
        recomputed): always in `swap` mode; in `auto`, when the measured costs say so.
        Recompute would compute again only the blocks no other running request holds (a
        block another holds stays cached and is found on readmission), unless the victim
        belongs to a group (its group's sequences are preempted with it)."""
        if self.config.preemption_mode == "swap":
            return True
        if self.costs is None:
            return False
        blocks = self.block_manager.blocks
        private = num_swap if request.group is not None else sum(
            1 for block_id in request.block_table[:num_swap] if blocks[block_id].ref_count == 1)
        return self.costs.prefers_swap(num_swap, private * self.block_manager.block_size)

    def _count_recomputed(self, request: Request) -> None:
        """Readmitted after a preemption: what it had computed but did not get back counts."""
        lost = request.num_computed_before_preemption - request.num_computed_tokens
        if lost > 0:
            self.num_recomputed_tokens += lost
        request.num_computed_before_preemption = 0

    @staticmethod
    def _unschedule(output: SchedulerOutput, request: Request) -> int:
        """Drop a request already scheduled this step; returns the tokens given back."""
        for index, item in enumerate(output.scheduled):
            if item.request is request:
                del output.scheduled[index]
                return item.num_new_tokens
        return 0

    def _victim(self, candidates: list[Request]) -> Request:
        """Lowest priority first, then the latest arrival (a request resumed after a
        preemption is not the first victim again for being readmitted last), then the
        latest admission (the sequences of one group arrived together)."""
        return min(candidates, key=lambda r: (r.priority, -r.arrival_seq, -r.admitted_seq))

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_tokens
        manager = self.block_manager

        # Decodes first (one token each, latency-critical), then prefill chunks; within
        # each group higher priority first, then admission order. `running` is in
        # admission order already (requests are appended as admitted), so a partition and
        # a stable sort by priority alone give that order: no key tuple per request per step.
        decodes: list[Request] = []
        prefills: list[Request] = []
        # Request.num_uncomputed_tokens() written out here and below: the method and property
        # calls were measurable per request per step (docs/PERFORMANCE.md, host CPU, third
        # pass); a tuple per request to count it once cost more (6.0 -> 6.4 us per token).
        for request in self.running:
            if len(request.token_ids) + request.num_inflight - request.num_computed_tokens > 1:
                prefills.append(request)
            else:
                decodes.append(request)
        decodes.sort(key=_priority, reverse=True)  # stable, also with reverse=True
        prefills.sort(key=_priority, reverse=True)
        order = decodes + prefills
        running = RequestStatus.RUNNING
        append_slots = manager.append_slots
        scheduled = output.scheduled
        for request in order:
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this step
            if request.final_pending:
                continue  # its token in flight finishes it (asynchronous scheduling)
            num_new = len(request.token_ids) + request.num_inflight - request.num_computed_tokens
            if request.fork_at:  # a group's first sequence stops before the prompt's last token
                num_new = min(num_new, request.fork_at - request.num_computed_tokens)
                if num_new <= 0:
                    continue
            elif num_new <= 0:
                continue  # a beam waiting for the other beams of its group
            if num_new > budget:
                num_new = budget
            while not append_slots(request, num_new):
                victim = self._victim(self.running)
                if victim.priority > request.priority:
                    victim = request  # never preempt a higher priority for a lower one
                budget += self._preempt_group(victim, output)
                if request.status is not running:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new

        if output.preempted:
            return output
        # guaranteed_no_evict: blocks the running units may still take (admissions add theirs).
        self._outstanding = self._outstanding_reservations() if self.no_evict and self.waiting else 0
        if self.config.batching_strategy == "static":
            if not self.running:
                self._admit_static_batch(output, budget)
            return output

        while self.waiting and budget > 0:
            head = self.waiting.peek()
            if len(self.running) + self._batch_slots(head) <= self.config.max_batch_size:
                num_new = self._try_admit(head, budget, output)
                if num_new is not None:
                    budget -= num_new
                    continue
            if self.no_evict:
                break  # guaranteed_no_evict: the head waits for room; nothing running is evicted
            # The head does not fit (batch or KV cache full): a running request of lower
            # priority makes room, so a high-priority arrival never waits behind a flood.
            lower = [r for r in self.running if r.priority < head.priority]
            if not lower:
                break
            victim = self._victim(lower)
            budget += self._preempt_group(victim, output)
        return output

    @staticmethod
    def _batch_slots(request: Request) -> int:
        """Places in the running set its admission takes: its group's sequences to come."""
        group = request.group
        if group is None:
            return 1
        if not group.forked and not group.live[1:]:
            return group.num_sequences
        return sum(1 for r in group.sequences if r.status is RequestStatus.WAITING)

    # ---- capacity ------------------------------------------------------------------------
    def _reservation(self, request: Request) -> int:
        """guaranteed_no_evict: the most blocks the request's unit (itself, or its whole
        sequence group) can hold: its prompt + max_tokens; for a group, the prompt blocks
        its sequences share (those before the token where it forks) once and every
        sequence's tail (its copy of the partial block included) apart."""
        manager = self.block_manager
        total = manager.blocks_for_tokens(request.num_prompt_tokens + request.params.max_tokens)
        group = request.group
        if group is None:
            return total
        shared = (request.num_prompt_tokens - 1) // manager.block_size
        return shared + group.num_sequences * (total - shared)

    def _held(self, request: Request) -> int:
        """Blocks the request's unit holds now (a group's shared blocks once)."""
        group = request.group
        if group is None:
            return len(request.block_table)
        running = RequestStatus.RUNNING
        return len({b for r in group.sequences if r.status is running for b in r.block_table})

    def _outstanding_reservations(self) -> int:
        """Blocks the running units may still take: each one's reservation less what it
        holds (a block it shares with another unit counts for both: it needs no new one)."""
        total = 0
        seen: set[int] = set()
        for request in self.running:
            group = request.group
            if group is not None:
                if id(group) in seen:
                    continue
                seen.add(id(group))
            total += max(0, self._reservation(request) - self._held(request))
        return total

    def _fits(self, request: Request, num_new_blocks: int, num_held_hits: int = 0) -> bool:
        """Whether an admission that takes `num_new_blocks` free blocks now (its cached
        prefix blocks that nobody holds included) may go ahead under the capacity policy.
        guaranteed_no_evict: its unit's whole reservation, less `num_held_hits` (cached
        prefix blocks others hold already), must fit beside the running units' outstanding
        reservations. max_utilization: `watermark_blocks` stay free while others run."""
        free = self.block_manager.num_free_blocks
        if num_new_blocks > free:
            return False
        if self.no_evict:
            needed = max(num_new_blocks, self._reservation(request) - num_held_hits)
            return needed <= free - self._outstanding
        return not self.running or free - num_new_blocks >= self.watermark_blocks

    def _reserve(self, request: Request) -> None:
        """guaranteed_no_evict: an admitted unit's outstanding reservation joins the others'."""
        if self.no_evict:
            self._outstanding += max(0, self._reservation(request) - self._held(request))

    def _try_admit(self, request: Request, budget: int, output: SchedulerOutput) -> int | None:
        """Admit the head of the queue with up to `budget` new tokens; None if it does not fit."""
        manager = self.block_manager
        group = request.group
        if group is not None and (group.forked or len(group.live) > 1):
            return self._try_admit_group(group, budget, output)
        if request.num_swapped_blocks:
            num_new = min(self._admission_target(request) - request.num_computed_tokens, budget)
            if not self._fits(request, manager.blocks_for_tokens(request.num_computed_tokens + num_new)):
                return None
            self._admit_swapped(request, num_new, output)
        else:
            computed = manager.get_computed_blocks(request)
            num_new = min(self._admission_target(request) - len(computed) * manager.block_size, budget)
            taken, held_hits = manager.admission_blocks(request, computed, num_new)
            if not self._fits(request, taken, held_hits):
                return None
            self._admit(request, computed, num_new)
        self._reserve(request)
        if num_new > 0:
            output.scheduled.append(ScheduledRequest(request, num_new))
        return num_new

    @staticmethod
    def _admission_target(request: Request) -> int:
        """Tokens to compute before it samples (a group's first sequence: until it forks)."""
        return request.fork_at if request.fork_at else request.num_tokens

    def _try_admit_group(self, group, budget: int, output: SchedulerOutput) -> int | None:
        """Admit every waiting sequence of a group or none: their blocks must fit together,
        a free cached block that several of them share counted once."""
        manager = self.block_manager
        members = [r for r in group.sequences if r.status is RequestStatus.WAITING and r in self.waiting]
        plans = []
        needed = 0
        reclaimed: set[int] = set()
        left = budget
        for member in members:
            if member.num_swapped_blocks:
                num_new = min(member.num_tokens - member.num_computed_tokens, left)
                needed += manager.blocks_for_tokens(member.num_computed_tokens + num_new)
                plans.append((member, None, num_new))
            else:
                computed = manager.get_computed_blocks(member, onload=False)  # (see its docstring)
                num_new = min(member.num_tokens - len(computed) * manager.block_size, left)
                needed += manager.blocks_for_tokens(len(computed) * manager.block_size + num_new) - len(computed)
                reclaimed.update(b for b in computed if manager.blocks[b].ref_count == 0)
                plans.append((member, computed, num_new))
            left -= num_new
        if not self._fits(members[0], needed + len(reclaimed)):
            return None
        # Cached prefixes first, all at once (no member's growth may evict another's hit).
        together = [(member, computed, num_new) for member, computed, num_new in plans if computed is not None]
        for member, _, _ in together:
            self.waiting.remove(member)
        manager.allocate_together(together)
        for member, computed, num_new in plans:
            if computed is None:
                self._admit_swapped(member, num_new, output)
            else:
                if not member.first_admitted:
                    member.num_cached_tokens = member.num_computed_tokens
                self._count_recomputed(member)
                self.start_running(member)
            if num_new > 0:
                output.scheduled.append(ScheduledRequest(member, num_new))
        self._reserve(members[0])
        return budget - left

    def _admit_swapped(self, request: Request, num_new: int, output: SchedulerOutput) -> None:
        self.waiting.remove(request)
        self.block_manager.allocate_fresh(request, request.num_computed_tokens + num_new)
        output.swapped_in.append((request, list(request.block_table[: request.num_swapped_blocks])))
        self._release_swap(request)
        self._count_recomputed(request)
        self.start_running(request)

    def _admit(self, request: Request, computed: list[int], num_new: int) -> None:
        self.waiting.remove(request)
        self.block_manager.allocate(request, computed, num_new)
        if not request.first_admitted:
            request.num_cached_tokens = request.num_computed_tokens
        self._count_recomputed(request)
        self.start_running(request)

    def start_running(self, request: Request) -> None:
        """Into the running set (admitted now, or forked from a running sequence of its group)."""
        request.first_admitted = True
        request.status = RequestStatus.RUNNING
        request.admitted_seq = self._next_admission
        self._next_admission += 1
        self.running.append(request)

    def _admit_static_batch(self, output: SchedulerOutput, budget: int) -> None:
        """Form a new static batch: up to max_batch_size requests, all admitted now even
        if the token budget only lets the first ones start their prefill this step."""
        while self.waiting and len(self.running) < self.config.max_batch_size:
            num_new = self._try_admit(self.waiting.peek(), budget, output)
            if num_new is None:
                break
            budget -= num_new
