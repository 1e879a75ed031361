"""A stateful fuzz over the real Engine, Scheduler and BlockManager with a stub model.

Each KV slot of the stub records the token prefix it was computed from, and every
scheduled context is checked before each step (tests/stub_model.py). Random arrivals
(from prompt families that share prefixes), priorities, client aborts, a small KV cache
(preemptions: recompute, swap, and auto choosing per victim by fixed cost figures; the
capacity policies max_utilization with a random watermark, and guaranteed_no_evict, which
must never preempt), prefix-cache hits, and requests with several
outputs (sequence groups: n, best_of, beam search over the stub's candidates; shared
blocks, copy-on-write, beams forking and dying); after every step the block
accounting is checked against the live requests, and at the end every block is free, the
queues are empty and every completed request's output equals the stub model's offline
output. The events the fuzz is meant to cover are asserted to have happened.
"""

from __future__ import annotations

import random

import pytest

from inflightllm.beam_search import BeamSearch
from inflightllm.kv_pressure import HostLink, PreemptionCostModel
from inflightllm.request import FinishReason, RequestStatus
from inflightllm.sampling_params import InvalidRequestError, SamplingParams
from inflightllm.sequence_group import GroupParams
from tests.stub_model import EOS, reference_output, stub_candidates, stub_engine


def reference_beams(prompt: list[int], group: GroupParams, max_tokens: int) -> list[list[int]]:
    """The final beams (stop token dropped) of a beam search over the stub's candidates,
    run alone: what the engine must return whatever the schedule was."""
    search = BeamSearch(group.beam_width, max_tokens, frozenset({EOS}), 1, group.length_penalty,
                        group.early_stopping)
    live = [list(prompt)]
    while not search.done:
        tops = [stub_candidates(tokens, search.candidates_per_beam) for tokens in live]
        beams = search.step([tokens[len(prompt):] for tokens in live], [ids for ids, _ in tops],
                            [values for _, values in tops])
        live = [live[beam.parent] + [beam.token_id] for beam in beams]
    return [hyp.token_ids[:-1] if hyp.token_ids[-1] == EOS else hyp.token_ids for hyp in search.finished]


