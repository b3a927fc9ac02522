"""BlockManager: the paged KV cache's bookkeeping (vLLM's KVCacheManager / BlockSpaceManager).

Owns: which physical KV blocks are free, who holds each block (ref counts), and the prefix cache
(block hash -> block). Nobody else changes a ref count or a block table. It never touches tensors:
the model runner reads `request.block_table` and writes the KV, this module only decides where.

A block is in exactly one of three places:

    in use         ref_count > 0, listed in the block tables of ref_count running requests
    cached-free    ref_count == 0, still holds the KV of a full block and is in the hash map;
                   a new request with the same prefix can take it back (a prefix-cache hit);
                   evicted least-recently-freed first when fresh blocks run out
    clean-free     ref_count == 0, holds nothing worth keeping

Prefix caching hashes every *full* block, chained from its parent:
    hash(block i) = hash((hash(block i-1), token ids of block i))
so equal hashes mean equal whole prefixes. A hit also compares token ids, so a hash collision
can never hand a request someone else's KV.

A block is hashed when it is allocated for a step that fills it (as in vLLM v1), so a request admitted
later in the same step can already share it: in every layer the KV of the whole flat batch is stored
before any attention reads it. If the step never runs that block's tokens (its owner was preempted
first), `free` drops the hash again: a cached block always holds computed KV once a step is over.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from minivllm.core.request import Request


ROOT_HASH = 0   # the "parent hash" of a sequence's first block


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained block hash. Python hashes tuples of ints the same in every process (no PYTHONHASHSEED),
    so hashes are stable across runs; a 64-bit collision is possible in principle, which is why a hit
    also compares the block's token ids."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None       # set once the block is full and computed
    token_ids: tuple[int, ...] = ()     # the tokens it holds when hashed (checked on every hit)


@dataclass
class BlockEvents:
    """What happened to blocks since the last `pop_events()`: the step trace reads this.

    swap_out / swap_in are (src, dst) block pairs the model runner must copy before the next forward:
    device -> CPU pool for swap_out, CPU pool -> device for swap_in."""
    allocated: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    prefix_hit_blocks: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.clean_free: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()   # LRU order: front is evicted first
        self.hash_to_block: dict[int, int] = {}
        # Prefix-cache counters, in tokens (vLLM reports hit rate = hits / queries).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0
        self.events = BlockEvents()
        # The CPU swap pool (preemption_mode="swap"): plain free list, one owner per block, no sharing.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_block_tables: dict[str, list[int]] = {}     # request_id -> its blocks in the CPU pool

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.clean_free) + len(self.cached_free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache lookup
    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached full blocks that starts the request's tokens.

        Never the whole sequence: at least one token must still be computed to produce logits.
        Changes nothing (the blocks are claimed by `allocate_slots`).
        """
        if not self.enable_prefix_caching or request.block_table:
            return []
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size      # leave >= 1 token to compute
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = hash_block_tokens(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        return hits

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`.

        `computed_blocks` (from `get_computed_blocks`, first allocation only) are prefix-cache hits:
        they join the block table first and `request.num_computed_tokens` moves past them.
        All or nothing: returns False and changes nothing if the free blocks are not enough.
        """
        computed_blocks = computed_blocks or []
        num_cached = len(computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_cached + num_new_tokens
        num_fresh = self.blocks_needed(total) - len(request.block_table) - len(computed_blocks)
        # A hit on a cached-free block takes it out of the free pool too.
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return False

        if not request.block_table and self.enable_prefix_caching:   # first allocation: count the query
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free[block_id]
            block.ref_count += 1
            request.block_table.append(block_id)
            self.events.prefix_hit_blocks.append(block_id)
        request.num_computed_tokens += num_cached
        for _ in range(max(num_fresh, 0)):
            block_id = self._take_free_block()
            self.blocks[block_id].ref_count = 1
            request.block_table.append(block_id)
            self.events.allocated.append(block_id)
        self._cache_full_blocks(request, total)
        return True

    def _take_free_block(self) -> int:
        if self.clean_free:
            return self.clean_free.popleft()
        block_id, _ = self.cached_free.popitem(last=False)      # evict the least recently freed
        block = self.blocks[block_id]
        del self.hash_to_block[block.block_hash]
        block.block_hash, block.token_ids = None, ()
        self.num_evictions += 1
        self.events.evicted.append(block_id)
        return block_id

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the request's blocks that the first `num_tokens` tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_table))
        parent = ROOT_HASH
        for i in range(num_full):
            block = self.blocks[request.block_table[i]]
            if block.block_hash is None:
                chunk = tuple(request.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
                block.block_hash = hash_block_tokens(parent, chunk)
                block.token_ids = chunk
                # If another request already cached the same prefix, keep that one in the map;
                # this block keeps its hash (its children chain from it) but is not shared.
                self.hash_to_block.setdefault(block.block_hash, block.block_id)
            parent = block.block_hash

    # ------------------------------------------------------------------ freeing
    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks. Tail blocks are freed first, so they are evicted first."""
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for i in reversed(range(len(request.block_table))):
            block_id = request.block_table[i]
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} ref count went negative"
            if i >= num_computed_blocks and block.ref_count == 0 and block.block_hash is not None:
                # hashed for a step that never ran its tokens: its KV was never written
                if self.hash_to_block.get(block.block_hash) == block_id:
                    del self.hash_to_block[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            if block.ref_count == 0:
                self.events.freed.append(block_id)
                if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
                    self.cached_free[block_id] = None          # keep the KV for future hits
                else:
                    block.block_hash, block.token_ids = None, ()
                    self.clean_free.append(block_id)
        request.block_table = []
        request.num_computed_tokens = 0

    # ------------------------------------------------------------------ swapping (preemption_mode="swap")
    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_table) <= len(self.cpu_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Copy the request's blocks to the CPU pool and release them here. Its num_computed_tokens stays:
        the KV is not lost, only moved."""
        cpu_table = [self.cpu_free.popleft() for _ in request.block_table]
        pairs = list(zip(request.block_table, cpu_table))      # (device block, CPU block) to copy
        self.events.swap_out += pairs
        num_computed = request.num_computed_tokens
        self.free(request)
        request.num_computed_tokens = num_computed
        self.cpu_block_tables[request.request_id] = cpu_table
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        total = request.num_computed_tokens + num_new_tokens
        return self.blocks_needed(total) <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back into fresh device blocks (they are re-hashed after the
        next step, like any newly computed block)."""
        cpu_table = self.cpu_block_tables.pop(request.request_id)
        pairs = []                                               # (CPU block, device block) to copy
        for cpu_block in cpu_table:
            block_id = self._take_free_block()
            self.blocks[block_id].ref_count = 1
            request.block_table.append(block_id)
            self.events.allocated.append(block_id)
            pairs.append((cpu_block, block_id))
        self.events.swap_in += pairs
        self.cpu_free.extend(cpu_table)
        return pairs

    def free_swapped(self, request: Request) -> None:
        """Drop a swapped request's CPU blocks (it was aborted while swapped out)."""
        self.cpu_free.extend(self.cpu_block_tables.pop(request.request_id, []))
        request.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (the KV stays, but nobody can hit it any more)."""
        while self.cached_free:
            block_id, _ = self.cached_free.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.block_hash]
            block.block_hash, block.token_ids = None, ()
            self.clean_free.append(block_id)

    def pop_events(self) -> BlockEvents:
        events, self.events = self.events, BlockEvents()
        return events

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    # ------------------------------------------------------------------ invariants
    def check_integrity(self, requests: list[Request]) -> None:
        """Assert every invariant, given all requests that may hold blocks. For tests and debug runs."""
        holders: dict[int, int] = {}
        for req in requests:
            assert len(set(req.block_table)) == len(req.block_table), f"{req} lists a block twice"
            for b in req.block_table:
                holders[b] = holders.get(b, 0) + 1
        free = set(self.clean_free) | set(self.cached_free)
        assert len(free) == len(self.clean_free) + len(self.cached_free), "a block is free twice"
        for block in self.blocks:
            held = holders.get(block.block_id, 0)
            assert block.ref_count == held, (
                f"block {block.block_id}: ref_count {block.ref_count} but held by {held} block tables")
            assert (block.block_id in free) == (held == 0), (
                f"block {block.block_id}: free={block.block_id in free} but held by {held}")
        assert len(free) + len(holders) == self.num_blocks, "free + in use != total"
        for h, b in self.hash_to_block.items():
            block = self.blocks[b]
            assert block.block_hash == h and len(block.token_ids) == self.block_size, (
                f"hash map entry {h} -> block {b} does not match the block's contents")
            assert b not in self.clean_free, f"block {b} is in the hash map and clean-free"
        for b in self.cached_free:
            assert self.hash_to_block.get(self.blocks[b].block_hash) == b, f"cached-free block {b} not in map"
        cpu_held = [b for table in self.cpu_block_tables.values() for b in table]
        assert len(cpu_held) == len(set(cpu_held)) and not set(cpu_held) & set(self.cpu_free), (
            "a CPU block is owned twice, or owned and free")
        assert len(cpu_held) + len(self.cpu_free) == self.num_cpu_blocks, "CPU pool: free + in use != total"
        # A request's hashed blocks hold exactly its tokens.
        for req in requests:
            for i, b in enumerate(req.block_table):
                block = self.blocks[b]
                if block.block_hash is not None:
                    chunk = tuple(req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
                    assert block.token_ids == chunk, f"{req}: block {b} holds other tokens"
