"""Lesson 10's exercise check (lessons/checks/c10_performance.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import empty, passes, rejects

NAME = "10.decode_memory_floor_ms"


def kv_once(cfg, itemsize, batch, context, bandwidth):
    """Counts the weights right but the KV of one layer only (or forgets V)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * cfg.intermediate_size + cfg.intermediate_size * h + 2 * h
    weights = cfg.num_hidden_layers * per_layer + h + cfg.vocab_size * h
    return (weights + kv * batch * context) * itemsize / bandwidth * 1e3


def embedding_twice(cfg, itemsize, batch, context, bandwidth):
    """Adds the embedding table on top of the LM head (a decode step only indexes it)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * cfg.intermediate_size + cfg.intermediate_size * h + 2 * h
    weights = cfg.num_hidden_layers * per_layer + h + 2 * cfg.vocab_size * h
    return (weights + 2 * cfg.num_hidden_layers * kv * batch * context) * itemsize / bandwidth * 1e3


def in_seconds(cfg, itemsize, batch, context, bandwidth):
    """The right bytes over the bandwidth, but in seconds: forgets the * 1e3 to milliseconds."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * cfg.intermediate_size + cfg.intermediate_size * h + 2 * h
    weights = cfg.num_hidden_layers * per_layer + h + cfg.vocab_size * h
    return (weights + 2 * cfg.num_hidden_layers * kv * batch * context) * itemsize / bandwidth


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


@pytest.mark.slow
def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (kv_once, "K and V of every cached token, every layer"),
    (embedding_twice, "its parameters are"),
    (in_seconds, r"the default model in fp32, batch 1, no context, 10 GB/s .*: expected 53\.8\d* ms, "
                 r"got 0\.0538\d* \(that is the time in seconds"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
