"""Lesson 11's solution: a decode batch padded to the CUDA graph that will run it."""


def pad_decode_batch(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes):
    """The smallest capture size in `sizes` (ascending) that holds the batch, and the batch padded to it: padding
    rows get token 0 at position 0, slot -1 (the KV store skips it), a context of 1 and a block table of block 0;
    every table row is padded with block 0 to the widest table. Returns (size, input_ids, positions,
    slot_mapping, seq_lens, block_tables)."""
    n = len(input_ids)
    size = next(s for s in sizes if s >= n)
    pad = size - n
    width = max(len(t) for t in block_tables)
    tables = [list(t) + [0] * (width - len(t)) for t in block_tables] + [[0] * width for _ in range(pad)]
    return (size, list(input_ids) + [0] * pad, list(positions) + [0] * pad, list(slot_mapping) + [-1] * pad,
            list(seq_lens) + [1] * pad, tables)


def plan_ahead(num_tokens, num_computed_tokens, num_in_flight):
    """Async scheduling: where a running request's next batch starts, and how many tokens it has left to compute
    from there, given `num_in_flight` of its tokens in a batch still on the device. If that batch computes the
    whole sequence it also samples the next token, which is one more token to compute (its placeholder).
    Returns (start, num_left)."""
    start = num_computed_tokens + num_in_flight
    placeholder = 1 if num_in_flight > 0 and start >= num_tokens else 0
    return start, num_tokens + placeholder - start


def quantize_activations(x):
    """W8A8: each row of x (a token) rounded to int8 with its own scale. s = max(max|x| / 127, 1e-12) per row, in
    fp32; q = round(x / s), ties to the even integer (torch.round). Returns (q int8 (rows, in), s fp32 (rows,))."""
    import torch
    xf = x.float()
    s = (xf.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    return torch.round(xf / s[:, None]).to(torch.int8), s
