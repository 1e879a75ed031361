"""Host KV tier: exact slots, queued copies, LRU order and pinning (HostKVTier and the
block manager over it), the CPU backend's copies round-tripping block contents, and the
engine's counters on a real SmolLM2-shaped cache."""

from __future__ import annotations

import pytest
import torch

from inflightllm.attention.torch_ref import TorchReferenceAttention
from inflightllm.block_manager import BlockManager
from inflightllm.host_kv_tier import HostKVTier, num_host_blocks
from inflightllm.request import Request
from inflightllm.sampling_params import SamplingParams
from tests.stub_model import reference_output, stub_engine


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(max_tokens=8))


def run_to_end(manager: BlockManager, request: Request) -> list[int]:
    """Admit, compute the whole prompt, register its full blocks, free it; returns its table."""
    computed = manager.get_computed_blocks(request)
    num_new = request.num_tokens - len(computed) * manager.block_size
    assert manager.can_allocate(request, computed, num_new)
    manager.allocate(request, computed, num_new)
    table = list(request.block_table)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    manager.free(request)
    return table


def test_num_host_blocks_from_the_budget():
    assert num_host_blocks(0, 1024) == 0
    assert num_host_blocks(10_000, 1024) == 9
    with pytest.raises(ValueError, match="bytes_per_block must be positive, got 0"):
        num_host_blocks(1024, 0)


def test_tier_offload_lru_and_pinning():
    tier = HostKVTier(num_blocks=2, block_size=4)
    assert tier.offload(b"a", (1,), None, device_block=5) is True
    assert tier.offload(b"b", (2,), b"a", device_block=6) is True
    assert tier.offload(b"a", (1,), None, device_block=9) is False  # held: refreshed, no copy
    assert list(tier.entries) == [b"b", b"a"]
    # Full: the LRU entry (b, slot 1) gives its slot to c; b's queued offload is dropped.
    assert tier.offload(b"c", (3,), b"b", device_block=7) is True
    assert {key: entry.slot for key, entry in tier.entries.items()} == {b"a": 0, b"c": 1}
    assert tier.pending_offloads == {0: 5, 1: 7}
    assert tier.offloaded_blocks_total == 3 - 1 and tier.evicted_blocks_total == 1
    assert tier.take_transfers() == ([(5, 0), (7, 1)], [])
    # An onload pins its slot until the step takes it: the next offload evicts the other entry.
    assert tier.lookup(b"a", (1,), None) is not None
    assert tier.lookup(b"a", (1,), b"x") is None  # another parent: a collision, no hit
    slot = tier.reserve(b"a")
    tier.bind_onload(slot, device_block=3)
    assert tier.offload(b"d", (4,), None, device_block=8) is True
    assert {key: entry.slot for key, entry in tier.entries.items()} == {b"a": 0, b"d": 1}
    # Both slots pinned or taken by this step's copies: a new offer is dropped, nothing lost.
    tier.reserve(b"d")
    assert tier.offload(b"e", (5,), None, device_block=2) is False
    assert tier.dropped_blocks_total == 1
    tier.check()
    # A device block reused before its onload ran drops the onload.
    assert tier.cancel_onload(3) is True and tier.cancel_onload(3) is False
    tier.bind_onload(1, device_block=4)
    assert tier.take_transfers() == ([(8, 1)], [(1, 4)])
    tier.check()


def test_evicted_blocks_go_to_host_and_come_back_on_a_prefix_hit():
    tier = HostKVTier(num_blocks=8, block_size=4)
    manager = BlockManager(num_blocks=4, block_size=4, host_tier=tier)
    first = make_request("a", list(range(9)))  # blocks 0, 1 full (cached), block 2 partial
    assert run_to_end(manager, first) == [0, 1, 2]
    assert manager.take_transfers() == ([], [])
    # Another prompt of 4 blocks takes every block: the cached 1 and 0 are offloaded, in
    # LRU order (the unhashed block 2 and the never-used block 3 go first; a's tail before
    # its head).
    other = make_request("b", list(range(100, 116)))
    assert run_to_end(manager, other) == [2, 3, 1, 0]
    assert manager.take_transfers() == ([(1, 0), (0, 1)], [])
    assert tier.num_held_blocks == 2
    # The first prompt again: its two blocks are not on the device any more but in host
    # slots 1 (its block 0) and 0 (its block 1); they come back into the free blocks at the
    # LRU's front (b's tail, blocks 0 and 1, offloaded first to slots 2 and 3) with queued
    # onloads, and count as computed.
    again = make_request("c", list(range(9)))
    computed = manager.get_computed_blocks(again)
    assert computed == [0, 1]
    assert manager.take_transfers() == ([(0, 2), (1, 3)], [(1, 0), (0, 1)])
    manager.allocate(again, computed, 1)
    assert again.num_computed_tokens == 8 and manager.host_hit_tokens == 8
    assert manager.prefix_cache_hits == 8
    # Its last token's block is block 3 (b's second block: offloaded too).
    assert again.block_table == [0, 1, 3] and manager.take_transfers() == ([(3, 4)], [])
    assert tier.onloaded_blocks_total == 2 and tier.offloaded_blocks_total == 5
    tier.check()


