"""Physical KV-cache blocks: free queue, reference counts and the prefix cache.

The block manager knows blocks, not policy. Requests own their block tables; the
manager hands out and takes back block ids, counts references, and remembers which
full blocks hold which tokens so a later request with the same prefix can share them.

Prefix caching: a full block is identified by a SHA-256 chain over its parent's key, its
own token ids and anything else that changes its K/V (`extra_key`, e.g. a LoRA id
later). Keys are bytes, equal in every process (Python's `hash()` of None is not, on
3.11), so ranks can share them. A hit is accepted only if the cached block's tokens
*and* its recorded parent key equal the request's (a forged or accidental collision
of one block's key cannot make two different prefixes share a block). Freed blocks keep their contents
and hash and wait in the free queue; the queue's front is evicted first:
- blocks without a hash (partial or never cached) go to the front, so they are reused
  before any cached content is lost;
- cached blocks go to the back, a request's blocks in reverse order, so the tail of a
  sequence (least likely to be shared) is evicted before its prefix — an LRU.

With a host tier (inflightllm.host_kv_tier, `engine.host_kv_cache_bytes`), an evicted cached
block is offered to host memory first, and a prefix lookup that runs out of device hits
continues the chain there: each host hit is copied back into a fresh block that takes its
key in the device cache (free and cached, like any other hit) before the request is
admitted, so admission itself is unchanged.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from inflightllm.host_kv_tier import HostKVTier
from inflightllm.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: bytes | None = None  # the key of the block before it when it was cached
    onloaded: bool = False  # its contents come from the host tier (counted as host hits when taken)


ROOT_KEY = hashlib.sha256(b"inflightllm prefix cache v1").digest()


def chain_hash(parent_hash: bytes | None, token_ids: tuple[int, ...], extra_key: bytes = b"") -> bytes:
    """SHA-256 key of a full block given its parent's key (None for the first block):
    over the parent key, the token ids (little-endian int64) and `extra_key`."""
    digest = hashlib.sha256(parent_hash if parent_hash is not None else ROOT_KEY)
    tokens = array("q", token_ids)
    if tokens.itemsize != 8 or array("q", [1]).tobytes()[0] != 1:  # pragma: no cover - exotic platforms
        raise RuntimeError("chain_hash needs little-endian 64-bit integers")
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(tokens.tobytes())
    digest.update(len(extra_key).to_bytes(4, "little"))
    digest.update(extra_key)
    return digest.digest()


class BlockManager:
    """Allocates fixed-size KV blocks to requests; optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_tier: HostKVTier | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError("a host KV tier extends the prefix cache: it needs prefix caching on")
        self.host_tier = host_tier
        self.host_hit_tokens = 0  # prefix-hit tokens whose blocks came back from the host tier
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block key -> block id
        self._num_free_cached = 0  # free blocks that hold a key (kept as blocks move)
        # Counters (prefix-cache hit rate = hit tokens / queried tokens).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Copy-on-write: (source block, destination block) copies the next step must do
        # before its forward, and how many were made in all.
        self.pending_copies: list[tuple[int, int]] = []
        self.cow_copies_total = 0
        self._num_shared = 0  # blocks with more than one reference (kept as references change)

    # ---- counts -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including cached ones that may be evicted)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold reusable cached content."""
        return self._num_free_cached

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one request (sequence groups, prefix-cache hits)."""
        return self._num_shared

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first `num_full_blocks` full blocks (memoised
        on the request: token ids of full blocks never change)."""
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_full_blocks:
            index = len(hashes)
            tokens = tuple(request.token_ids[index * size : (index + 1) * size])
            hashes.append(chain_hash(hashes[-1] if hashes else None, tokens))
        return hashes if len(hashes) == num_full_blocks else hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request, onload: bool = True) -> list[int]:
        """Cached blocks that hold a prefix of the request's tokens.

        At least one token is always left to compute (its logits are needed), so a
        fully cached token sequence gives up its last block.

        With a host tier and `onload`, the chain goes on in host memory where the device
        cache has no block: each host hit takes a fresh free block now (its copy back is
        queued for the next step) that joins the device cache as a free cached block, and
        is returned like a device hit. At least one free block is left besides the hits.
        (The scheduler passes onload=False while planning a group's admission: a later
        member's onload must not take a free block an earlier member's plan counts on.)
        """
        if not self.enable_prefix_caching:
            return []
        max_full_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int | None] = []  # device block id, or None for a host hit
        host_keys: list[bytes] = []
        tier = self.host_tier if onload else None
        size = self.block_size
        for index, block_hash in enumerate(self._block_hashes(request, max_full_blocks)):
            tokens = tuple(request.token_ids[index * size : (index + 1) * size])
            parent = self._parent_key(request, index)
            block_id = self.cached_blocks.get(block_hash)
            if block_id is not None:
                block = self.blocks[block_id]
                if block.token_ids != tokens or block.parent_hash != parent:
                    break  # a key collision: never share a block with other contents or another prefix
                hits.append(block_id)
            elif tier is not None and tier.lookup(block_hash, tokens, parent) is not None:
                hits.append(None)
                host_keys.append(block_hash)
            else:
                break
        if not host_keys:
            return hits
        return self._onload(hits, host_keys)

    def _onload(self, hits: list[int | None], host_keys: list[bytes]) -> list[int]:
        """Give the host hits (None in `hits`, keys in order in `host_keys`) fresh device
        blocks, as many as leave one free block besides the free device hits; the chain
        stops at the first host hit that gets none."""
        tier = self.host_tier
        free_hits = [block_id for block_id in hits if block_id is not None and self.blocks[block_id].ref_count == 0]
        room = self.num_free_blocks - len(free_hits) - 1
        if room < len(host_keys):
            cut = [i for i, block_id in enumerate(hits) if block_id is None][max(room, 0)]
            hits = hits[:cut]
            host_keys = host_keys[: max(room, 0)]
            if not host_keys:
                return hits
        # The free device hits to the back of the LRU (they are about to be used), so the
        # blocks taken below (from the front) are never one of them.
        for block_id in free_hits:
            self.free_queue.move_to_end(block_id)
        # Pin the host slots first: the evictions below offload blocks to the tier, which
        # must not give these entries' slots away.
        slots = [tier.reserve(key) for key in host_keys]
        keys = iter(zip(host_keys, slots))
        result: list[int] = []
        for block_id in hits:
            if block_id is None:
                key, slot = next(keys)
                block_id, _ = self.free_queue.popitem(last=False)
                block = self.blocks[block_id]
                if block.block_hash is not None:
                    self._num_free_cached -= 1
                self._evict_if_cached(block)
                entry = tier.entries[key]
                block.block_hash, block.token_ids, block.parent_hash = key, entry.token_ids, entry.parent_hash
                block.onloaded = True
                self.cached_blocks[key] = block_id
                self.free_queue[block_id] = None  # free and cached, at the back
                self._num_free_cached += 1
                tier.bind_onload(slot, block_id)
            result.append(block_id)
        return result

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's queued copies for the next step ((device block, host slot)
        offloads, (host slot, device block) onloads); empty lists without a tier."""
        if self.host_tier is None:
            return [], []
        return self.host_tier.take_transfers()

    def discard_transfers(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        """A step carrying these copies failed (they may not have happened): forget the
        host entries they filled and the device cache keys of the blocks they filled."""
        if self.host_tier is None:
            return
        self.host_tier.forget_slots([slot for _, slot in offloads])
        for _, block_id in onloads:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            if block.ref_count == 0:
                self._num_free_cached -= 1
                self.free_queue.move_to_end(block_id, last=False)
            self._uncache(block)

    @staticmethod
    def _parent_key(request: Request, index: int) -> bytes | None:
        return request.block_hashes[index - 1] if index > 0 else None

    def _evict_if_cached(self, block: Block) -> None:
        """The block is being reused: drop its key (offered to the host tier first, unless
        another block holds the same key)."""
        tier = self.host_tier
        if tier is not None:
            tier.cancel_onload(block.block_id)  # its queued copy back is no longer wanted
            if block.block_hash is not None and self.cached_blocks.get(block.block_hash) == block.block_id:
                tier.offload(block.block_hash, block.token_ids, block.parent_hash, block.block_id)
        self._uncache(block)

    def _uncache(self, block: Block) -> None:
        block.onloaded = False
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block.block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.parent_hash = None

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache. Starts after
        the blocks this request already registered: O(new full blocks) per call."""
        if not self.enable_prefix_caching:
            return
        # Only tokens whose values are known (asynchronous scheduling computes one ahead).
        known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(known // self.block_size, len(request.block_table))
        if num_full <= request.num_registered_blocks:
            return
        self._block_hashes(request, num_full)
        hashes = request.block_hashes
        size = self.block_size
        first = request.num_registered_blocks
        request.num_registered_blocks = num_full
        for index in range(first, num_full):
            block = self.blocks[request.block_table[index]]
            if block.block_hash is not None:
                continue
            existing = self.cached_blocks.get(hashes[index])
            if existing is not None and existing != block.block_id:
                continue  # the same content is cached in another block already
            block.block_hash = hashes[index]
            block.token_ids = tuple(request.token_ids[index * size : (index + 1) * size])
            block.parent_hash = self._parent_key(request, index)
            self.cached_blocks[block.block_hash] = block.block_id

    # ---- allocation -----------------------------------------------------------------
    def _num_new_blocks(self, request: Request, computed_blocks: list[int], num_new_tokens: int) -> int:
        """Blocks to take from the free queue so the request can hold `num_new_tokens` more."""
        if request.block_table:  # running: grows its own table
            held = len(request.block_table)
            num_tokens_after = request.num_computed_tokens + num_new_tokens
        else:  # being admitted: starts from its cached prefix
            held = len(computed_blocks)
            num_tokens_after = held * self.block_size + num_new_tokens
        return max(0, self.blocks_for_tokens(num_tokens_after) - held)

    def admission_blocks(self, request: Request, computed_blocks: list[int], num_new_tokens: int) -> tuple[int, int]:
        """What admitting the request would take: (blocks out of the free queue: its new
        ones and its cached prefix blocks nobody holds, cached prefix blocks others hold)."""
        held = sum(1 for block_id in computed_blocks if self.blocks[block_id].ref_count > 0)
        reclaimed = len(computed_blocks) - held
        return self._num_new_blocks(request, computed_blocks, num_new_tokens) + reclaimed, held

    def can_allocate(self, request: Request, computed_blocks: list[int], num_new_tokens: int) -> bool:
        """Whether `allocate` would succeed for a request being admitted."""
        return self.admission_blocks(request, computed_blocks, num_new_tokens)[0] <= self.num_free_blocks

    def allocate(self, request: Request, computed_blocks: list[int], num_new_tokens: int) -> None:
        """Admit a request: share its cached prefix blocks and allocate room for
        `num_new_tokens` more. Call `can_allocate` first."""
        if request.block_table:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        if not self.can_allocate(request, computed_blocks, num_new_tokens):
            raise RuntimeError(f"not enough free KV blocks for request {request.request_id}")
        self._take_computed(request, computed_blocks)
        self._grow(request, num_new_tokens)

    def allocate_together(self, plans: list[tuple[Request, list[int], int]]) -> None:
        """Admit several requests (a sequence group) at once: every one's cached prefix is
        taken before any grows, so no one's growth evicts a cached block another shares.
        The caller checked that the blocks suffice."""
        for request, computed_blocks, _ in plans:
            if request.block_table:
                raise RuntimeError(f"request {request.request_id} already holds blocks")
            self._take_computed(request, computed_blocks)
        for request, _, num_new_tokens in plans:
            if self._num_new_blocks(request, [], num_new_tokens) > self.num_free_blocks:
                raise RuntimeError(f"not enough free KV blocks for request {request.request_id}")
            self._grow(request, num_new_tokens)

    def _take_computed(self, request: Request, computed_blocks: list[int]) -> None:
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.onloaded:
                block.onloaded = False
                self.host_hit_tokens += self.block_size
            if block.ref_count == 0:
                del self.free_queue[block_id]
                if block.block_hash is not None:
                    self._num_free_cached -= 1
            block.ref_count += 1
            if block.ref_count == 2:
                self._num_shared += 1
        request.block_table = list(computed_blocks)
        request.num_computed_tokens = len(computed_blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += request.num_computed_tokens

    def allocate_fresh(self, request: Request, num_tokens: int) -> None:
        """Admit a request whose first `request.num_computed_tokens` tokens come back from
        host memory (swap): fresh blocks for `num_tokens` tokens in all, no prefix sharing."""
        if request.block_table:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        needed = self.blocks_for_tokens(num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks for request {request.request_id}")
        computed = request.num_computed_tokens
        request.num_computed_tokens = 0
        self._grow(request, num_tokens)
        request.num_computed_tokens = computed

    def _shared_in_write_range(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indexes into the block table of shared blocks the next `num_new_tokens` tokens
        write into (at most the partial last block: full blocks are never written)."""
        if not request.may_share:
            return []
        table = request.block_table
        computed, size = request.num_computed_tokens, self.block_size
        first = computed // size
        end = min(len(table), -(-(computed + num_new_tokens) // size))
        if end - first == 1:  # a decode's one block (every step of every sequence of a group)
            return [first] if self.blocks[table[first]].ref_count > 1 else []
        blocks = self.blocks
        return [index for index in range(first, end) if blocks[table[index]].ref_count > 1]

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        needed = self._num_new_blocks(request, [], num_new_tokens)
        if request.may_share:
            needed += len(self._shared_in_write_range(request, num_new_tokens))
        return needed <= self.num_free_blocks

    def reassign(self, target: Request, source: Request) -> None:
        """`free(target)` then `share(source, target)`, touching only the blocks where their
        tables differ (a beam search's sequence that takes over another beam: the two hold
        the prompt's blocks and most of the output's alike). The blocks both hold keep their
        counts (at least 2 before, so the free never frees them)."""
        old, new = target.block_table, source.block_table
        common, limit = 0, min(len(old), len(new))
        while common < limit and old[common] == new[common]:
            common += 1
        self._release(old[common:])
        self._retain(new[common:])
        target.block_table = list(new)
        target.block_hashes = list(source.block_hashes)
        target.num_registered_blocks = source.num_registered_blocks
        source.may_share = target.may_share = True

    def share(self, source: Request, target: Request) -> None:
        """Give `target` (holding no blocks) the block table of `source`: every block gets
        one more reference; the first write into a shared block copies it (`append_slots`).
        The prefix-cache bookkeeping of the shared full blocks is shared too."""
        if target.block_table:
            raise RuntimeError(f"request {target.request_id} already holds blocks")
        self._retain(source.block_table)
        target.block_table = list(source.block_table)
        target.block_hashes = list(source.block_hashes)
        target.num_registered_blocks = source.num_registered_blocks
        source.may_share = target.may_share = True

    def _copy_on_write(self, request: Request, indexes: list[int]) -> None:
        """Replace the shared blocks at `indexes` of the table by private copies."""
        table = request.block_table
        for index in indexes:
            old = self.blocks[table[index]]
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._num_free_cached -= 1
            self._evict_if_cached(block)
            block.ref_count = 1
            old.ref_count -= 1  # still >= 1: another sequence holds it
            if old.ref_count == 1:
                self._num_shared -= 1
            table[index] = block_id
            self.pending_copies.append((old.block_id, block_id))
            self.cow_copies_total += 1
            request.table_rewritten = True

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of a running request. Returns False,
        allocating nothing, when there are not enough free blocks."""
        table = request.block_table
        if request.may_share:  # a sequence of a group: its partial block may be shared
            shared = self._shared_in_write_range(request, num_new_tokens)
            if shared:
                if not self.can_append(request, num_new_tokens):
                    return False
                self._copy_on_write(request, shared)
        if table and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # fits in the blocks it holds (most decode steps): nothing to allocate
        if not self.can_append(request, num_new_tokens):
            return False
        self._grow(request, num_new_tokens)
        return True

    def _grow(self, request: Request, num_new_tokens: int) -> None:
        needed = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        while len(request.block_table) < needed:
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._num_free_cached -= 1
            self._evict_if_cached(block)
            block.ref_count = 1
            request.block_table.append(block_id)

    def _release(self, block_ids: list[int]) -> None:
        """One reference less on each block, last block first: a block nobody holds goes to
        the free queue (uncached ones to its front, cached ones to its end, reusable until
        evicted)."""
        blocks = self.blocks
        for block_id in reversed(block_ids):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            if block.ref_count == 1:
                self._num_shared -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self._num_free_cached += 1

    def _retain(self, block_ids: list[int]) -> None:
        """One reference more on each block (held blocks: none is in the free queue)."""
        blocks = self.blocks
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_count += 1
            if block.ref_count == 2:
                self._num_shared += 1

    def free(self, request: Request) -> None:
        """Return the request's blocks; cached ones stay reusable until evicted."""
        self._release(request.block_table)
        request.block_table = []
        request.num_registered_blocks = 0
