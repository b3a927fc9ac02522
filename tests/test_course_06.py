"""Lesson 06's exercise check (lessons/checks/c06_paged_attention.py) passes the solution, rejects the rest."""

import pytest
import torch

from tests.course_helpers import empty, passes, rejects

NAME = "06.paged_attention_one"


def _attend(q, k, v, scale):
    """q (heads, d) over k, v (n, heads, d) -> (heads, d)."""
    p = torch.softmax(torch.einsum("hd,thd->ht", q, k) * scale, dim=-1)
    return torch.einsum("ht,thd->hd", p, v)


def _right_kv(key_cache, value_cache, block_table, seq_len, num_heads):
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    blocks = block_table[:-(-seq_len // block_size)].long()
    group = num_heads // num_kv_heads
    k = key_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
    v = value_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, dim=1)
    return k, v


def ignores_block_table(q, key_cache, value_cache, block_table, seq_len, scale):
    """Reads physical blocks 0, 1, 2, ... in order, as if the sequence's K/V were contiguous in the pool."""
    k, v = _right_kv(key_cache, value_cache, torch.arange(key_cache.shape[0]), seq_len, q.shape[0])
    return _attend(q, k, v, scale)


def whole_last_block(q, key_cache, value_cache, block_table, seq_len, scale):
    """Attends to every slot of the last block, past seq_len (the stale slots too)."""
    block_size = key_cache.shape[1]
    padded = -(-seq_len // block_size) * block_size
    k, v = _right_kv(key_cache, value_cache, block_table, padded, q.shape[0])
    return _attend(q, k, v, scale)


def forgets_the_scale(q, key_cache, value_cache, block_table, seq_len, scale):
    """softmax(q . k) without the 1 / sqrt(head_dim)."""
    k, v = _right_kv(key_cache, value_cache, block_table, seq_len, q.shape[0])
    return _attend(q, k, v, 1.0)


def gqa_by_modulo(q, key_cache, value_cache, block_table, seq_len, scale):
    """GQA with query head h on KV head h % num_kv_heads (repeat, not repeat_interleave)."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    blocks = block_table[:-(-seq_len // block_size)].long()
    group = q.shape[0] // num_kv_heads
    k = key_cache[blocks].flatten(0, 1)[:seq_len].repeat(1, group, 1)
    v = value_cache[blocks].flatten(0, 1)[:seq_len].repeat(1, group, 1)
    return _attend(q, k, v, scale)


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (ignores_block_table, r"^a scrambled block table \(block table \[5, 2, 7\].*max error"),
    (whole_last_block, r"^a partial last block \(block table \[0, 1, 2\], seq_len 10.*max error"),
    (forgets_the_scale, r"^a single block .*max error .*expected \[.*got \[.*\(it equals attention "
                        r"without the scale: multiply q \. k by scale\)$"),
    (gqa_by_modulo, r"^GQA \(block table \[1, 6, 4\].*4 query heads over 2 KV heads\): max error .*"
                    r"\(it equals query head h reading KV head h % 2: with GQA, query head h reads KV "
                    r"head h // 2 \(repeat_interleave, not repeat\)\)$"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
