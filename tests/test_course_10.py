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


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


@pytest.mark.slow
def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


@pytest.mark.slow
def test_plausible_wrong_answers_are_rejected_with_the_case():
    rejects(kv_once, NAME, "K and V of every cached token, every layer")
    rejects(embedding_twice, NAME, "its parameters are")
