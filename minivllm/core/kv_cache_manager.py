r"""KVCacheManager: which KV blocks each request holds (vLLM v1's `KVCacheManager`).

Owns: every request's block table (`request.block_table`: nobody else writes it), prefix-cache lookup,
allocation (all or nothing), hashing a request's newly computed full blocks when its step commits, freeing,
and swapping a request's blocks to and from the CPU tier. It never touches tensors or `num_computed_tokens`:
the model runner reads the block tables and writes the KV; the scheduler alone moves `num_computed_tokens`.

    request.all_token_ids  [ t0 ........................................ t(n-1) ]
    block_table            [ b0 | b1 | b2 | b3 ]                 block i holds tokens [i*bs, (i+1)*bs)
                             \_ hashed _/ \__ computed, not yet hashed (the step is open) / not computed __/
    num_cached_blocks[id]  = 2: blocks 0-1 are in the prefix cache; hashing resumes at block 2 (O(new blocks))

A block joins the prefix cache only after the step that filled it committed (`cache_blocks`, called by the
scheduler in `update_from_output`), so a step that fails can never leave an uncomputed block behind a hash.
Within the open step, the full blocks the step will compute are offered to requests admitted later in the same
step (`register_pending`): every layer stores the whole flat batch's KV before any attention reads it, so two
identical prompts arriving together compute their shared prefix once, as in vLLM. Pending offers end with the step.
"""

from __future__ import annotations

from minivllm.core.block_pool import ROOT_HASH, BlockPool, hash_block_tokens
from minivllm.core.journal import Journaled, StepJournal
from minivllm.core.request import Request
from minivllm.core.swap_space import SwapSpace


