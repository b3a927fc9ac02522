"""Lesson 01's exercise check (lessons/checks/c01_block_manager.py) passes the solution, rejects the rest."""

import pytest

from minivllm.core.block_pool import ROOT_HASH, hash_block_tokens
from tests.course_helpers import answering_in, empty, passes, rejects, solution

NAME = "01.longest_cached_prefix"


def not_chained(token_ids, block_size, lookup):
    """Hashes each block on its own: the same tokens after another prefix would match."""
    hits = []
    for i in range((len(token_ids) - 1) // block_size):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        block_id = lookup(hash_block_tokens(ROOT_HASH, chunk), chunk)
        if block_id is None:
            break
        hits.append(block_id)
    return hits


def whole_prompt(token_ids, block_size, lookup):
    """Takes every full block, even when that leaves no token to compute."""
    hits, parent = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block_tokens(parent, chunk)
        block_id = lookup(parent, chunk)
        if block_id is None:
            break
        hits.append(block_id)
    return hits


def continues_past_a_miss(token_ids, block_size, lookup):
    """Skips a missing block and goes on (`continue` instead of `break`): a later block still in the cache counts,
    though the block before it has no KV."""
    hits, parent = [], ROOT_HASH
    for i in range((len(token_ids) - 1) // block_size):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block_tokens(parent, chunk)
        block_id = lookup(parent, chunk)
        if block_id is None:
            continue
        hits.append(block_id)
    return hits


def counts_the_hits(token_ids, block_size, lookup):
    """Right walk, but answers how many blocks hit instead of which."""
    hits, parent = [], ROOT_HASH
    for i in range((len(token_ids) - 1) // block_size):
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block_tokens(parent, chunk)
        block_id = lookup(parent, chunk)
        if block_id is None:
            break
        hits.append(block_id)
    return len(hits)


def test_the_solution_passes():
    passes(NAME)


def test_the_solution_passes_answering_in_a_tuple():
    passes(NAME, answering_in(tuple, solution(NAME)))


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (not_chained, r"expected \[0, 1\], got \[0\]"),
    (whole_prompt, "last token must still be computed"),
    (continues_past_a_miss, r"block 1 was evicted, blocks 0 and 2 are still cached: a hit after a miss "
                            r"does not count .*expected \[0\], got \[0, 2\]"),
    (counts_the_hits, r"^expected a list \(or a tuple\), got an int: nothing cached"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
