"""Lesson 06's solution: attention for one decode query over a paged KV cache."""

import torch


def paged_attention_one(q, key_cache, value_cache, block_table, seq_len, scale):
    """q (num_heads, head_dim) attends to the sequence's first seq_len tokens -> (num_heads, head_dim).

    key_cache, value_cache  (num_blocks, block_size, num_kv_heads, head_dim)
    block_table             (>= ceil(seq_len / block_size),) ints: token t is in
                            cache[block_table[t // block_size], t % block_size]
    Query head h reads KV head h // (num_heads // num_kv_heads) (GQA)."""
    num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-seq_len // block_size)                          # ceil: the last block may be partial
    blocks = torch.as_tensor(block_table)[:num_blocks].long()       # only the blocks the sequence uses
    k = key_cache[blocks].flatten(0, 1)[:seq_len].float()          # (seq_len, kv_heads, head_dim)
    v = value_cache[blocks].flatten(0, 1)[:seq_len].float()
    k = k.repeat_interleave(group, dim=1)                           # (seq_len, heads, head_dim)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("hd,thd->ht", q.float(), k) * scale            # (heads, seq_len)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("ht,thd->hd", p, v).to(q.dtype)             # (heads, head_dim)