class KVCacheManager(Journaled):
    JOURNALED = frozenset({"prefix_cache_queries", "prefix_cache_hits"})

    def __init__(self, num_blocks: int, block_size: int, journal: StepJournal, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size is {block_size}; it must be >= 1.")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.journal = journal
        self.block_pool = BlockPool(num_blocks, journal, enable_prefix_caching)
        self.swap_space = SwapSpace(num_cpu_blocks, journal)
        self.num_cached_blocks: dict[str, int] = {}    # request_id -> its leading blocks that are hashed
        # Open step only: block hash -> (block, its tokens) for full blocks this step computes (not yet cached)
        self.pending: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._pending_hash: dict[int, int] = {}          # block -> its hash-to-be, for chaining past a pending hit
        # Prefix-cache counters, in prompt tokens (vLLM reports hit rate = hits / queries).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is in the CPU pool right now (swap preemption)."""
        return len(self.swap_space.tables)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache lookup
    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached full blocks that starts the request's tokens (a new request only).

        Never the whole sequence: at least one token must still be computed to produce logits.
        None for a request with prompt_logprobs: a cached prefix has no logits to score it with (as vLLM v1).
        Changes nothing (the blocks are claimed by `allocate_slots`).
        """
        if (not self.enable_prefix_caching or request.block_table
                or request.sampling_params.prompt_logprobs is not None):
            return []
        bs, tokens = self.block_size, request.all_token_ids
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range((len(tokens) - 1) // bs):                 # leave >= 1 token to compute
            chunk = request.block_key(i, bs)
            parent = hash_block_tokens(parent, chunk)
            block_id = self.block_pool.lookup(parent, chunk)
            if block_id is None and self.pending.get(parent, (None, None))[1] == chunk:
                block_id = self.pending[parent][0]          # computed by this very step, before anyone reads it
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def register_pending(self, request: Request, num_tokens: int) -> None:
        """The open step computes the request's tokens up to `num_tokens`: offer its blocks that become full to
        requests admitted later in this step. Offers are journaled and dropped by `clear_pending` at commit."""
        if not self.enable_prefix_caching:
            return
        pool, bs = self.block_pool, self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        parent = ROOT_HASH
        if start:
            last = request.block_table[start - 1]          # hashed, or itself a pending hit of this step
            parent = pool.blocks[last].block_hash if pool.blocks[last].block_hash is not None \
                else self._pending_hash[last]
        for i in range(start, min(num_tokens // bs, len(request.block_table))):
            chunk = request.block_key(i, bs)
            parent = hash_block_tokens(parent, chunk)
            block_id = request.block_table[i]
            if parent not in pool.hash_to_block and parent not in self.pending:
                self.pending[parent] = (block_id, chunk)
                self._pending_hash[block_id] = parent

                def undo(h=parent, b=block_id) -> None:
                    del self.pending[h], self._pending_hash[b]
                self.journal.record(undo)

    def clear_pending(self) -> None:
        self.pending.clear()
        self._pending_hash.clear()

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and after
        `computed_blocks`, the prefix-cache hits of a first allocation, which join the block table first).

        All or nothing: returns False and changes nothing if the free blocks are not enough.
        """
        pool = self.block_pool
        request.journal = self.journal          # its block table (and the scheduler's fields) are journaled from now
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_fresh = max(self.blocks_needed(total) - len(request.block_table) - len(computed_blocks), 0)
        num_revived = sum(1 for b in computed_blocks if pool.blocks[b].ref_count == 0)   # cached-free hits
        if num_fresh + num_revived > pool.num_free_blocks:
            return False
        if not request.block_table and self.enable_prefix_caching and request.num_computed_tokens == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        for block_id in computed_blocks:
            pool.touch(block_id)
        new_blocks = list(computed_blocks) + [pool.take_fresh() for _ in range(num_fresh)]
        if new_blocks:
            # a new list, not an in-place append: readers (the step trace) may keep the old one
            request.block_table = request.block_table + new_blocks
        if computed_blocks:
            self._set_num_cached(request.request_id, len(computed_blocks))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """The step that computed the request's tokens up to `num_computed_tokens` committed: hash its full blocks
        that are not hashed yet. O(new blocks): hashing resumes after the last block it hashed."""
        if not self.enable_prefix_caching:
            return
        pool, bs = self.block_pool, self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_computed_tokens // bs, len(request.block_table))
        if end <= start:
            return
        parent = pool.blocks[request.block_table[start - 1]].block_hash if start else ROOT_HASH
        for i in range(start, end):
            chunk = request.block_key(i, bs)
            block_hash = hash_block_tokens(parent, chunk)
            pool.cache_block(request.block_table[i], block_hash, chunk, parent if i else None)
            parent = block_hash
        self._set_num_cached(request.request_id, end)

    def _set_num_cached(self, request_id: str, n: int | None) -> None:
        old = self.num_cached_blocks.get(request_id)
        if n is None:
            self.num_cached_blocks.pop(request_id, None)
        else:
            self.num_cached_blocks[request_id] = n

        def undo() -> None:
            if old is None:
                self.num_cached_blocks.pop(request_id, None)
            else:
                self.num_cached_blocks[request_id] = old
        self.journal.record(undo)

    # ------------------------------------------------------------------ freeing
    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks. Tail blocks are freed first, so they are evicted first."""
        for block_id in reversed(request.block_table):
            self.block_pool.free(block_id)
        request.block_table = []
        self._set_num_cached(request.request_id, None)

    # ------------------------------------------------------------------ swapping (preemption_mode="swap")
    def can_swap_out(self, request: Request) -> bool:
        """Room in the CPU pool for its blocks; and it has some (a rolled-back step may have cut a table to none:
        such a request is recomputed, there is nothing to swap)."""
        return bool(request.block_table) and self.swap_space.can_hold(len(request.block_table))

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU tier; returns the (device block, CPU block) copies to make."""
        cpu_table = self.swap_space.store(request.request_id, len(request.block_table))
        pairs = list(zip(request.block_table, cpu_table))
        self.block_pool.events.swap_out += pairs
        self.free(request)
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        total = request.num_computed_tokens + num_new_tokens
        return self.blocks_needed(total) <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back into fresh device blocks (hashed again when its next step
        commits); returns the (CPU block, device block) copies to make."""
        cpu_table = self.swap_space.release(request.request_id)
        device_table = [self.block_pool.take_fresh() for _ in cpu_table]
        request.block_table = device_table
        pairs = list(zip(cpu_table, device_table))
        self.block_pool.events.swap_in += pairs
        return pairs

    def free_swapped(self, request: Request) -> None:
        """Drop a swapped request's CPU blocks (it was aborted while swapped out)."""
        self.swap_space.release(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache: True once done; False, changing nothing, while a request holds blocks (vLLM's
        rule; BlockPool.reset_prefix_cache). Between steps only."""
        assert not self.journal.is_open, "the prefix cache is reset between steps, not inside one"
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ after a failed step
    def distrust(self, written: set[int], requests: list[Request]) -> dict[Request, int]:
        """Called after a rollback, outside any step: the blocks in `written` were handed out by the failed step,
        so its forward may have overwritten their KV. A cached-free one loses its hash; a request that holds one
        (a request preempted in that step gets its blocks back by the rollback) keeps only the blocks before the
        first such one. Returns {request: tokens it still has KV for} for the requests cut back."""
        pool = self.block_pool
        for block_id in written:
            if pool.blocks[block_id].ref_count == 0:
                pool.drop_cached(block_id)
        kept: dict[Request, int] = {}
        for req in requests:
            bad = next((i for i, b in enumerate(req.block_table) if b in written), None)
            if bad is None:
                continue
            for block_id in reversed(req.block_table[bad:]):
                if block_id in written:
                    pool.drop_cached(block_id)
                pool.free(block_id)
            req.block_table = req.block_table[:bad]
            if self.num_cached_blocks.get(req.request_id, 0) > bad:
                self.num_cached_blocks[req.request_id] = bad
            kept[req] = bad * self.block_size
        return kept

    # ------------------------------------------------------------------ invariants
    def check_integrity(self, requests: list[Request]) -> None:
        """Assert every invariant, given all requests that may hold blocks. For tests and debug runs."""
        pool, bs = self.block_pool, self.block_size
        holders: dict[int, int] = {}
        for req in requests:
            assert len(set(req.block_table)) == len(req.block_table), f"{req} lists a block twice"
            for b in req.block_table:
                holders[b] = holders.get(b, 0) + 1
        pool.check_integrity(holders)
        self.swap_space.check_integrity()
        for req in requests:
            num_cached = self.num_cached_blocks.get(req.request_id, 0)
            assert num_cached <= len(req.block_table), f"{req}: {num_cached} hashed blocks of {len(req.block_table)}"
            for i, b in enumerate(req.block_table):
                block = pool.blocks[b]
                hashed = block.block_hash is not None
                # A hashed block is a computed block: the bug a failed step used to leave behind.
                assert not hashed or (i + 1) * bs <= req.num_computed_tokens, (
                    f"{req}: block {b} (tokens {i * bs}-{(i + 1) * bs - 1}) is in the prefix cache, but only "
                    f"{req.num_computed_tokens} tokens have been computed")
                assert hashed == (i < num_cached), f"{req}: block {b} hashed={hashed} but num_cached={num_cached}"
                if hashed:
                    chunk = req.block_key(i, bs)
                    assert block.token_ids == chunk, f"{req}: block {b} holds other tokens"
