"""Lesson 01's exercise check (lessons/checks/c01_block_manager.py) passes the solution, rejects the rest."""

from minivllm.core.block_pool import ROOT_HASH, hash_block_tokens
from tests.course_helpers import empty, passes, rejects

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


def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


def test_plausible_wrong_answers_are_rejected_with_the_case():
    rejects(not_chained, NAME, r"expected \[0, 1\], got \[0\]")
    rejects(whole_prompt, NAME, "last token must still be computed")
