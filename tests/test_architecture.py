"""The shape the code promises a reader (docs/architecture.md): short functions, modules of one concept, a base path
that a learner can follow through a known, short list of files."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from minivllm import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minivllm"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 400


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(ROOT), node


def test_no_function_in_the_package_is_longer_than_80_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "split these functions:\n" + "\n".join(long)


def test_no_module_in_the_package_is_longer_than_400_lines():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "split these modules by concept:\n" + "\n".join(long)


def test_the_base_schedule_and_step_are_short_enough_to_read_in_one_sitting():
    from minivllm.core.scheduler import Scheduler
    from minivllm.engine.llm_engine import LLMEngine
    import inspect
    assert len(inspect.getsource(Scheduler.schedule).splitlines()) <= 60
    assert len(inspect.getsource(LLMEngine.step).splitlines()) <= 40
    assert len(inspect.getsource(LLMEngine.execute_step).splitlines()) <= 40


def documented_request_path() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- request-path:start -->")[1].split("<!-- request-path:end -->")[0]
    return re.findall(r"^- `minivllm/([^`]+)`", block, flags=re.M)


def traced_request_path(llm) -> list[str]:
    """The files of minivllm/ whose functions run while one greedy request is generated on a CPU."""
    files: set[str] = set()
    prefix = str(PACKAGE) + os.sep

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            files.add(frame.f_code.co_filename[len(prefix):])
    params = SamplingParams(temperature=0, max_tokens=8)
    sys.setprofile(profile)
    try:
        out = llm.generate(["The capital of France is"], params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    assert len(out[0].outputs[0].token_ids) == 8
    return sorted(files)


@pytest.mark.slow
def test_one_greedy_request_runs_through_the_files_docs_architecture_lists(llm):
    traced = traced_request_path(llm)
    documented = documented_request_path()
    assert traced == sorted(documented), (
        "docs/architecture.md's list of the files one request passes through is out of date; it should be:\n"
        + "\n".join(f"- `minivllm/{f}`" for f in traced))


def test_every_package_of_minivllm_is_in_the_wheel():
    """pyproject.toml lists the packages by name: one left out installs without it (`pip install .`, not -e)."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