def test_onloads_leave_a_free_block_and_stop_the_chain_there():
    tier = HostKVTier(num_blocks=8, block_size=2)
    manager = BlockManager(num_blocks=4, block_size=2, host_tier=tier)
    run_to_end(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7]))  # 3 full blocks cached
    run_to_end(manager, make_request("b", [9, 9, 8, 8, 7, 7, 6, 6]))  # evicts all three to host
    running = make_request("d", [20, 21, 22])
    manager.allocate(running, [], 3)  # holds 2 blocks: 2 are free
    manager.take_transfers()
    assert tier.num_held_blocks == 5
    # 2 free blocks, none a device hit: 1 host hit comes back (one block stays free), and
    # the chain stops there.
    again = make_request("c", [1, 2, 3, 4, 5, 6, 7])
    assert len(manager.get_computed_blocks(again)) == 1
    _, onloads = manager.take_transfers()
    assert len(onloads) == 1 and manager.num_free_blocks == 2


def test_a_failed_step_forgets_what_its_copies_filled():
    tier = HostKVTier(num_blocks=4, block_size=4)
    manager = BlockManager(num_blocks=3, block_size=4, host_tier=tier)
    run_to_end(manager, make_request("a", list(range(5))))  # block 0 cached
    run_to_end(manager, make_request("b", list(range(50, 62))))  # evicts block 0 to slot 0
    first = manager.take_transfers()
    assert first == ([(0, 0)], [])
    again = make_request("c", list(range(5)))
    assert manager.get_computed_blocks(again) == [0]
    offloads, onloads = manager.take_transfers()
    manager.discard_transfers(offloads, onloads)
    # Block 0's onload may not have run: its key is gone from the device cache (the block
    # is the LRU's front again); the host entry stays, so the next lookup onloads it anew.
    assert manager.blocks[0].block_hash is None and next(iter(manager.free_queue)) == 0
    assert manager.get_computed_blocks(again) == [0]
    assert manager.take_transfers() == ([], [(0, 0)])
    # An offload that may not have run: its slot's entry is dropped.
    manager.discard_transfers(first[0], [])
    assert tier.num_held_blocks == 0 and sorted(tier.free_slots) == [0, 1, 2, 3]
    tier.check()


def test_cpu_backend_round_trips_blocks_through_the_host_tier():
    attention = TorchReferenceAttention(num_heads=4, num_kv_heads=2, head_dim=8)
    attention.allocate_kv_cache(6, 4, 3, 2, 8, torch.float32, torch.device("cpu"))
    per_block = attention.allocate_host_tier(5)
    assert per_block == 3 * 2 * 4 * 2 * 8 * 4  # layers x (K, V) x tokens x heads x dim x float32
    generator = torch.Generator().manual_seed(0)
    for cache in attention.key_cache + attention.value_cache:
        cache.copy_(torch.randn(cache.shape, generator=generator))
    before = [c.clone() for c in attention.key_cache + attention.value_cache]
    attention.offload_blocks([(1, 4), (3, 0)])
    for cache in attention.key_cache + attention.value_cache:
        cache.zero_()
    attention.onload_blocks([(4, 5), (0, 2)])
    for old, new in zip(before, attention.key_cache + attention.value_cache):
        assert torch.equal(new[20:24], old[4:8]) and torch.equal(new[8:12], old[12:16])
        assert not new[:8].any() and not new[12:20].any()


def test_engine_counts_host_hits_and_copies():
    """A conversation whose first turn is evicted by other prompts comes back from host."""
    engine = stub_engine(num_blocks=8, block_size=4, num_host_blocks=16, max_batch_size=2)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    engine.add_request("turn1", prompt, SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    for index in range(3):  # other prompts evict it
        engine.add_request(f"other{index}", [50 + index] * 20, SamplingParams(max_tokens=2))
        while engine.has_unfinished():
            engine.step()
    history = prompt + reference_output(prompt, 3)
    engine.add_request("turn2", history + [7, 7, 7], SamplingParams(max_tokens=4))
    tokens = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
    assert tokens == reference_output(history + [7, 7, 7], 4)
    assert engine.runner.violations == []
    stats = engine.stats()
    assert stats.prefix_cache_host_hits == 16  # the first 4 blocks, from host
    assert stats.host_kv_onloaded_blocks_total == 4
    assert stats.host_kv_offloaded_blocks_total >= 4 and stats.host_kv_blocks_total == 16
    assert 4 <= stats.host_kv_blocks_held <= 16


def test_the_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="host_kv_cache_bytes > 0 needs enable_kv_cache_reuse: true"):
        stub_engine(num_blocks=8, num_host_blocks=4, enable_kv_cache_reuse=False)


def test_a_failed_step_with_onloads_leaves_the_cache_right():
    """A step that raises after its host hits were queued: its requests fail, the device keys
    of the onloaded blocks are dropped, and the same prefix later is computed right."""
    from inflightllm.faults import STEP_FAULT_SEED

    engine = stub_engine(num_blocks=8, block_size=4, num_host_blocks=16, max_batch_size=1, fault_injection=True)

    def finish(request_id, prompt, **params):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=3, **params))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        return outputs

    prompt = list(range(1, 18))
    finish("first", prompt)
    for index in range(3):
        finish(f"other{index}", [60 + index] * 20)
    before = engine.stats().host_kv_onloaded_blocks_total
    [failed] = finish("fails", prompt + [5], seed=STEP_FAULT_SEED)
    assert failed.error is not None and "injected model step fault" in failed.error
    assert engine.stats().host_kv_onloaded_blocks_total == before + 4
    manager = engine.block_manager
    hashes = manager._block_hashes(make_request("probe", prompt + [5]), 4)
    assert not any(key in manager.cached_blocks for key in hashes)  # dropped with the failed step
    outputs = finish("again", prompt + [5])
    assert [t for o in outputs for t in o.new_token_ids] == reference_output(prompt + [5], 3)
    assert engine.runner.violations == []
    manager.host_tier.check()
