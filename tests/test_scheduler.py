"""Scheduler: which requests each step schedules, with how many tokens, exactly."""

from __future__ import annotations

import pytest

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


# ---- capacity policies and preemption modes as sequences of events -----------------------

def make_request(request_id: str, prompt_len: int, max_tokens: int, priority: int = 0, first_token: int = 0) -> Request:
    tokens = [first_token + i for i in range(prompt_len)]
    return Request(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(max_tokens=max_tokens),
                   priority=priority)


def events(scheduler: Scheduler) -> list[str]:
    """Schedule once and play the engine's part (tokens computed, a token sampled at the end
    of a chunk, a request finished at its max_tokens). Returns the step's events in order:
    `preempt X recompute` / `preempt X swap N` (N blocks to host memory), `swap-in X N`,
    `admit X` (first admission), `resume X` (after a preemption), `finish X`."""
    waiting = {request.request_id: request.first_admitted for request in scheduler.waiting}
    output = scheduler.schedule()
    swapped_out = {request.request_id: len(blocks) for request, blocks in output.swapped_out}
    happened = [f"preempt {r.request_id} swap {swapped_out[r.request_id]}" if r.request_id in swapped_out
                else f"preempt {r.request_id} recompute" for r in output.preempted]
    happened += [f"swap-in {request.request_id} {len(blocks)}" for request, blocks in output.swapped_in]
    for item in output.scheduled:
        request_id = item.request.request_id
        if request_id in waiting:
            happened.append(f"{'resume' if waiting[request_id] else 'admit'} {request_id}")
    for item in output.scheduled:
        request = item.request
        samples = item.samples
        request.num_computed_tokens += item.num_new_tokens
        scheduler.block_manager.cache_full_blocks(request)
        if samples:
            request.token_ids.append(1000 + request.num_tokens)
            if request.num_output_tokens >= request.params.max_tokens:
                request.status = RequestStatus.FINISHED
                scheduler.remove(request)
                happened.append(f"finish {request.request_id}")
    return happened


def run(scheduler: Scheduler, max_steps: int = 100) -> list[list[str]]:
    """Events of every step until nothing is left (steps with no event are kept: [])."""
    history = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return history
        history.append(events(scheduler))
    raise AssertionError(f"still unfinished after {max_steps} steps: {history}")


def policy_scheduler(num_blocks: int, block_size: int = 4, prefix_caching: bool = False, costs=None,
                     **config) -> Scheduler:
    return Scheduler(EngineConfig(**config), BlockManager(num_blocks, block_size, prefix_caching), costs)


def three_requests(scheduler: Scheduler) -> None:
    """a: 8 + 8 tokens (4 blocks of 4 at most), b: 4 + 12 (4 blocks), c: 4 + 4 (2 blocks)."""
    scheduler.add_request(make_request("a", 8, 8))
    scheduler.add_request(make_request("b", 4, 12, first_token=100))
    scheduler.add_request(make_request("c", 4, 4, first_token=200))


def test_guaranteed_no_evict_holds_back_an_admission_that_does_not_fit_its_max_tokens():
    # 8 blocks of 4. After a (2 blocks now, 4 at most) and b (1 now, 4 at most) are in,
    # 5 blocks are free but a and b may still take 2 + 3 of them: c (2 at most) waits
    # until a finishes, though one block would do for its prompt. Nothing is ever preempted.
    scheduler = policy_scheduler(8, capacity_policy="guaranteed_no_evict", max_num_tokens=64)
    three_requests(scheduler)
    history = run(scheduler)
    assert [(step, happened) for step, happened in enumerate(history) if happened] == [
        (0, ["admit a", "admit b"]),
        (7, ["finish a"]),
        (8, ["admit c"]),
        (11, ["finish b", "finish c"]),
    ]
    assert scheduler.num_preemptions == 0


