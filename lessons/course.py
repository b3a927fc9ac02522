"""The course's exercises: the learner writes the heart of a module in a lesson, a check says if it is right.

In a lesson (the notebook's folder, lessons/, is on sys.path, so `import course` works there):

    from course import exercise, check

    @exercise("01.longest_cached_prefix")
    def longest_cached_prefix(token_ids, block_size, lookup):
        ...                                   # your code here
        raise NotImplementedError

    check(longest_cached_prefix)              # prints what passed, or raises ExerciseFailed saying what is wrong

Where the pieces live (one concept each):
    lessons/course.py            this file: the two calls above and the error they raise
    lessons/checks/cNN_*.py      each lesson's checks: `check_<name>(fn)` runs the learner's function on cases
                                 with known answers (and, where it makes sense, inside the real engine) and
                                 raises ExerciseFailed naming the case, the expected and the actual value
    lessons/solutions/sNN_*.py   each lesson's solutions, out of the learner's sight: `<name>(...)`
    tests/test_course_*.py       that each check passes the solution (in a list or a tuple, where the answer is a
                                 sequence) and refuses an empty answer and at least three plausible wrong ones
                                 (so no check can pass whatever it is given)

A check that needs an engine builds one small engine per lesson, once, and keeps it in its module (`_ENGINE`),
so that every `check()` after the first answers in a few seconds.

CI runs every lesson with the solutions filled in: with MINIVLLM_LESSON_SOLUTIONS=1 in the environment (the
repository's conftest.py sets it for nbval), `@exercise` hands the lesson the solution instead of the cell's
function. A learner never sets it: their own code is what the check runs.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from pathlib import Path
from typing import Callable

SOLUTIONS_ENV = "MINIVLLM_LESSON_SOLUTIONS"
_HERE = Path(__file__).resolve().parent


class ExerciseFailed(AssertionError):
    """A check found the learner's function wrong; the message says on which case and how."""


def _module(package: str, lesson: str):
    """lessons/<package>/<p><lesson>_*.py, imported (e.g. checks/c01_block_manager.py for lesson "01")."""
    prefix = package[0] + lesson + "_"
    names = [m.name for m in pkgutil.iter_modules([str(_HERE / package)]) if m.name.startswith(prefix)]
    if len(names) != 1:
        raise LookupError(f"expected one lessons/{package}/{prefix}*.py, found {names}")
    return importlib.import_module(f"{package}.{names[0]}")


def solution(name: str) -> Callable:
    """The solution of exercise "NN.function_name"."""
    lesson, function = name.split(".")
    return getattr(_module("solutions", lesson), function)


def exercise(name: str) -> Callable[[Callable], Callable]:
    """Mark the learner's function as exercise `name` ("NN.function_name"). Returns it unchanged, or the
    solution when MINIVLLM_LESSON_SOLUTIONS=1 (CI running the lessons)."""
    def mark(fn: Callable) -> Callable:
        chosen = solution(name) if os.environ.get(SOLUTIONS_ENV) == "1" else fn
        @functools.wraps(chosen)
        def wrapper(*args, **kwargs):
            return chosen(*args, **kwargs)
        wrapper.exercise_name = name
        return wrapper
    return mark


def check(fn: Callable, name: str | None = None) -> None:
    """Run exercise `name`'s checks (default: the name `@exercise` gave `fn`) on `fn`. Prints one line per
    group of cases that passed; raises ExerciseFailed on the first that does not. A function that raises
    NotImplementedError (the cell as given) is told to write its code first."""
    name = name or getattr(fn, "exercise_name", None)
    if name is None:
        raise ValueError("check(fn): fn has no exercise name; decorate it with @exercise(\"NN.name\") or pass name=")
    lesson, function = name.split(".")
    checker = getattr(_module("checks", lesson), f"check_{function}")
    try:
        for line in checker(fn):
            print("ok:", line)
    except NotImplementedError:
        raise ExerciseFailed(f"{function} is not written yet: replace `raise NotImplementedError` with your code "
                             f"and run the cell again.") from None
    print(f"all checks of {name} passed")


def release_cached() -> None:
    """Forget what the checks keep between runs (the small engines and weights in their module-level `_ENGINE`,
    `_REAL` dicts and `functools.cache` functions), so the memory can be reused. A notebook never needs this; the
    test suite calls it after each lesson's checks, since one process runs them all (about 1 GB each)."""
    import sys
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("checks.c") or module is None:
            continue
        for attr, value in vars(module).items():
            if attr.startswith("_") and attr.isupper() and isinstance(value, dict):
                value.clear()
            elif callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == module_name:
                value.cache_clear()


def a_kind(value) -> str:
    """The kind of `value` in words, for messages: "an int", "a generator"."""
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _is_sequence(x) -> bool:
    return isinstance(x, (list, tuple))


def same_answer(actual, expected) -> bool:
    """Equal as answers: lists and tuples (named tuples too) with equal items are the same answer, at any depth,
    and so are dicts with equal keys and values; everything else compares with ==."""
    if _is_sequence(expected) and _is_sequence(actual):
        return len(actual) == len(expected) and all(same_answer(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(same_answer(actual[k], expected[k]) for k in expected)
    if _is_sequence(expected) != _is_sequence(actual):
        return False
    try:
        return bool(actual == expected)
    except (TypeError, ValueError, RuntimeError):       # e.g. a tensor of several elements against a number
        return False


def expect_equal(actual, expected, what: str) -> None:
    """The checks' one comparison: raises ExerciseFailed saying what was compared, what came and what was due. A
    list where a tuple is due (or the reverse) is the same answer; an answer of another kind is told so first."""
    if same_answer(actual, expected):
        return
    if _is_sequence(expected) and not _is_sequence(actual):
        raise ExerciseFailed(f"expected a list (or a tuple), got {a_kind(actual)}: {what}: expected "
                             f"{expected!r}, got {actual!r}")
    if isinstance(expected, dict) and not isinstance(actual, dict):
        raise ExerciseFailed(f"expected a dict, got {a_kind(actual)}: {what}: expected {expected!r}, "
                             f"got {actual!r}")
    raise ExerciseFailed(f"{what}: expected {expected!r}, got {actual!r}")
