"""Lesson 08's exercise check (lessons/checks/c08_pipeline_parallel.py) passes the solution, rejects the rest."""

from tests.course_helpers import empty, passes, rejects

NAME = "08.stage_layers"


def _bounds(counts):
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def earlier_stages_take_more(num_layers, pp_size):
    """numpy.array_split's rule: the first stages take the extra layers (vLLM's and minivllm's give them to the last)."""
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError("too many stages")
    base, extra = divmod(num_layers, pp_size)
    return _bounds([base + (1 if s < extra else 0) for s in range(pp_size)])


def last_stage_takes_the_rest(num_layers, pp_size):
    """num_layers // pp_size each, and whatever is left on the last stage."""
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError("too many stages")
    base = num_layers // pp_size
    return _bounds([base] * (pp_size - 1) + [num_layers - base * (pp_size - 1)])


def end_inclusive(num_layers, pp_size):
    """(first layer, last layer) instead of (start, end): the end is one short."""
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError("too many stages")
    base, extra = divmod(num_layers, pp_size)
    return [(s, e - 1) for s, e in _bounds([base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)])]


def no_check_for_empty_stages(num_layers, pp_size):
    """The right split, but 4 stages for 3 layers gives a stage with no layer instead of an error."""
    pp_size = max(pp_size, 1)
    base, extra = divmod(num_layers, pp_size)
    return _bounds([base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)])


def test_the_solution_passes():
    passes(NAME)


def test_an_empty_answer_is_told_to_write_code():
    rejects(empty, NAME, "not written yet")


def test_plausible_wrong_answers_are_rejected_with_the_case():
    rejects(earlier_stages_take_more, NAME,
            r"30 layers on 4 stages \(the earlier stages take one fewer\) \(30 layers, 4 stages\): expected "
            r"\[\(0, 7\), \(7, 14\), \(14, 22\), \(22, 30\)\] \(layers per stage \[7, 7, 8, 8\]\), got .* "
            r"\(layers per stage \[8, 8, 7, 7\]\)")
    rejects(last_stage_takes_the_rest, NAME, r"layers per stage \[7, 7, 7, 9\]")
    rejects(end_inclusive, NAME, r"one stage holds every layer \(30 layers, 1 stage\): expected \[\(0, 30\)\]")
    rejects(no_check_for_empty_stages, NAME, r"4 stages for 3 layers: expected ValueError .*got \[")
