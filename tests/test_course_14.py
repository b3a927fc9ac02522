"""Lesson 14's exercise check (lessons/checks/c14_disaggregation.py) passes the solution, rejects the rest."""

import pytest

from minivllm.kv_transfer import block_keys
from tests.course_helpers import empty, passes, rejects

NAME = "14.get_num_new_matched_tokens"


def _count(keys, has_block, stop_at_miss=True):
    num_tokens = 0
    for key, n in keys:
        if has_block(key):
            num_tokens += n
        elif stop_at_miss:
            break
    return num_tokens


def counts_a_hit_after_a_miss(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    """Counts every block the store holds, also those after a missing one (their KV sits on a gap)."""
    keys = block_keys(list(prompt_token_ids[:-1]), block_size, tag)
    return _count(keys[num_computed_tokens // block_size:], has_block, stop_at_miss=False)


def returns_all_tokens(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    """Counts from block 0, ignoring the blocks this instance already computed."""
    return _count(block_keys(list(prompt_token_ids[:-1]), block_size, tag), has_block)


def includes_the_last_prompt_token(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    """Names the blocks of the whole prompt, token P-1 included: the last block's key is not what was stored."""
    keys = block_keys(list(prompt_token_ids), block_size, tag)
    return _count(keys[num_computed_tokens // block_size:], has_block)


def ignores_the_partial_last_block(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    """Counts whole blocks only: the partial block before token P-1 is computed again."""
    keys = [(k, n) for k, n in block_keys(list(prompt_token_ids[:-1]), block_size, tag) if n == block_size]
    return _count(keys[num_computed_tokens // block_size:], has_block)


def subtracts_after_counting_from_block_0(prompt_token_ids, num_computed_tokens, block_size, tag, has_block):
    """Counts the leading hits from block 0, then takes away the tokens computed here: a block computed here
    but absent from the store stops the count before the blocks that could load."""
    keys = block_keys(list(prompt_token_ids[:-1]), block_size, tag)
    return max(0, _count(keys, has_block) - num_computed_tokens)


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (counts_a_hit_after_a_miss, r"block 1 is missing: block 2 after it cannot be used .*expected 4, got 6"),
    (returns_all_tokens, r"block 0 is already computed here .*expected 6, got 10"),
    (includes_the_last_prompt_token, r"the last one partial .*expected 10, got 8"),
    (ignores_the_partial_last_block, r"the last one partial .*expected 10, got 8"),
    (subtracts_after_counting_from_block_0,
     r"block 0 is computed here but not in the store; blocks 1 and 2 are .*expected 6, got 0"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
