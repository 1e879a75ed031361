"""Block manager: exact block ids, reference counts, prefix-cache hits, eviction order,
and (property-based) invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflightllm.block_manager import BlockManager
from inflightllm.request import Request
from inflightllm.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(max_tokens=8))


def admit(manager: BlockManager, request: Request, num_new: int | None = None) -> list[int]:
    computed = manager.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - len(computed) * manager.block_size
    assert manager.can_allocate(request, computed, num_new)
    manager.allocate(request, computed, num_new)
    return computed


def run_chunk(manager: BlockManager, request: Request, num_new: int) -> None:
    """What the engine does after a step: tokens computed, full blocks cached."""
    request.num_computed_tokens += num_new
    manager.cache_full_blocks(request)


def test_allocation_hands_out_blocks_in_order_and_counts_refs():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    admit(manager, first)
    assert first.block_table == [0, 1, 2]
    assert [manager.blocks[i].ref_count for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    second = make_request("b", list(range(100, 105)))  # 5 tokens -> 2 blocks
    admit(manager, second)
    assert second.block_table == [3, 4]
    assert manager.num_free_blocks == 3
    assert manager.num_used_blocks == 5


def test_append_slots_grows_only_at_block_boundaries():
    manager = BlockManager(num_blocks=4, block_size=4)
    request = make_request("a", [1, 2, 3])
    admit(manager, request)
    run_chunk(manager, request, 3)
    assert request.block_table == [0]
    request.token_ids.append(9)  # 4th token fits block 0
    assert manager.append_slots(request, 1)
    assert request.block_table == [0]
    run_chunk(manager, request, 1)
    request.token_ids.append(10)  # 5th token needs block 1
    assert manager.append_slots(request, 1)
    assert request.block_table == [0, 1]


def test_append_fails_without_partial_allocation():
    manager = BlockManager(num_blocks=3, block_size=2)
    request = make_request("a", [1, 2])
    admit(manager, request)
    run_chunk(manager, request, 2)
    other = make_request("b", [5, 6, 7, 8])
    admit(manager, other)
    assert manager.num_free_blocks == 0
    request.token_ids.extend([3, 4, 5])
    assert not manager.append_slots(request, 3)
    assert request.block_table == [0]
    assert manager.num_free_blocks == 0


def test_prefix_cache_hit_shares_blocks_and_bumps_refs():
    manager = BlockManager(num_blocks=10, block_size=4)
    system = list(range(50, 58))  # two full blocks
    first = make_request("a", system + [1, 2, 3])
    admit(manager, first)
    run_chunk(manager, first, first.num_tokens)
    assert first.block_table == [0, 1, 2]
    second = make_request("b", system + [7, 8])
    computed = admit(manager, second)
    assert computed == [0, 1]
    assert second.num_computed_tokens == 8
    assert second.block_table == [0, 1, 3]
    assert [manager.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert manager.prefix_cache_hits == 8
    assert manager.prefix_cache_queries == 11 + 10


def test_fully_cached_prompt_keeps_its_last_block_to_compute():
    manager = BlockManager(num_blocks=6, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    first = make_request("a", prompt)
    admit(manager, first)
    run_chunk(manager, first, 8)
    second = make_request("b", prompt)
    assert manager.get_computed_blocks(second) == [0]


def test_hash_collision_is_not_a_hit():
    manager = BlockManager(num_blocks=6, block_size=2)
    first = make_request("a", [1, 2, 3])
    admit(manager, first)
    run_chunk(manager, first, 3)
    # Forge a collision: the cached block claims the hash of other tokens.
    block = manager.blocks[first.block_table[0]]
    other = make_request("b", [9, 9, 9])
    forged_hash = manager._block_hashes(other, 1)[0]
    del manager.cached_blocks[block.block_hash]
    block.block_hash = forged_hash
    manager.cached_blocks[forged_hash] = block.block_id
    assert manager.get_computed_blocks(other) == []


def test_free_returns_blocks_and_eviction_order_is_uncached_then_lru():
    manager = BlockManager(num_blocks=6, block_size=2)
    first = make_request("a", [1, 2, 3, 4, 5])  # blocks 0,1 full (cached), 2 partial
    admit(manager, first)
    run_chunk(manager, first, 5)
    second = make_request("b", [7, 8, 9])  # block 3 full (cached), 4 partial
    admit(manager, second)
    run_chunk(manager, second, 3)
    assert list(manager.free_queue) == [5]
    manager.free(first)
    # Partial block 2 goes to the front; cached 1 then 0 to the back (tail first).
    assert list(manager.free_queue) == [2, 5, 1, 0]
    manager.free(second)
    assert list(manager.free_queue) == [4, 2, 5, 1, 0, 3]
    assert manager.num_cached_blocks == 3
    assert all(manager.blocks[i].ref_count == 0 for i in range(6))
    # New allocations evict from the front: uncached first, then LRU cached.
    third = make_request("c", list(range(100, 110)))  # 5 blocks
    admit(manager, third)
    assert third.block_table == [4, 2, 5, 1, 0]
    assert manager.num_cached_blocks == 1  # only block 3 (of "b") survives
    assert manager.blocks[1].block_hash is None


def test_cached_free_block_is_revived_by_a_hit():
    manager = BlockManager(num_blocks=4, block_size=2)
    first = make_request("a", [1, 2, 3])
    admit(manager, first)
    run_chunk(manager, first, 3)
    manager.free(first)
    assert manager.num_free_blocks == 4
    again = make_request("b", [1, 2, 3])
    computed = admit(manager, again)
    assert computed == [0]
    assert 0 not in manager.free_queue
    assert manager.blocks[0].ref_count == 1


def test_can_allocate_counts_revived_blocks_against_free_space():
    manager = BlockManager(num_blocks=2, block_size=2)
    first = make_request("a", [1, 2, 3])
    admit(manager, first)
    run_chunk(manager, first, 3)
    manager.free(first)
    again = make_request("b", [1, 2, 3, 4, 5])
    computed = manager.get_computed_blocks(again)
    assert computed == [0]
    # needs block 0 (revived from the free queue) + 2 more = 3 > 2 blocks in all
    assert not manager.can_allocate(again, computed, 3)


def test_prefix_caching_disabled_never_hits():
    manager = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    first = make_request("a", [1, 2, 3])
    admit(manager, first)
    run_chunk(manager, first, 3)
    assert manager.get_computed_blocks(make_request("b", [1, 2, 3])) == []
    assert manager.cached_blocks == {}


def test_rejects_zero_blocks():
    with pytest.raises(ValueError, match="num_blocks must be at least 1, got 0"):
        BlockManager(num_blocks=0, block_size=16)


# ---- invariants under random operation sequences ---------------------------------------

def check_invariants(manager: BlockManager, live: list[Request]) -> None:
    counts = [0] * manager.num_blocks
    for request in live:
        for block_id in request.block_table:
            counts[block_id] += 1
    for block in manager.blocks:
        assert block.ref_count == counts[block.block_id]
        in_free = block.block_id in manager.free_queue
        assert in_free == (block.ref_count == 0), "a block is free xor used"
    for block_hash, block_id in manager.cached_blocks.items():
        assert manager.blocks[block_id].block_hash == block_hash


operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "step", "free"]),
        st.integers(0, 5),  # which request / prompt family
        st.integers(1, 12),  # sizes
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.booleans())
def test_invariants_hold_and_everything_returns(ops, prefix_caching):
    manager = BlockManager(num_blocks=12, block_size=3, enable_prefix_caching=prefix_caching)
    live: list[Request] = []
    counter = 0
    for op, which, size in ops:
        if op == "admit":
            counter += 1
            # Shared prefixes across families make prefix-cache hits likely.
            tokens = [which] * 4 + list(range(size))
            request = make_request(f"r{counter}", tokens)
            computed = manager.get_computed_blocks(request)
            num_new = request.num_tokens - len(computed) * manager.block_size
            if manager.can_allocate(request, computed, num_new):
                manager.allocate(request, computed, num_new)
                run_chunk(manager, request, num_new)
                live.append(request)
        elif op == "step" and live:
            request = live[which % len(live)]
            request.token_ids.append(size)
            if manager.append_slots(request, 1):
                run_chunk(manager, request, 1)
            else:
                request.token_ids.pop()
        elif op == "free" and live:
            manager.free(live.pop(which % len(live)))
        check_invariants(manager, live)
    for request in live:
        manager.free(request)
    check_invariants(manager, [])
    assert manager.num_free_blocks == manager.num_blocks


def _state(manager: BlockManager) -> tuple:
    return ([block.ref_count for block in manager.blocks], list(manager.free_queue), manager.num_shared_blocks,
            manager.num_free_blocks, manager._num_free_cached)


@pytest.mark.parametrize("fork_at", [0, 5, 9, 12])
def test_reassign_equals_free_then_share(fork_at):
    """A beam's sequence taking over another beam (`reassign`) leaves the manager as
    `free` then `share` do: counts, the free queue's order, shared and cached counts; with
    the two tables alike up to `fork_at` tokens (a shared prompt, then blocks of their own,
    some cached, some partial)."""
    managers, pairs = [], []
    for _ in range(2):
        manager = BlockManager(num_blocks=24, block_size=4)
        source = make_request("s", list(range(14)))
        admit(manager, source)
        run_chunk(manager, source, 14)
        target = make_request("t", list(range(fork_at)) + list(range(100, 100 + 14 - fork_at)))
        admit(manager, target)
        run_chunk(manager, target, 14)
        other = make_request("o", list(range(200, 209)))  # frees some cached blocks around them
        admit(manager, other)
        run_chunk(manager, other, 9)
        manager.free(other)
        managers.append(manager)
        pairs.append((source, target))
    assert _state(managers[0]) == _state(managers[1])
    (source_a, target_a), (source_b, target_b) = pairs
    managers[0].free(target_a)
    managers[0].share(source_a, target_a)
    managers[1].reassign(target_b, source_b)
    assert _state(managers[0]) == _state(managers[1])
    assert target_a.block_table == target_b.block_table == source_b.block_table
    assert target_b.block_hashes == source_b.block_hashes and target_b.may_share and source_b.may_share
    assert target_b.num_registered_blocks == target_a.num_registered_blocks
    for manager, (source, target) in zip(managers, pairs, strict=True):
        manager.free(source)
        manager.free(target)
        assert manager.num_free_blocks == 24 and manager.num_shared_blocks == 0
