"""Lesson 05's solution: the flat cache slot of each position a request computes this step."""


def slot_mapping(block_table, start, end, block_size):
    """The cache slot of each position start .. end - 1 of one request: position p lives in the block the table
    lists at index p // block_size, at offset p % block_size, and a block's slots are block_id * block_size
    onwards."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
