"""BlockPool: the physical KV blocks of the device cache (vLLM v1's `BlockPool`).

Owns: every block's ref count and prefix-cache hash, the free queues, the hash map (block hash -> block) and
eviction. Nobody else changes a ref count or a hash. It knows nothing about requests: the KV cache manager
(kv_cache_manager.py) decides which request holds which blocks and when a block is full and computed.

A block is in exactly one of three places:

    in use         ref_count > 0, listed in the block tables of ref_count requests
    cached-free    ref_count == 0, still holds the KV of a full, computed block and is in the hash map;
                   a new request with the same prefix can take it back (a prefix-cache hit);
                   evicted least-recently-freed first when fresh blocks run out
    clean-free     ref_count == 0, holds nothing worth keeping

Prefix caching hashes every full block, chained from its parent:
    hash(block i) = hash((hash(block i-1), token ids of block i))
so equal hashes mean equal whole prefixes. A hit also compares token ids, so a hash collision can never hand a
request someone else's KV. A block is hashed (`cache_block`) only after the step that computed it succeeded.

Every change is recorded in the step journal (journal.py), so a failed step can undo it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from minivllm.core.journal import Journaled, StepJournal, journaled, journaled_fields

logger = logging.getLogger(__name__)

ROOT_HASH = 0   # the "parent hash" of a sequence's first block


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained block hash. Python hashes tuples of ints the same in every process (no PYTHONHASHSEED),
    so hashes are stable across runs; a 64-bit collision is possible in principle, which is why a hit
    also compares the block's token ids."""
    return hash((parent_hash, token_ids))


@dataclass
class Block(Journaled):
    block_id: int
    ref_count: int = journaled(0)
    block_hash: int | None = journaled(None)       # set once the block is full and its step committed
    token_ids: tuple[int, ...] = journaled(())     # the tokens it holds when hashed (checked on every hit)


Block.JOURNALED = journaled_fields(Block)


@dataclass
class BlockEvents:
    """What happened to blocks since the last `pop_events()`: the step trace reads this.

    swap_out / swap_in are (src, dst) block pairs the model runner copies before the next forward:
    device -> CPU pool for swap_out, CPU pool -> device for swap_in."""
    allocated: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    prefix_hit_blocks: list[int] = field(default_factory=list)
    # The prefix cache's changes, as vLLM's KV cache events name them (engine/kv_events.py publishes them):
    # ("BlockStored", hash, parent hash or None, token ids), ("BlockRemoved", hash), ("AllBlocksCleared",)
    kv_cache: list[tuple] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def lengths(self) -> tuple[int, ...]:
        return tuple(len(getattr(self, name)) for name in self.__dataclass_fields__)

    def truncate(self, lengths: tuple[int, ...]) -> None:
        """Forget the events recorded after `lengths()` was taken (a rolled-back step's)."""
        for name, n in zip(self.__dataclass_fields__, lengths):
            del getattr(self, name)[n:]


@dataclass(frozen=True)
class PoolSnapshot:
    """The whole pool at one moment (O(num_blocks) to take: on demand, never per step)."""
    ref_counts: tuple[int, ...]          # per physical block
    cached_free: frozenset[int]          # ref count 0, still in the prefix cache


