"""nbval runs every lesson with its exercises' solutions filled in (lessons/course.py): the notebook kernels
inherit this process's environment.

Each lesson starts a kernel and runs engines end to end, so its cells are marked `slow` as a group: the
contributor's loop (`python -m pytest -m "not slow"`) leaves the lessons to the full suite."""

import os
from pathlib import Path

import pytest

os.environ["MINIVLLM_LESSON_SOLUTIONS"] = "1"

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # This hook sees the whole session's items, not only this folder's: mark only the notebooks' cells.
    for item in items:
        if item.path.suffix == ".ipynb" and item.path.resolve().parent == _HERE:
            item.add_marker(pytest.mark.slow)
