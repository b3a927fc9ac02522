"""Lesson 11's exercise check (lessons/checks/c11_cuda_graphs_async.py) passes the solution, rejects the rest."""

import pytest

from tests.course_helpers import answering_in, empty, passes, rejects, solution

NAME = "11.pad_decode_batch"


def _pad(input_ids, positions, slot_mapping, seq_lens, block_tables, size, slot_pad=-1, len_pad=1):
    pad = size - len(input_ids)
    width = max(len(t) for t in block_tables)
    tables = [list(t) + [0] * (width - len(t)) for t in block_tables] + [[0] * width for _ in range(pad)]
    return (size, input_ids + [0] * pad, positions + [0] * pad, slot_mapping + [slot_pad] * pad,
            seq_lens + [len_pad] * pad, tables)


def largest_size(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes):
    """Always pads to the largest graph: right results, but every step pays for the biggest batch."""
    return _pad(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes[-1])


def pads_slot_zero(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes):
    """Pads the slots with 0: the padding rows would overwrite the K/V in slot 0 of block 0."""
    size = next(s for s in sizes if s >= len(input_ids))
    return _pad(input_ids, positions, slot_mapping, seq_lens, block_tables, size, slot_pad=0)


def pads_context_zero(input_ids, positions, slot_mapping, seq_lens, block_tables, sizes):
    """Pads the contexts with 0: a softmax over no keys (0/0) in the padding rows."""
    size = next(s for s in sizes if s >= len(input_ids))
    return _pad(input_ids, positions, slot_mapping, seq_lens, block_tables, size, len_pad=0)


@pytest.mark.slow
def test_the_solution_passes():
    passes(NAME)


@pytest.mark.slow
def test_the_solution_passes_answering_in_lists_or_tuples():
    passes(NAME, answering_in(list, solution(NAME)))
    passes(NAME, answering_in(tuple, solution(NAME)))


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (largest_size, r"a batch of 1: no padding: size: expected 1, got 16"),
    (pads_slot_zero, r"a batch of 3 runs the graph of 4: slot_mapping: expected \[37, 17, 10, -1\], "
                     r"got \[37, 17, 10, 0\]"),
    (pads_context_zero, r"a batch of 3 runs the graph of 4: seq_lens: expected \[10, 5, 3, 1\], "
                        r"got \[10, 5, 3, 0\]"),
]


@pytest.mark.parametrize("wrong, message", WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in WRONG_ANSWERS])
def test_plausible_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, NAME, message)


def test_at_least_three_plausible_wrong_answers():
    assert len(WRONG_ANSWERS) >= 3


# ---------------------------------------------------------------------- 11.plan_ahead (async scheduling)
PLAN = "11.plan_ahead"


def no_placeholder(num_tokens, num_computed_tokens, num_in_flight):
    """Forgets the token the batch in flight samples: a decode would never run ahead."""
    start = num_computed_tokens + num_in_flight
    return start, num_tokens - start


def ignores_in_flight(num_tokens, num_computed_tokens, num_in_flight):
    """Plans as if nothing were in flight: the next batch would recompute what the last one computes."""
    return num_computed_tokens, num_tokens - num_computed_tokens


def placeholder_whenever_in_flight(num_tokens, num_computed_tokens, num_in_flight):
    """Counts the sampled token's placeholder whenever something is in flight, also a chunk that stops short of
    the prompt's end (it samples nothing)."""
    start = num_computed_tokens + num_in_flight
    return start, num_tokens - start + (1 if num_in_flight else 0)


@pytest.mark.slow
def test_plan_ahead_solution_passes():
    passes(PLAN)


@pytest.mark.slow
def test_plan_ahead_solution_passes_answering_in_a_list():
    passes(PLAN, answering_in(list, solution(PLAN)))


def test_plan_ahead_empty_answer_is_told_to_write_code():
    rejects(empty, PLAN, "not written yet")


PLAN_WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (no_placeholder, r"a chunk of 6 in flight: it samples, 1 left: expected \(10, 1\), got \(10, 0\)"),
    (ignores_in_flight, r"a chunk of 6 in flight: it samples, 1 left: expected \(10, 1\), got \(4, 6\)"),
    (placeholder_whenever_in_flight, r"a chunk of 3 in flight: the rest of the prompt: expected \(7, 3\), "
                                     r"got \(7, 4\)"),
]


@pytest.mark.parametrize("wrong, message", PLAN_WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in PLAN_WRONG_ANSWERS])
def test_plan_ahead_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, PLAN, message)


def test_plan_ahead_has_at_least_three_wrong_answers():
    assert len(PLAN_WRONG_ANSWERS) >= 3


# ---------------------------------------------------------------------- 11.quantize_activations (W8A8)
QUANT = "11.quantize_activations"


def half_away_from_zero(x):
    """Rounds ties away from zero (C's round): 2.5 -> 3, where torch.round and the kernel give 2."""
    import torch
    xf = x.float()
    s = (xf.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    v = xf / s[:, None]
    return (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8), s


def one_scale_for_all(x):
    """One scale for the whole batch: a quiet row would lose its precision to a loud one."""
    import torch
    xf = x.float()
    s = (xf.abs().amax() / 127).clamp(min=1e-12).expand(x.shape[0]).contiguous()
    return torch.round(xf / s[:, None]).to(torch.int8), s


def no_floor_under_the_scale(x):
    """s = max|x| / 127 with no floor: a row of zeros divides by zero."""
    import torch
    xf = x.float()
    s = xf.abs().amax(dim=-1) / 127
    return torch.round(xf / s[:, None]).nan_to_num(0).to(torch.int8), s


def truncates(x):
    """Casts x / s to int8 without rounding: 2.5 -> 2 but -3.5 -> -3 (toward zero), and 126.9 -> 126."""
    import torch
    xf = x.float()
    s = (xf.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    return (xf / s[:, None]).to(torch.int8), s


@pytest.mark.slow
def test_quantize_activations_solution_passes():
    passes(QUANT)


@pytest.mark.slow
def test_quantize_activations_solution_passes_answering_in_a_list():
    passes(QUANT, answering_in(list, solution(QUANT)))


def test_quantize_activations_empty_answer_is_told_to_write_code():
    rejects(empty, QUANT, "not written yet")


QUANT_WRONG_ANSWERS = [      # (a plausible wrong answer, what the check must say about it)
    (half_away_from_zero, r"ties go to the even integer, as torch.round: expected \[127, 2, -4, 0, 2, 0, "
                          r"0, 126\], got \[127, 3, -4, 1, 2, -1, 0, 127\]"),
    (one_scale_for_all, r"a row of its own scale \(max \|x\| = 2\): expected \[-127, 64, 16"),
    (no_floor_under_the_scale, r"a row of zeros: q all 0, s the floor 1e-12 \(no division by zero\): "
                               r"expected .*, got \(\[\[0, .*\]\], 0\.0\)"),
    (truncates, r"ties go to the even integer, as torch.round: expected \[127, 2, -4, 0, 2, 0, 0, 126\], "
                r"got \[127, 2, -3, 0, 1, 0, 0, 126\]"),
]


@pytest.mark.parametrize("wrong, message", QUANT_WRONG_ANSWERS,
                         ids=[wrong.__name__ for wrong, _ in QUANT_WRONG_ANSWERS])
def test_quantize_activations_wrong_answers_are_rejected_with_the_case(wrong, message):
    rejects(wrong, QUANT, message)


def test_quantize_activations_has_at_least_three_wrong_answers():
    assert len(QUANT_WRONG_ANSWERS) >= 3