class BlockPool(Journaled):
    JOURNALED = frozenset({"num_evictions"})

    def __init__(self, num_blocks: int, journal: StepJournal, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks is {num_blocks}; the KV pool needs at least one block.")
        self.num_blocks = num_blocks
        self.journal = journal
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        for block in self.blocks:
            block.journal = journal
        self.clean_free: deque[int] = deque(range(num_blocks))
        # cached-free blocks -> the tick at which they were freed; dict order is LRU order (front evicted first)
        self.cached_free: OrderedDict[int, int] = OrderedDict()
        self._tick = 0
        self.hash_to_block: dict[int, int] = {}
        self.num_evictions = 0
        self.events = BlockEvents()

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.clean_free) + len(self.cached_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens after this prefix, or None."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    # ------------------------------------------------------------------ taking and returning blocks
    def take_fresh(self) -> int:
        """A free block with ref count 1 and no hash: a clean one, or else the least recently freed cached one
        (evicted: its hash leaves the map). The caller checked `num_free_blocks`."""
        j = self.journal
        if self.clean_free:
            block_id = self.clean_free.popleft()
            j.record(lambda: self.clean_free.appendleft(block_id))
        else:
            block_id, tick = self.cached_free.popitem(last=False)
            j.record(lambda: self._insert_cached(block_id, tick))
            self._uncache(block_id)
            self.num_evictions += 1
            self.events.evicted.append(block_id)
        self.blocks[block_id].ref_count = 1
        self.events.allocated.append(block_id)
        return block_id

    def touch(self, block_id: int) -> None:
        """One more holder of a cached block (a prefix hit); a cached-free block leaves the free queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            tick = self.cached_free.pop(block_id)
            self.journal.record(lambda: self._insert_cached(block_id, tick))
        block.ref_count += 1
        self.events.prefix_hit_blocks.append(block_id)

    def free(self, block_id: int) -> None:
        """One holder fewer. At zero a hashed block (the one the map points to) becomes cached-free, at the
        back of the LRU queue; any other block becomes clean-free."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed with ref count {block.ref_count}"
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        self.events.freed.append(block_id)
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            self._tick += 1
            self.cached_free[block_id] = self._tick
            self.journal.record(lambda: self.cached_free.pop(block_id))
        else:
            if block.block_hash is not None:        # a duplicate of a cached block: its hash is no use
                self._uncache(block_id)
            self.clean_free.append(block_id)
            self.journal.record(self.clean_free.pop)

    def _insert_cached(self, block_id: int, tick: int) -> None:
        """Undo of taking a block out of the cached-free queue: back in, at its place in LRU order (a re-sort,
        only on the rollback path, when it does not belong at the back)."""
        out_of_order = bool(self.cached_free) and next(reversed(self.cached_free.values())) > tick
        self.cached_free[block_id] = tick
        if out_of_order:
            self.cached_free = OrderedDict(sorted(self.cached_free.items(), key=lambda kv: kv[1]))

    # ------------------------------------------------------------------ hashes
    def cache_block(self, block_id: int, block_hash: int, token_ids: tuple[int, ...],
                    parent_hash: int | None = None) -> None:
        """Record that a held block is full and computed. If another block already caches the same prefix,
        that one stays in the map and this one keeps the hash (its children chain from it) without being shared.
        `parent_hash`: the previous block's (None for a first block), for the KV cache events."""
        block = self.blocks[block_id]
        assert block.ref_count > 0 and block.block_hash is None, f"block {block_id} cannot be cached now"
        block.block_hash = block_hash
        block.token_ids = token_ids
        if block_hash not in self.hash_to_block:
            self.hash_to_block[block_hash] = block_id
            self.journal.record(lambda: self.hash_to_block.pop(block_hash))
            self.events.kv_cache.append(("BlockStored", block_hash, parent_hash,
                                         tuple(t for t in token_ids if isinstance(t, int))))

    def _uncache(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if self.hash_to_block.get(block.block_hash) == block_id:
            h = block.block_hash
            del self.hash_to_block[h]
            self.journal.record(lambda: self.hash_to_block.__setitem__(h, block_id))
            self.events.kv_cache.append(("BlockRemoved", h))
        block.block_hash = None
        block.token_ids = ()

    def drop_cached(self, block_id: int) -> None:
        """Forget a block's hash because its KV can no longer be trusted (a failed step may have written it).
        A cached-free block becomes clean-free."""
        if self.blocks[block_id].block_hash is None:
            return
        self._uncache(block_id)
        if block_id in self.cached_free:
            tick = self.cached_free.pop(block_id)
            self.journal.record(lambda: self._insert_cached(block_id, tick))
            self.clean_free.append(block_id)
            self.journal.record(self.clean_free.pop)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (its KV stays, but nobody can hit it any more) and return True; as vLLM's, only
        when no block is in use: otherwise warn, change nothing and return False (a held block would keep its hash,
        and later requests would still hit it: the reset would be partial)."""
        num_used = self.num_blocks - self.num_free_blocks
        if num_used:
            logger.warning("Failed to reset prefix cache because some blocks (%d) are not freed yet", num_used)
            return False
        while self.cached_free:
            self.drop_cached(next(iter(self.cached_free)))
        self.events.kv_cache.append(("AllBlocksCleared",))
        return True

    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(tuple(b.ref_count for b in self.blocks), frozenset(self.cached_free))

    def pop_events(self) -> BlockEvents:
        events, self.events = self.events, BlockEvents()
        return events

    # ------------------------------------------------------------------ invariants
    def check_integrity(self, holders: dict[int, int]) -> None:
        """Assert the pool's invariants, given how many block tables list each block."""
        free = set(self.clean_free) | set(self.cached_free)
        assert len(free) == len(self.clean_free) + len(self.cached_free), "a block is free twice"
        for block in self.blocks:
            held = holders.get(block.block_id, 0)
            assert block.ref_count == held, (
                f"block {block.block_id}: ref_count {block.ref_count} but held by {held} block tables")
            assert (block.block_id in free) == (held == 0), (
                f"block {block.block_id}: free={block.block_id in free} but held by {held}")
            assert (block.block_hash is None) == (block.token_ids == ()), f"block {block.block_id}: half hashed"
        assert len(free) + len(holders) == self.num_blocks, "free + in use != total"
        for h, b in self.hash_to_block.items():
            block = self.blocks[b]
            assert block.block_hash == h and block.token_ids, f"hash map entry {h} -> block {b} does not match"
            assert b not in self.clean_free, f"block {b} is in the hash map and clean-free"
        for b in self.clean_free:
            assert self.blocks[b].block_hash is None, f"clean-free block {b} still has a hash"
        ticks = list(self.cached_free.values())
        assert ticks == sorted(ticks), "the cached-free queue is out of LRU order"
        for b in self.cached_free:
            assert self.hash_to_block.get(self.blocks[b].block_hash) == b, f"cached-free block {b} not in map"
