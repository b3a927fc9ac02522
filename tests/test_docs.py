"""The documentation's commands still work as written, and its results are labelled by date, machine and commit.

Every `python -m minivllm.<x> ...`, `python app.py ...`, `python <script>.py`, `python -m pytest <paths>` and
`bash <script>` in README.md and docs/*.md (in ```bash blocks and in `inline code`) is checked without running
it: a minivllm command's flags are parsed by that command's own argument parser; a script or test path must
exist. A doc that names a flag a command no longer has fails here.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `python -m <module>`: how to build that command's parser, as "module:function". bench's parse_args also makes
# its cross-flag checks (parser.error, exit code 2), as the real command does.
PARSERS = {
    "minivllm.generate": "minivllm.entrypoints.generate:build_parser",
    "minivllm.bench": "minivllm.bench.cli:parse_args",
    "minivllm.docs_tables": "minivllm.docs_tables:build_parser",
    "app.py": "app:build_parser",
}
PYTHON = ("python", "python3")


def commands_in(text: str) -> list[str]:
    """Shell commands of a markdown text: the lines of ```bash blocks (continuations joined) and inline code,
    each split at `&&` and `;`, keeping those that start with python, python3, torchrun or bash."""
    pieces = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        pieces += block.replace("\\\n", " ").splitlines()
    pieces += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    commands = []
    for piece in pieces:
        for part in re.split(r"&&|;", piece):
            part = part.strip()
            words = part.split()
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):      # VAR=value before a command
                words.pop(0)
            if words and words[0] in (*PYTHON, "torchrun", "bash") and len(words) > 1:
                commands.append(" ".join(words))
    return commands


def all_commands() -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), cmd) for doc in DOCS for cmd in commands_in(doc.read_text())]


def test_the_docs_have_commands_to_check():
    found = {cmd.split()[0:3][-1] for _, cmd in all_commands()}
    assert {"minivllm.generate", "minivllm.bench", "app.py"} <= found, found


def _check(argv: list[str]) -> None:
    """Parse one command's words as its program would, without running it."""
    if argv[0] == "torchrun":                          # torchrun [its flags] -m module args
        argv = ["python", *argv[argv.index("-m"):]]
    if argv[0] == "bash":
        assert (ROOT / argv[1]).is_file(), f"{argv[1]} does not exist"
        return
    assert argv[0] in PYTHON, argv
    if argv[1] == "-m":
        module, args = argv[2], argv[3:]
        if module == "pytest":
            for arg in args:
                if arg.startswith(("tests/", "lessons/")):
                    path = arg.split("::")[0]
                    assert (ROOT / path).exists(), f"{path} does not exist"
            return
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"no module {module}"
        if spec.submodule_search_locations is not None:          # a package runs its __main__
            assert importlib.util.find_spec(module + ".__main__") is not None, f"{module} has no __main__"
    else:
        module, args = argv[1], argv[2:]
        assert (ROOT / module).is_file(), f"{module} does not exist"
    if module in PARSERS:
        mod_name, func = PARSERS[module].split(":")
        make = getattr(importlib.import_module(mod_name), func)
        try:
            make(args) if func == "parse_args" else make().parse_args(args)
        except SystemExit as e:
            raise AssertionError(f"its parser refused {shlex.join(args)!r} (exit code {e.code})") from None


@pytest.mark.parametrize("doc, command", all_commands())
def test_documented_command_parses_as_written(doc, command):
    try:
        _check(shlex.split(command, comments=True))
    except AssertionError as e:
        raise AssertionError(f"{doc}: `{command}`: {e}") from None


ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(st|nd|rd|th)")
LABELLED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "lessons").glob("*.py")),
            *sorted((ROOT / "lessons").glob("*.ipynb")), ROOT / "lessons" / "README.md"]


@pytest.mark.parametrize("path", LABELLED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_result_is_labelled_by_a_working_period(path):
    """Results carry a date, a machine and a commit, never "the fifth session"."""
    text = path.read_text()
    hits = [m.group(0) for m in re.finditer(rf"\b({ORDINALS}) session", text, re.I)]
    assert not hits, f"{path.name} labels results by working period: {hits}"


@pytest.mark.parametrize("path", [*LABELLED, *sorted((ROOT / ".ci").rglob("*")), ROOT / "app.py"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_absolute_path_of_a_build_machine(path):
    if not path.is_file() or "__pycache__" in path.parts:
        return
    hits = re.findall(r"(?<![\w.~])/(?:work|root|tmp)/[\w./-]*", path.read_text(errors="replace"))
    assert not hits, f"{path.relative_to(ROOT)} names paths of a build machine: {hits}"


PACKAGES = [p.name for p in (ROOT / "minivllm").iterdir() if (p / "__init__.py").exists()]


def _package_modules_named(doc: Path) -> list[str]:
    """Modules named from inside the package (`core/journal.py`), in prose and in tables, except in a table's
    columns about vLLM (whose files have the same shape of name: vLLM has `platforms/cpu.py`, minivllm has not)."""
    names, header = [], None
    for line in re.sub(r"```.*?```", "", doc.read_text(), flags=re.S).splitlines():
        cells = line.split("|")[1:-1] if line.startswith("|") else None
        if cells is None:
            header, kept = None, line
        elif header is None:
            header, kept = cells, ""
        else:
            kept = "|".join(c for c, h in zip(cells, header + [""] * len(cells)) if "vllm" not in h.lower())
        names += [s for s in re.findall(r"`([^`\s]+)`", kept) if re.fullmatch(rf"({'|'.join(PACKAGES)})/[\w/]+\.py", s)]
    return names


def test_files_the_docs_name_exist():
    """A path in inline code (`minivllm/core/scheduler.py`, `kernels/`, `.ci/gpu/run.sh`) names a file or folder
    of this repository; a file moved without its docs fails here."""
    missing = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\s]+)`", text):
            if re.fullmatch(r"(minivllm|kernels|tests|lessons|docs|\.ci)/[\w./-]*", span) and "*" not in span:
                if not (ROOT / span).exists():
                    missing.append(f"{doc.relative_to(ROOT)}: {span}")

    for doc in DOCS + [ROOT / "lessons" / "README.md", ROOT / "CONTRIBUTING.md"]:
        missing += [f"{doc.relative_to(ROOT)}: {span} (in minivllm/)" for span in _package_modules_named(doc)
                    if not (ROOT / "minivllm" / span).exists()]
    assert not missing, missing


def test_the_imports_of_the_docs_python_examples_work():
    """Every import line of a ```python block in README.md and docs/ imports as written (the examples' names
    still exist where they say); the examples themselves are not run."""
    for doc in DOCS:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                if re.match(r"(from \S+ )?import ", line):
                    statement = line.split("#")[0].strip()
                    try:
                        exec(statement, {})
                    except ImportError as e:
                        raise AssertionError(f"{doc.relative_to(ROOT)}: `{statement}`: {e}") from None


def test_every_result_in_benchmarks_md_has_date_machine_commit_and_command():
    """A results table of docs/benchmarks.md starts `| date | machine | commit |`; each of its rows has a date, a
    machine of the Machines table, a commit and a command; the history table has a date and a commit."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = [t.splitlines() for t in re.findall(r"(?:^\|.*\|\n)+", text, re.M)]
    machines = {row.split("|")[1].strip() for row in tables[0][2:]}
    assert tables[0][0].startswith("| name |") and {"H100", "H200"} <= machines
    results = history = 0
    for table in tables[1:]:
        header = [c.strip() for c in table[0].strip("|").split("|")]
        rows = [[c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))] for row in table[2:]]
        assert header[:2] in (["date", "machine"], ["date", "commit"]), f"a table without dates: {table[0]}"
        for row in rows:
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[0]), row
            if header[1] == "machine":
                results += 1
                assert row[1] in machines, f"machine {row[1]!r} is not in the Machines table"
                assert re.fullmatch(r"[0-9a-f]{7}", row[2]), row
                assert re.search(r"`(python|vllm|MINIVLLM_|VLLM_)", "|".join(row[3:])), f"no command: {row}"
            else:
                history += 1
                assert re.fullmatch(r"[0-9a-f]{7}(, [0-9a-f]{7})*", row[1]), row
    assert results >= 30 and history >= 10, (results, history)


def test_the_commits_benchmarks_md_names_are_in_the_history():
    import subprocess

    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    if shallow != "false":
        pytest.skip("a shallow clone lacks the history")
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    commits = set(re.findall(r"(?<=\| )[0-9a-f]{7}(?= \||,)|(?<=, )[0-9a-f]{7}(?= \|)", text))
    commits |= set(re.findall(r"\((?:at )?([0-9a-f]{7})\)", text))
    assert len(commits) >= 20
    missing = [c for c in sorted(commits) if subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"],
                                                            cwd=ROOT, capture_output=True).returncode != 0]
    assert not missing, f"commits not in this repository's history: {missing}"
