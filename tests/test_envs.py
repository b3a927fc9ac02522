"""minivllm/envs.py is the one table of MINIVLLM_* environment variables: every one the code names is in it, it
is the only module that reads one from the environment, and its values are read at each access."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from minivllm import envs

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(REPO / "minivllm").rglob("*.py"), *(REPO / "kernels").rglob("*.py"), REPO / "app.py"])
NAME = re.compile(r"\bMINIVLLM_[A-Z][A-Z0-9_]*[A-Z0-9]\b")


def _names_in_code() -> dict[str, set[str]]:
    """Every MINIVLLM_* name in the Python sources, with the files it appears in (C++ macros are not variables)."""
    found: dict[str, set[str]] = {}
    for path in SOURCES:
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_variable_the_code_names_is_in_the_table():
    table = {v.name for v in envs.ENV_VARS}
    missing = {name: sorted(files) for name, files in _names_in_code().items() if name not in table}
    assert not missing, f"add these to ENV_VARS in minivllm/envs.py: {missing}"


def test_the_table_is_well_formed():
    names = [v.name for v in envs.ENV_VARS]
    assert len(names) == len(set(names))
    for var in envs.ENV_VARS:
        assert NAME.fullmatch(var.name), var.name
        assert var.help.strip().endswith((".", ")")) and len(var.help) > 20, var.name
        assert var.kind in ("bool", "str", "path"), var.name
        envs.read(var.name, {})                                   # the default parses


def _reads_environment(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The MINIVLLM_* name `node` reads from os.environ / os.getenv, if it is such a read."""
    def is_environ(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "environ" or isinstance(n, ast.Name) and n.id == "environ"

    def literal(n: ast.AST) -> str | None:
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            return n.value
        if isinstance(n, ast.Name):
            return constants.get(n.id)
        if isinstance(n, ast.JoinedStr):                         # f"MINIVLLM_{...}"
            return "".join(v.value for v in n.values if isinstance(v, ast.Constant)) or None
        return None

    key = None
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and is_environ(func.value):
            key = node.args[0] if node.args else None
        elif isinstance(func, ast.Attribute) and func.attr == "getenv" or isinstance(func, ast.Name) and \
                func.id == "getenv":
            key = node.args[0] if node.args else None
    elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
        key = node.slice
    elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
        key = node.left                                           # "MINIVLLM_X" in os.environ
    value = literal(key) if key is not None else None
    return value if value and value.startswith("MINIVLLM_") else None


def test_only_envs_reads_minivllm_variables_from_the_environment():
    readers = []
    for path in SOURCES:
        if path == REPO / "minivllm" / "envs.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        constants = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                     for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            name = _reads_environment(node, constants)
            if name:
                readers.append(f"{path.relative_to(REPO)}:{node.lineno} reads {name}")
    assert not readers, "read these through minivllm.envs instead: " + "; ".join(readers)


def test_values_are_read_and_parsed_at_each_access(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_OWN_GEMM", raising=False)
    assert envs.MINIVLLM_CPU_OWN_GEMM is True                     # a switch: on unless set to 0
    monkeypatch.setenv("MINIVLLM_CPU_OWN_GEMM", "0")
    assert envs.MINIVLLM_CPU_OWN_GEMM is False
    monkeypatch.setenv("MINIVLLM_CPU_OWN_GEMM", "1")
    assert envs.MINIVLLM_CPU_OWN_GEMM is True
    monkeypatch.delenv("MINIVLLM_LESSON_SOLUTIONS", raising=False)
    assert envs.MINIVLLM_LESSON_SOLUTIONS is False                # an opt-in: off unless set to 1
    monkeypatch.setenv("MINIVLLM_LESSON_SOLUTIONS", "1")
    assert envs.MINIVLLM_LESSON_SOLUTIONS is True
    monkeypatch.setenv("MINIVLLM_CPU_PRELOAD", "tcmalloc")
    assert envs.MINIVLLM_CPU_PRELOAD == "tcmalloc"
    monkeypatch.delenv("MINIVLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert envs.MINIVLLM_WORKER_MULTIPROC_METHOD == ""
    monkeypatch.setenv("MINIVLLM_CACHE", "~/elsewhere")
    assert envs.MINIVLLM_CACHE == str(Path("~/elsewhere").expanduser())
    assert envs.read("MINIVLLM_CPU_PRELOAD", {"MINIVLLM_CPU_PRELOAD": "0"}) == "0"     # any mapping


def test_an_unknown_name_says_where_to_add_it():
    with pytest.raises(AttributeError, match=r"'MINIVLLM_NOPE' is not a minivllm environment variable; add it to "
                                             r"ENV_VARS in minivllm/envs.py"):
        envs.MINIVLLM_NOPE
