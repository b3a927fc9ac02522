"""Lesson 07's exercise check (lessons/checks/c07_tensor_parallel.py) passes the solution, rejects the rest."""

import pytest
import torch
import torch.nn.functional as F

from tests.course_helpers import answering_in, empty, passes, rejects, solution

NAME = "07.tp_linear"


def _split(weight, tp_size, dim):
    n = weight.shape[dim]
    if n % tp_size:
        raise ValueError(f"{n} does not split into {tp_size}")
    return list(weight.split(n // tp_size, dim=dim))


def swapped_dimensions(x, weight, tp_size, kind):
    """Megatron's names taken for W instead of A = W.T: "column" cuts W's columns (input features) and sums,
    "row" cuts W's rows (output features) and concatenates. y comes out right; the shards do not."""
    if kind == "column":
        shards = _split(weight, tp_size, 1)
        return shards, sum(F.linear(xr, w) for xr, w in zip(x.chunk(tp_size, dim=-1), shards))
    shards = _split(weight, tp_size, 0)
    return shards, torch.cat([F.linear(x, w) for w in shards], dim=-1)


def concatenates_row_partials(x, weight, tp_size, kind):
    """Right shards, but the row-parallel partial sums are put side by side instead of added (no all-reduce)."""
    dim = 0 if kind == "column" else 1
    shards = _split(weight, tp_size, dim)
    xs = [x] * tp_size if kind == "column" else x.chunk(tp_size, dim=-1)
    return shards, torch.cat([F.linear(xr, w) for xr, w in zip(xs, shards)], dim=-1)


def interleaved(x, weight, tp_size, kind):
    """Rank r takes every tp_size-th feature from r on (a strided split): y is still x @ W.T, but rank r's rows are
    not the ones minivllm's layers give it, so a query head would be cut across ranks."""
    if kind == "column":
        shards = [weight[r::tp_size] for r in range(tp_size)]
        parts = [F.linear(x, w) for w in shards]                         # rank r: features r, r + tp, ...
        return shards, torch.stack(parts, dim=-1).reshape(x.shape[0], -1)  # put back in feature order
    shards = [weight[:, r::tp_size] for r in range(tp_size)]
    return shards, sum(F.linear(x[:, r::tp_size], w) for r, w in enumerate(shards))


def chunk_without_check(x, weight, tp_size, kind):
    """torch.chunk, which accepts any size: 10 rows on 3 ranks become 4 + 4 + 2 instead of an error."""
    dim = 0 if kind == "column" else 1
    shards = list(weight.chunk(tp_size, dim=dim))
    if kind == "column":
        return shards, torch.cat([F.linear(x, w) for w in shards], dim=-1)
    xs = x.split([w.shape[1] for w in shards], dim=-1)
    return shards, sum(F.linear(xr, w) for xr, w in zip(xs, shards))


def test_the_solution_passes():
    passes(NAME)


def test_the_solution_passes_answering_in_lists_or_tuples():
    passes(NAME, answering_in(list, solution(NAME)))
    passes(NAME, answering_in(tuple, solution(NAME)))


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (swapped_dimensions,
     r"column parallel, tp 2, W \(8, 6\): rank 0's shard: expected rows 0\.\.3, all 6 columns of W \(4, 6\), "
     r"got all 8 rows, columns 0\.\.2 of W \(8, 3\)"),
    (concatenates_row_partials,
     r"row parallel, tp 2, W \(5, 8\): y, the combined result: expected x @ W\.T of shape \(4, 5\), "
     r"got shape \(4, 10\)"),
    (interleaved,
     r"column parallel, tp 2, W \(8, 6\): rank 0's shard: expected rows 0\.\.3, all 6 columns of W \(4, 6\), "
     r"got rows \[0, 2, 4, 6\], all 6 columns of W \(4, 6\)"),
    (chunk_without_check,
     r"column parallel, tp 3, W \(10, 6\) \(10 output features do not split into 3 equal shards\): "
     r"expected ValueError, got shards of shapes \[\(4, 6\), \(4, 6\), \(2, 6\)\]"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3