def test_max_utilization_admits_what_fits_now():
    # The same requests: c's prompt fits, so it runs at once (and here finishes before the
    # cache runs out).
    scheduler = policy_scheduler(8, capacity_policy="MAX_UTILIZATION", kv_watermark=0.0, max_num_tokens=64)
    three_requests(scheduler)
    history = run(scheduler)
    assert [(step, happened) for step, happened in enumerate(history) if happened] == [
        (0, ["admit a", "admit b", "admit c"]),
        (3, ["finish c"]),
        (7, ["finish a"]),
        (11, ["finish b"]),
    ]


def pressure(scheduler: Scheduler) -> list[tuple[int, list[str]]]:
    """8 blocks of 4: a (8 + 8, priority 0), b (4 + 12, priority 1), c (4 + 8, priority 0), all
    admitted at once. At step 5 each needs a block and one is free: b (higher priority)
    takes it; a's block comes from the lowest priority, latest arrival: c, with 2 full
    computed blocks. c comes back when a finishes."""
    scheduler.add_request(make_request("a", 8, 8))
    scheduler.add_request(make_request("b", 4, 12, priority=1, first_token=100))
    scheduler.add_request(make_request("c", 4, 8, first_token=200))
    return [(step, happened) for step, happened in enumerate(run(scheduler)) if happened]


def test_max_utilization_preempts_the_lowest_priority_latest_arrival_and_recomputes():
    scheduler = policy_scheduler(8, preemption_mode="recompute", kv_watermark=0.0, max_num_tokens=64,
                                 priority_levels=2)
    assert pressure(scheduler) == [
        (0, ["admit b", "admit a", "admit c"]),
        (5, ["preempt c recompute"]),
        (7, ["finish a"]),
        (8, ["resume c"]),
        (10, ["finish c"]),
        (11, ["finish b"]),
    ]
    assert (scheduler.num_preemptions, scheduler.num_swapped_out, scheduler.num_recomputed_tokens) == (1, 0, 8)


def test_swap_mode_swaps_the_victims_full_blocks_out_and_back():
    scheduler = policy_scheduler(8, preemption_mode="swap", kv_watermark=0.0, max_num_tokens=64, priority_levels=2)
    assert pressure(scheduler) == [
        (0, ["admit b", "admit a", "admit c"]),
        (5, ["preempt c swap 2"]),
        (7, ["finish a"]),
        (8, ["swap-in c 2", "resume c"]),
        (10, ["finish c"]),
        (11, ["finish b"]),
    ]
    assert (scheduler.num_preemptions, scheduler.num_swapped_out, scheduler.num_recomputed_tokens) == (1, 1, 0)


def test_auto_swaps_or_recomputes_by_the_cost_figures():
    from inflightllm.kv_pressure import HostLink, PreemptionCostModel

    # c's 2 blocks of 1,000 bytes out and back over 1 GB/s: 4 us. Its 8 tokens again: 8 ms
    # at 1 ms a token (swap), 8 ns at 1 ns a token (recompute).
    link = HostLink(bytes_per_second=1e9, bytes_per_block=1000)
    for seconds_per_token, expected in ((1e-3, "swap 2"), (1e-9, "recompute")):
        costs = PreemptionCostModel(link, prefill_seconds_per_token=seconds_per_token)
        scheduler = policy_scheduler(8, preemption_mode="auto", kv_watermark=0.0, max_num_tokens=64,
                                     priority_levels=2, costs=costs)
        history = dict(pressure(scheduler))
        assert history[5] == [f"preempt c {expected}"]
        assert history[8] == (["swap-in c 2", "resume c"] if expected == "swap 2" else ["resume c"])
    # No figures yet (no prefill step timed, or a runner without a host link): recompute.
    scheduler = policy_scheduler(8, preemption_mode="auto", kv_watermark=0.0, max_num_tokens=64, priority_levels=2,
                                 costs=PreemptionCostModel(link))
    assert dict(pressure(scheduler))[5] == ["preempt c recompute"]


def test_guaranteed_no_evict_never_preempts_under_the_same_pressure():
    scheduler = policy_scheduler(8, capacity_policy="guaranteed_no_evict", max_num_tokens=64, priority_levels=2)
    # b (4 blocks at most) and a (4) take the whole cache: c waits for one to finish.
    assert pressure(scheduler) == [
        (0, ["admit b", "admit a"]),
        (7, ["finish a"]),
        (8, ["admit c"]),
        (11, ["finish b"]),
        (15, ["finish c"]),
    ]
    assert scheduler.num_preemptions == 0


