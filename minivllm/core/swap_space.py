"""SwapSpace: the CPU tier of the KV cache, for preemption_mode="swap" (vLLM v0's swap space).

Owns: which blocks of the CPU pool are free and which swapped-out request owns the others. A CPU block has one
owner and is never shared or hashed: it only holds a preempted request's KV until the request comes back. The model
runner does the copies; this module only decides the (source, destination) block pairs.

Every change is recorded in the step journal, so a failed step can undo a swap.
"""

from __future__ import annotations

from collections import deque

from minivllm.core.journal import StepJournal


class SwapSpace:
    def __init__(self, num_cpu_blocks: int, journal: StepJournal):
        self.num_cpu_blocks = num_cpu_blocks
        self.journal = journal
        self.free: deque[int] = deque(range(num_cpu_blocks))
        self.tables: dict[str, list[int]] = {}      # request_id -> its blocks in the CPU pool

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def store(self, request_id: str, num_blocks: int) -> list[int]:
        """Give a request `num_blocks` CPU blocks; returns them (the destinations of its swap-out)."""
        table = [self.free.popleft() for _ in range(num_blocks)]
        self.tables[request_id] = table

        def undo() -> None:
            del self.tables[request_id]
            self.free.extendleft(reversed(table))
        self.journal.record(undo)
        return table

    def release(self, request_id: str) -> list[int]:
        """Take back a request's CPU blocks (swapped in, or aborted while out); returns them."""
        table = self.tables.pop(request_id, [])
        self.free.extend(table)

        def undo() -> None:
            for _ in table:
                self.free.pop()
            if table:
                self.tables[request_id] = table
        self.journal.record(undo)
        return table

    def check_integrity(self) -> None:
        held = [b for table in self.tables.values() for b in table]
        assert len(held) == len(set(held)) and not set(held) & set(self.free), (
            "a CPU block is owned twice, or owned and free")
        assert len(held) + len(self.free) == self.num_cpu_blocks, "CPU pool: free + in use != total"
