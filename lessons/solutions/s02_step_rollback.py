"""Lesson 02's solution: take blocks for a request inside an open step, journaling how to undo each change."""


def take_blocks(free, table, n, journal):
    """Move n blocks from the front of the free queue `free` (a deque) to the end of the block table `table` (a
    list), both in place, and record in `journal` how to undo each change. All or nothing: with fewer than n
    free, change nothing and return False; else return True."""
    if n > len(free):
        return False
    for _ in range(n):
        block_id = free.popleft()
        journal.record(lambda b=block_id: free.appendleft(b))    # b=block_id: the value now, not the variable
        table.append(block_id)
        journal.record(table.pop)
    return True