def test_guaranteed_no_evict_does_not_preempt_for_a_higher_priority():
    scheduler = policy_scheduler(4, capacity_policy="guaranteed_no_evict", max_num_tokens=64, priority_levels=2)
    scheduler.add_request(make_request("low", 4, 12))
    assert events(scheduler) == ["admit low"]
    scheduler.add_request(make_request("high", 4, 1, priority=1, first_token=50))
    history = [(step, happened) for step, happened in enumerate(run(scheduler), start=1) if happened]
    assert history == [(11, ["finish low"]), (12, ["admit high", "finish high"])]


def test_watermark_keeps_blocks_free_at_admission_while_others_run():
    # 10 blocks, watermark 0.25: 2 blocks stay free. a (4 blocks) comes in whatever the
    # watermark (nothing runs); b (3) leaves 3 free; c (2) would leave 1: it waits.
    def first_step(watermark):
        scheduler = policy_scheduler(10, kv_watermark=watermark, max_num_tokens=64)
        scheduler.add_request(make_request("a", 16, 4))
        scheduler.add_request(make_request("b", 12, 4, first_token=100))
        scheduler.add_request(make_request("c", 8, 4, first_token=200))
        return events(scheduler), scheduler

    happened, scheduler = first_step(0.25)
    assert scheduler.watermark_blocks == 2
    assert happened == ["admit a", "admit b"] and [r.request_id for r in scheduler.waiting] == ["c"]
    happened, scheduler = first_step(0.0)
    assert happened == ["admit a", "admit b", "admit c"]
    # A request alone is admitted even when it leaves less than the watermark free.
    scheduler = policy_scheduler(4, kv_watermark=0.5, max_num_tokens=64)
    scheduler.add_request(make_request("big", 16, 1))
    assert events(scheduler) == ["admit big", "finish big"]


def test_victim_is_the_latest_arrival_not_the_latest_readmission():
    scheduler = make_scheduler(priority_levels=2)
    early, late, high = make("early", 4), make("late", 4, first_token=10), make("high", 4, priority=1, first_token=20)
    for request in (early, late, high):
        scheduler.add_request(request)
    early.admitted_seq, late.admitted_seq, high.admitted_seq = 5, 3, 4  # early was resumed last
    assert scheduler._victim([early, late, high]) is late
    assert scheduler._victim([early, high]) is early  # the lowest priority first


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_recomputed_request_gets_its_cached_blocks_back_generated_ones_included(mode):
    # 4 blocks of 4. x (priority 0) has computed 14 tokens (prompt 4 + 10 generated): 3 full
    # blocks and a partial one. high (priority 1, one block) arrives: x is preempted; high
    # takes x's partial block (uncached blocks are reused first), x's full blocks stay cached
    # (recompute) or go to host memory (swap). Readmitted, x gets its 12 tokens back either
    # way, and computes the other 2 again.
    scheduler = policy_scheduler(4, prefix_caching=True, preemption_mode=mode, max_num_tokens=64, priority_levels=2)
    x = make_request("x", 4, 20)
    scheduler.add_request(x)
    for _ in range(11):
        events(scheduler)
    assert (x.num_computed_tokens, len(x.block_table), x.num_registered_blocks) == (14, 4, 3)
    scheduler.add_request(make_request("high", 4, 1, priority=1, first_token=50))
    swapped = "swap 3" if mode == "swap" else "recompute"
    assert events(scheduler) == [f"preempt x {swapped}", "admit high", "finish high"]
    hits_before = scheduler.block_manager.prefix_cache_hits
    assert events(scheduler) == (["swap-in x 3", "resume x"] if mode == "swap" else ["resume x"])
    assert scheduler.num_recomputed_tokens == 2
    if mode == "recompute":  # found in the prefix cache: the prompt block and 2 of generated tokens
        assert scheduler.block_manager.prefix_cache_hits - hits_before == 12
