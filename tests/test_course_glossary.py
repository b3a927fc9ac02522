"""lessons/README.md keeps up with the lessons: every minivllm module a lesson names (`core/scheduler.py`,
`minivllm/worker/sampler.py`, `minivllm.core.journal`, `kernels/reference.py`) has a row in its glossary, and
every exercise a lesson defines is in its list of exercises."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
README = (ROOT / "lessons" / "README.md").read_text()
FOLDERS = "core|engine|entrypoints|worker|model|spec_decode|kv_transfer|multimodal|bench|platforms"
# A path inside the package (`core/scheduler.py`, `minivllm/core/scheduler.py`, `platforms/cpu/`) or in the
# top-level kernels/ folder; not one inside another path (`vllm/v1/core/sched/scheduler.py` is vLLM's).
SLASHED = re.compile(rf"(?<![\w/.-])(?:minivllm/)?((?:{FOLDERS})/(?:[\w/]*\w\.py|[\w/]*/)"
                     r"|kernels/(?:[\w/]*\w\.(?:py|cpp|h))?)")
DOTTED = re.compile(r"(?<![\w.])minivllm((?:\.\w+)+)")


def _glossary_rows() -> set[str]:
    """The first cell of every row of the glossary table: one module path (relative to minivllm/, or kernels/...)."""
    section = README.split("## Glossary", 1)[1]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def _as_row(path: Path) -> str:
    """A file or folder of the repository as the glossary names it."""
    if path.is_relative_to(ROOT / "kernels"):
        rel = path.relative_to(ROOT).as_posix()
    else:
        rel = path.relative_to(ROOT / "minivllm").as_posix()
    return rel + "/" if path.is_dir() else rel


def _named_modules(text: str) -> set[str]:
    """The repository's modules and packages `text` names, as glossary rows; names of files that do not exist here
    (vLLM's, in a comparison) are not ours."""
    found = set()
    for path in SLASHED.findall(text):
        target = ROOT / path if path.startswith("kernels/") else ROOT / "minivllm" / path
        if target.exists():
            found.add(_as_row(target))
    for dotted in DOTTED.findall(text):
        parts = dotted.strip(".").split(".")
        for n in range(len(parts), 0, -1):                   # the longest prefix that is a module or a package
            base = ROOT / "minivllm" / Path(*parts[:n])
            if base.with_suffix(".py").is_file():
                found.add(_as_row(base.with_suffix(".py")))
                break
            if (base / "__init__.py").is_file():
                found.add(_as_row(base))
                break
    return found


def test_the_glossary_has_a_row_for_every_module_a_lesson_names():
    rows = _glossary_rows()
    missing = {f"{lesson.name}: {module}" for lesson in LESSONS
               for module in _named_modules(lesson.read_text()) if module not in rows}
    assert not missing, f"lessons/README.md's glossary has no row for: {sorted(missing)}"


def test_the_glossary_rows_name_files_that_exist():
    gone = [row for row in _glossary_rows()
            if not (ROOT / row if row.startswith("kernels/") else ROOT / "minivllm" / row).exists()]
    assert not gone, f"lessons/README.md's glossary names files that do not exist: {gone}"


def test_the_exercise_list_names_every_exercise():
    exercises = {name for lesson in LESSONS for name in re.findall(r'@exercise\("([^"]+)"\)', lesson.read_text())}
    section = README.split("## Exercises", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(\d\d\.\w+)`", section))
    assert exercises <= listed, f"lessons/README.md's exercise list lacks {sorted(exercises - listed)}"
    assert listed <= exercises, f"lessons/README.md lists exercises no lesson defines: {sorted(listed - exercises)}"


def test_the_module_finder_reads_the_forms_lessons_use():
    text = ("`core/scheduler.py` and minivllm/worker/sampler.py, minivllm.core.journal.StepJournal, "
            "`kernels/reference.py`, from minivllm.platforms.cpu import x, vLLM's vllm/v1/core/sched/scheduler.py")
    assert _named_modules(text) == {"core/scheduler.py", "worker/sampler.py", "core/journal.py",
                                    "kernels/reference.py", "platforms/cpu/"}
