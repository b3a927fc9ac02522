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


def passes(name: str) -> None:
    check(solution(name), name)


def rejects(fn, name: str, match: str) -> None:
    """The check of `name` fails on `fn`, with a message matching `match` (a regex)."""
    with pytest.raises(ExerciseFailed, match=match):
        check(fn, name)