def check_invariants(engine) -> None:
    manager = engine.block_manager
    scheduler = engine.scheduler
    counts = [0] * manager.num_blocks
    # The scheduler's step order relies on `running` being in admission order.
    admitted = [request.admitted_seq for request in scheduler.running]
    assert admitted == sorted(admitted) and len(set(admitted)) == len(admitted)
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        for block_id in request.block_table:
            counts[block_id] += 1
    for request in scheduler.waiting:
        assert request.block_table == [], f"waiting request {request.request_id} holds blocks"
    for block in manager.blocks:
        assert block.ref_count == counts[block.block_id], f"block {block.block_id}"
        assert (block.block_id in manager.free_queue) == (block.ref_count == 0)
    assert manager.num_shared_blocks == sum(1 for block in manager.blocks if block.ref_count > 1)
    for key, block_id in manager.cached_blocks.items():
        assert manager.blocks[block_id].block_hash == key
    assert manager.num_cached_blocks == sum(
        1 for block_id in manager.free_queue if manager.blocks[block_id].block_hash is not None)
    swapped = sum(request.num_swapped_blocks for request in scheduler.waiting)
    assert scheduler.num_free_swap_blocks == scheduler.swap_space_blocks - swapped
    assert set(engine.requests) == {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
    for group in engine.groups.values():  # a group lives while one of its sequences does
        assert any(r.request_id in engine.requests for r in group.sequences)
    assert engine.runner.violations == []
    tier = manager.host_tier
    if tier is not None:
        tier.check()
        # A device block's queued onload is for the key the block holds now.
        for block_id, slot in tier.pending_onloads.items():
            block = manager.blocks[block_id]
            assert block.block_hash is not None and tier.entries[block.block_hash].slot == slot


def fuzz(seed: int, mode: str, prefix_caching: bool, steps: int = 250, policy: str = "max_utilization",
         host_tier: bool = False) -> dict:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    num_host_blocks = rng.choice([1, 3, 8, 24]) if host_tier else 0
    engine = stub_engine(num_blocks=rng.choice([8, 12, 16]) * 4 // block_size, block_size=block_size,
                         num_host_blocks=num_host_blocks,
                         max_batch_size=rng.choice([3, 6]), max_num_tokens=rng.choice([8, 16, 64]),
                         preemption_mode=mode, swap_space_blocks=rng.choice([0, 6]),
                         enable_kv_cache_reuse=prefix_caching, priority_levels=3,
                         capacity_policy=policy, kv_watermark=rng.choice([0.0, 0.1, 0.25]))
    if mode == "auto":
        # Fixed figures (the stub has no host link, its steps no real cost): a swap of n blocks
        # costs as much as recomputing 0.75 n blocks' tokens, so victims whose blocks others
        # share recompute and the others swap.
        engine.scheduler.costs = PreemptionCostModel(HostLink(bytes_per_second=1.0, bytes_per_block=3 * block_size),
                                                     prefill_seconds_per_token=8.0)
    families = [[rng.randrange(1, 97) for _ in range(rng.randrange(2, 10))] for _ in range(4)]
    expected: dict[str, list[int]] = {}
    received: dict[tuple[str, int], list[int]] = {}  # (request id, sequence index) -> tokens
    outputs_of: dict[str, int] = {}  # request id -> its number of outputs
    beams_expected: dict[str, list[list[int]]] = {}
    beams_received: dict[str, list[list[int]]] = {}
    finished: dict[str, FinishReason] = {}
    counter = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            counter += 1
            request_id = f"r{counter}"
            prompt = rng.choice(families) + [rng.randrange(1, 97) for _ in range(rng.randrange(0, 6))]
            max_tokens = rng.randrange(1, 12)
            streaming = rng.random() < 0.5
            group = None
            if rng.random() < 0.3:  # several outputs: n, or best_of (held back: no streaming)
                n = rng.choice([2, 3])
                group = GroupParams(n=n) if streaming or rng.random() < 0.5 else GroupParams(n=n - 1, best_of=n)
            elif rng.random() < 0.15:  # beam search
                group = GroupParams(beam_width=rng.choice([2, 3]), length_penalty=rng.choice([0.0, 1.0, 2.0]),
                                    early_stopping=rng.choice([True, False, "never"]))
            try:
                engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens),
                                   priority=rng.randrange(3), streaming=streaming, group=group)
            except InvalidRequestError as error:
                assert "KV blocks" in str(error) and group is not None  # the group cannot fit this cache
                continue
            expected[request_id] = reference_output(prompt, max_tokens)
            outputs_of[request_id] = group.n if group is not None else 1
            if group is not None and group.beam_width > 1:
                beams_expected[request_id] = reference_beams(prompt, group, max_tokens)
        if engine.requests and rng.random() < 0.08:
            engine.abort(rng.choice(sorted(engine.requests)).split("\x1f")[0])
        for output in engine.step():
            received.setdefault((output.request_id, output.sequence_index), []).extend(output.new_token_ids)
            assert output.error is None, output.error
            assert output.request_id not in finished, "an output after the request finished"
            if output.finished:
                finished[output.request_id] = output.finish_reason
                if output.beam_token_ids is not None:
                    beams_received[output.request_id] = output.beam_token_ids
        check_invariants(engine)
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            received.setdefault((output.request_id, output.sequence_index), []).extend(output.new_token_ids)
            if output.finished:
                finished[output.request_id] = output.finish_reason
                if output.beam_token_ids is not None:
                    beams_received[output.request_id] = output.beam_token_ids
        check_invariants(engine)
    assert not engine.has_unfinished() and not engine.groups
    stats = engine.stats()
    assert (stats.num_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert set(finished) == set(expected)
    completed = [rid for rid, reason in finished.items() if reason is not FinishReason.CANCELLED]
    for request_id in completed:  # every output of a group is the stub's (greedy) output
        if request_id in beams_expected:  # beams: the search run alone
            assert beams_received[request_id] == beams_expected[request_id], request_id
            continue
        for index in range(outputs_of[request_id]):
            assert received.get((request_id, index), []) == expected[request_id], (request_id, index)
    for request_id, reason in finished.items():  # a cancelled request got a prefix of its output
        if reason is FinishReason.CANCELLED and request_id not in beams_expected:
            for index in range(outputs_of[request_id]):
                got = received.get((request_id, index), [])
                assert expected[request_id][: len(got)] == got
    groups = sum(1 for count in outputs_of.values() if count > 1)
    if policy == "guaranteed_no_evict":
        assert stats.num_preemptions_total == 0, "guaranteed_no_evict preempted"
    assert stats.num_swapped_in_blocks_total <= stats.num_swapped_out_blocks_total
    if stats.num_preemptions_total == 0:
        assert stats.num_recomputed_tokens_total == 0
    return {
        "preemptions": stats.num_preemptions_total,
        "swaps": stats.num_swapped_out_total,
        "prefix_hits": stats.prefix_cache_hits,
        "cancelled": len(finished) - len(completed),
        "completed": len(completed),
        "contexts_checked": engine.runner.contexts_checked,
        "groups": groups,
        "beam_groups": sum(1 for request_id in completed if request_id in beams_expected),
        "cow_copies": stats.num_cow_copies_total,
        "recomputed": stats.num_recomputed_tokens_total,
        "swapped_in_blocks": stats.num_swapped_in_blocks_total,
        "recompute_preemptions": stats.num_preemptions_total - stats.num_swapped_out_total,
        "offloads": stats.host_kv_offloaded_blocks_total,
        "onloads": stats.host_kv_onloaded_blocks_total,
        "host_hits": stats.prefix_cache_host_hits,
    }


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_fuzz_finds_no_leak_and_no_wrong_sharing(mode, prefix_caching):
    totals: dict[str, int] = {}
    for seed in range(12):
        for key, value in fuzz(seed, mode, prefix_caching).items():
            totals[key] = totals.get(key, 0) + value
    # The events the fuzz exists for happened, many times.
    assert totals["preemptions"] > 20 and totals["cancelled"] > 10 and totals["completed"] > 300
    assert totals["contexts_checked"] > 10_000
    assert totals["groups"] > 100 and totals["cow_copies"] > 50 and totals["beam_groups"] > 20
    if mode in ("swap", "auto"):
        assert totals["swaps"] > 10 and totals["swapped_in_blocks"] > 10
    if mode in ("recompute", "auto"):
        assert totals["recompute_preemptions"] > 10 and totals["recomputed"] > 0
    if mode == "auto" and prefix_caching:  # auto chose each way
        assert totals["swaps"] > 10 and totals["recompute_preemptions"] > 10
    if prefix_caching:
        assert totals["prefix_hits"] > 100


@pytest.mark.parametrize("mode", ["recompute", "auto"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_fuzz_guaranteed_no_evict_never_preempts(mode, prefix_caching):
    totals: dict[str, int] = {}
    for seed in range(12):
        for key, value in fuzz(seed, mode, prefix_caching, policy="guaranteed_no_evict").items():
            totals[key] = totals.get(key, 0) + value
    assert totals["preemptions"] == 0 and totals["recomputed"] == 0 and totals["swaps"] == 0
    assert totals["cancelled"] > 10 and totals["completed"] > 300 and totals["contexts_checked"] > 10_000
    assert totals["groups"] > 100 and totals["cow_copies"] > 50 and totals["beam_groups"] > 20
    if prefix_caching:
        assert totals["prefix_hits"] > 100


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fuzz_host_tier_loses_no_block(mode):
    """The same fuzz with a host KV tier (1 to 24 host slots): every context the stub checks
    holds the right prefix, so an onload of a wrong or overwritten slot is seen; the tier's
    slots are all accounted for after every step (HostKVTier.check)."""
    totals: dict[str, int] = {}
    for seed in range(12):
        for key, value in fuzz(seed, mode, True, host_tier=True).items():
            totals[key] = totals.get(key, 0) + value
    assert totals["preemptions"] > 20 and totals["completed"] > 300 and totals["contexts_checked"] > 10_000
    assert totals["groups"] > 100 and totals["cow_copies"] > 50
    assert totals["offloads"] > 100 and totals["onloads"] > 50 and totals["host_hits"] > 50
