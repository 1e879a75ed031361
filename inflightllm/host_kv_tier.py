"""A second tier of the prefix cache in host memory: blocks the GPU cache evicts are
kept in host slots and come back on a prefix hit instead of being recomputed.

Bookkeeping only (pure Python; the runner's attention backend does the copies). The tier
holds `num_blocks` host slots, each keyed by the same chain hash as the device prefix
cache (inflightllm.block_manager.chain_hash), with the block's token ids and parent key
for the same collision check, in LRU order (front = evicted first).

- Offload: when the block manager reuses a free cached device block (evicting its key),
  it calls `offload(key, ..., device block)`. A key the tier holds already is only
  refreshed (inclusive tier: its contents are the same); else a free slot, or the LRU
  entry's slot, takes it and a (device block, host slot) copy is queued.
- Onload: a prefix lookup that runs out of device hits continues the chain here; each hit
  gets a fresh device block and a (host slot, device block) copy is queued; the entry
  stays (a later eviction of that device block costs no copy).
- The queued copies travel in the next step (`take_transfers`); the runner performs all
  offloads first (reading device blocks before anything in the step writes them), then the
  copy-on-write copies, then the onloads. Two rules keep that order right within one step:
  a slot with an onload queued is pinned (the LRU skips it, so no offload overwrites it
  before it is read), and a device block that is reused again before the step runs drops
  its queued onload (`cancel_onload`: its contents are no longer wanted).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class HostEntry:
    """One host slot's contents: a full block's key, tokens and parent key."""

    slot: int
    token_ids: tuple[int, ...]
    parent_hash: bytes | None


def num_host_blocks(host_kv_cache_bytes: int, bytes_per_block: int) -> int:
    """Host slots in a budget of `host_kv_cache_bytes` for blocks of `bytes_per_block`
    (K and V of every layer on one rank); 0 turns the tier off."""
    if host_kv_cache_bytes <= 0:
        return 0
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    return host_kv_cache_bytes // bytes_per_block


class HostKVTier:
    """Host slots of the prefix cache: LRU over chain-hash keys, queued copies each way."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"a host KV tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # key -> entry, LRU first
        self.free_slots: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._slot_keys: list[bytes | None] = [None] * num_blocks
        # Queued for the next step: host slot -> device block (a slot reused again before the
        # step runs keeps only its last offload), device block -> host slot.
        self.pending_offloads: dict[int, int] = {}
        self.pending_onloads: dict[int, int] = {}
        self._pinned: dict[int, int] = {}  # host slot -> queued onloads reading it
        # Counters.
        self.offloaded_blocks_total = 0
        self.onloaded_blocks_total = 0
        self.dropped_blocks_total = 0  # offers refused: every slot pinned by a queued onload
        self.evicted_blocks_total = 0  # entries the LRU gave up for newer ones

    # ---- counts ---------------------------------------------------------------------
    @property
    def num_held_blocks(self) -> int:
        return len(self.entries)

    # ---- lookups ----------------------------------------------------------------------
    def lookup(self, key: bytes, token_ids: tuple[int, ...], parent_hash: bytes | None) -> HostEntry | None:
        """The entry holding exactly this block (same key, tokens and parent key), or None."""
        entry = self.entries.get(key)
        if entry is None or entry.token_ids != token_ids or entry.parent_hash != parent_hash:
            return None
        return entry

    # ---- the two directions -------------------------------------------------------------
    def offload(self, key: bytes, token_ids: tuple[int, ...], parent_hash: bytes | None, device_block: int) -> bool:
        """A device block holding `key` is about to be reused: keep its contents. Returns
        True when a copy was queued (False: held already, or no slot could be freed)."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return False
        slot = self._free_slot()
        if slot is None:
            self.dropped_blocks_total += 1
            return False
        self.entries[key] = HostEntry(slot, token_ids, parent_hash)
        self._slot_keys[slot] = key
        self.pending_offloads[slot] = device_block
        self.offloaded_blocks_total += 1
        return True

    def reserve(self, key: bytes) -> int:
        """Pin the slot holding `key` for a copy back (the LRU will not give it away until
        the step takes its copies) and refresh it; returns the slot."""
        entry = self.entries[key]
        self.entries.move_to_end(key)
        self._pinned[entry.slot] = self._pinned.get(entry.slot, 0) + 1
        return entry.slot

    def bind_onload(self, slot: int, device_block: int) -> None:
        """Queue the copy of a reserved `slot` into `device_block` (a fresh block that takes
        the slot's key in the device cache)."""
        if slot not in self._pinned:
            raise RuntimeError(f"host slot {slot} was not reserved before its onload")
        self.pending_onloads[device_block] = slot
        self.onloaded_blocks_total += 1

    def cancel_onload(self, device_block: int) -> bool:
        """`device_block` is reused before its queued onload ran: drop the onload. Returns
        whether one was queued."""
        slot = self.pending_onloads.pop(device_block, None)
        if slot is None:
            return False
        self._unpin(slot)
        self.onloaded_blocks_total -= 1
        return True

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The queued copies for the next step, and the queues emptied: (device block, host
        slot) offloads and (host slot, device block) onloads."""
        offloads = [(block, slot) for slot, block in self.pending_offloads.items()]
        onloads = [(slot, block) for block, slot in self.pending_onloads.items()]
        self.pending_offloads = {}
        self.pending_onloads = {}
        self._pinned = {}
        return offloads, onloads

    def forget_slots(self, slots: list[int]) -> None:
        """Drop the entries of `slots` (their copies may not have happened: a failed step)."""
        for slot in slots:
            key = self._slot_keys[slot]
            if key is not None:
                self._drop(key)

    # ---- internals ----------------------------------------------------------------------
    def _unpin(self, slot: int) -> None:
        count = self._pinned[slot] - 1
        if count:
            self._pinned[slot] = count
        else:
            del self._pinned[slot]

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for key, entry in self.entries.items():  # LRU first; pinned slots are few (this step's onloads)
            if entry.slot not in self._pinned:
                self._drop(key)  # appends its slot to free_slots
                self.evicted_blocks_total += 1
                return self.free_slots.pop()
        return None

    def _drop(self, key: bytes) -> None:
        entry = self.entries.pop(key)
        self._slot_keys[entry.slot] = None
        if self.pending_offloads.pop(entry.slot, None) is not None:
            self.offloaded_blocks_total -= 1  # its copy never runs
        self.free_slots.append(entry.slot)

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call it each step)."""
        held = {entry.slot for entry in self.entries.values()}
        assert len(held) == len(self.entries), "two entries share a host slot"
        assert held.isdisjoint(self.free_slots), "a held slot is also free"
        assert len(held) + len(self.free_slots) == self.num_blocks, "a host slot was lost"
        assert len(set(self.free_slots)) == len(self.free_slots), "a free slot is listed twice"
        for key, entry in self.entries.items():
            assert self._slot_keys[entry.slot] == key
        for slot in self.pending_offloads:
            assert slot in held, f"an offload into slot {slot}, which holds nothing"
        for slot in self.pending_onloads.values():
            assert slot in held and slot in self._pinned, f"an onload from slot {slot} not held or not pinned"
