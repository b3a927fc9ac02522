"""Shared by tests/test_course_*.py: run a lesson's exercise check on a given function (lessons/course.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
if str(LESSONS) not in sys.path:
    sys.path.insert(0, str(LESSONS))

from course import ExerciseFailed, check, solution  # noqa: E402


def empty(*args, **kwargs):
    """The exercise cell as the learner first sees it."""
    raise NotImplementedError


def passes(name: str, fn=None) -> None:
    """The check of `name` passes `fn` (default: the solution)."""
    check(fn or solution(name), name)


def _recast(value, kind):
    """`value` with every list and tuple in it, at any depth, made a `kind` (a named tuple keeps its type, its
    fields recast); anything else (numbers, strings, tensors) as it is."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_recast(v, kind) for v in value))
    if isinstance(value, (list, tuple)):
        return kind(_recast(v, kind) for v in value)
    return value


def answering_in(kind, fn):
    """`fn` with its answer's lists and tuples all made `kind` (list or tuple): a correct answer in either form
    is the same answer."""
    def recast(*args, **kwargs):
        return _recast(fn(*args, **kwargs), kind)
    recast.__name__ = f"{getattr(fn, '__name__', 'fn')}_in_{kind.__name__}s"
    return recast


def rejects(fn, name: str, match: str) -> None:
    """The check of `name` fails on `fn`, with a message matching `match` (a regex)."""
    with pytest.raises(ExerciseFailed, match=match):
        check(fn, name)
