"""Scheduler: which requests each step schedules, with how many tokens, exactly."""

from __future__ import annotations

from inflightllm.block_manager import BlockManager
from inflightllm.config import EngineConfig
from inflightllm.request import Request, RequestStatus
from inflightllm.sampling_params import SamplingParams
from inflightllm.scheduler import Scheduler


def make(request_id: str, prompt_len: int, priority: int = 0, first_token: int = 0) -> Request:
    tokens = [first_token + i for i in range(prompt_len)]
    return Request(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(max_tokens=100),
                   priority=priority)


def make_scheduler(num_blocks=64, block_size=4, **config) -> Scheduler:
    return Scheduler(EngineConfig(**config), BlockManager(num_blocks, block_size, enable_prefix_caching=False))


def step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedule once and play the engine's part: count tokens computed, sample a token
    for requests whose chunk reached their end. Returns [(request_id, num_tokens)]."""
    output = scheduler.schedule()
    contents = [(item.request.request_id, item.num_new_tokens) for item in output.scheduled]
    for item in output.scheduled:
        samples = item.samples
        item.request.num_computed_tokens += item.num_new_tokens
        if samples:
            item.request.token_ids.append(7)
    return contents


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    scheduler = make_scheduler(max_num_tokens=8)
    scheduler.add_request(make("a", 20))
    assert step(scheduler) == [("a", 8)]
    assert step(scheduler) == [("a", 8)]
    assert step(scheduler) == [("a", 4)]  # reaches the end: samples
    assert step(scheduler) == [("a", 1)]  # decode


def test_new_request_joins_a_running_batch_with_the_remaining_budget():
    scheduler = make_scheduler(max_num_tokens=10)
    scheduler.add_request(make("a", 6))
    assert step(scheduler) == [("a", 6)]
    scheduler.add_request(make("b", 12))
    assert step(scheduler) == [("a", 1), ("b", 9)]
    assert step(scheduler) == [("a", 1), ("b", 3)]
    assert step(scheduler) == [("a", 1), ("b", 1)]


def test_decodes_go_before_prefill_chunks_of_older_requests():
    scheduler = make_scheduler(max_num_tokens=8)
    scheduler.add_request(make("a", 30))
    assert step(scheduler) == [("a", 8)]
    scheduler.add_request(make("b", 3))
    assert step(scheduler) == [("a", 8)]  # no budget left for b
    scheduler.running[0].num_computed_tokens = 28  # skip ahead: a has 2 prompt tokens left
    assert step(scheduler) == [("a", 2), ("b", 3)]
    # Now both decode; a's next prefill would come after decodes anyway.
    assert step(scheduler) == [("a", 1), ("b", 1)]


def test_running_requests_are_ordered_decodes_first_then_priority_then_admission():
    scheduler = make_scheduler(num_blocks=256, max_num_tokens=1000, priority_levels=3)
    scheduler.add_request(make("a", 2, priority=0))
    scheduler.add_request(make("b", 3, priority=1))
    step(scheduler)
    scheduler.add_request(make("c", 2, priority=2))
    scheduler.add_request(make("d", 4, priority=0))
    scheduler.add_request(make("e", 2, priority=1))
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["b", "a", "c", "e", "d"]  # admission order
    assert [item.request.request_id for item in scheduler.schedule().scheduled] == ["c", "b", "e", "a", "d"]
    # Uncomputed tails (prefill-like chunks) for some: they go after every decode.
    for request in scheduler.running:
        request.num_computed_tokens = request.num_tokens - 1  # undo the step above
        if request.request_id in ("c", "a"):
            request.token_ids.extend([9, 9, 9])
    expected = sorted(scheduler.running,
                      key=lambda r: (r.num_uncomputed_tokens() > 1, -r.priority, r.admitted_seq))
    assert [r.request_id for r in expected] == ["b", "e", "d", "c", "a"]
    assert [item.request.request_id for item in scheduler.schedule().scheduled] == ["b", "e", "d", "c", "a"]


def test_max_batch_size_caps_running_requests():
    scheduler = make_scheduler(max_num_tokens=100, max_batch_size=2)
    for name in "abc":
        scheduler.add_request(make(name, 4))
    assert step(scheduler) == [("a", 4), ("b", 4)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    finished = scheduler.running[0]
    finished.status = RequestStatus.FINISHED
    scheduler.remove(finished)
    assert step(scheduler) == [("b", 1), ("c", 4)]


def test_preemption_takes_the_most_recent_admission_and_requeues_it_first():
    # 6 blocks of 4 tokens. a: 8 tokens (2 blocks), b: 8 tokens (2 blocks), c: 7 (2 blocks)
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_tokens=64)
    scheduler.add_request(make("a", 8))
    scheduler.add_request(make("b", 8, first_token=100))
    scheduler.add_request(make("c", 7, first_token=200))
    assert step(scheduler) == [("a", 8), ("b", 8), ("c", 7)]
    # c's 8th token fits its second block; a and b need a third block each: only c's
    # blocks can be taken, and c is the most recent admission.
    output = scheduler.schedule()
    assert [r.request_id for r in output.preempted] == ["c"]
    assert [(i.request.request_id, i.num_new_tokens) for i in output.scheduled] == [("a", 1), ("b", 1)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    victim = scheduler.waiting[0]
    assert victim.num_computed_tokens == 0
    assert victim.block_table == []
    assert victim.num_preemptions == 1
    assert scheduler.num_preemptions == 1


def test_preempted_request_goes_ahead_of_earlier_waiting_ones():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_tokens=64, max_batch_size=2)
    scheduler.add_request(make("a", 8))
    scheduler.add_request(make("b", 8, first_token=100))
    scheduler.add_request(make("c", 4, first_token=200))  # waits: batch is full
    step(scheduler)
    output = scheduler.schedule()  # a needs a 3rd block: b is preempted
    assert [r.request_id for r in output.preempted] == ["b"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_higher_priority_waits_less_and_is_preempted_last():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_tokens=64, priority_levels=3)
    scheduler.add_request(make("low", 4, priority=0))
    assert step(scheduler) == [("low", 4)]  # low is admitted first
    scheduler.add_request(make("mid", 4, priority=1, first_token=90))
    scheduler.add_request(make("high", 4, priority=2, first_token=50))
    assert [r.request_id for r in scheduler.waiting] == ["high", "mid"]
    assert step(scheduler) == [("low", 1), ("high", 4), ("mid", 4)]
    # The cache is full (low 2 blocks, high 1, mid 1); high and mid need a second block.
    # high goes first; the victim is the lowest priority (low, although it is the oldest
    # admission), then mid takes one of its blocks.
    output = scheduler.schedule()
    assert [r.request_id for r in output.preempted] == ["low"]
    assert [(i.request.request_id, i.num_new_tokens) for i in output.scheduled] == [("high", 1), ("mid", 1)]
    assert [r.request_id for r in scheduler.waiting] == ["low"]


def test_a_victim_already_scheduled_in_the_step_is_taken_back():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_tokens=5, priority_levels=3)
    scheduler.add_request(make("low", 4, priority=0))
    assert step(scheduler) == [("low", 4)]
    scheduler.add_request(make("high", 12, priority=2, first_token=50))
    assert step(scheduler) == [("low", 1), ("high", 4)]
    assert step(scheduler) == [("low", 1), ("high", 4)]
    # low's decode is scheduled first (decodes go first); high's last chunk then needs
    # a block and the cache is full: low is taken back out of this step and preempted.
    output = scheduler.schedule()
    assert [r.request_id for r in output.preempted] == ["low"]
    assert [(i.request.request_id, i.num_new_tokens) for i in output.scheduled] == [("high", 4)]


def test_static_batching_admits_only_when_the_batch_is_done():
    scheduler = make_scheduler(max_num_tokens=16, batching_strategy="static", max_batch_size=4)
    scheduler.add_request(make("a", 4))
    scheduler.add_request(make("b", 4, first_token=20))
    assert step(scheduler) == [("a", 4), ("b", 4)]
    scheduler.add_request(make("c", 4, first_token=40))
    assert step(scheduler) == [("a", 1), ("b", 1)]  # c waits for the whole batch
    for request in list(scheduler.running):
        request.status = RequestStatus.FINISHED
        scheduler.remove(request)
    assert step(scheduler) == [("c", 4)]


def test_static_batch_is_formed_beyond_the_first_steps_budget():
    scheduler = make_scheduler(max_num_tokens=6, batching_strategy="static", max_batch_size=3)
    for i, name in enumerate("abc"):
        scheduler.add_request(make(name, 4, first_token=10 * i))
    assert step(scheduler) == [("a", 4), ("b", 2)]
    assert [r.request_id for r in scheduler.running] == ["a", "b", "c"]
    assert step(scheduler) == [("a", 1), ("b", 2), ("c", 3)]
