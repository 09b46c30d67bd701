"""The house plan, read from the code: the engine never imports the course's tooling, no module
imports itself round a loop, and every file states its one job in its docstring's first line."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from course.quality import layout

ROOT = Path(__file__).resolve().parent.parent


def test_engine_never_imports_the_course_tooling():
    arrows = layout.engine_to_course(layout.import_graph())
    assert not arrows, ("the engine package imports the course's tooling (bench, viz, invariants, grading ...): "
                        f"{arrows}; move the shared piece into engine/ or invert the dependency")


def test_no_import_cycles():
    loops = layout.cycles(layout.import_graph())
    assert not loops, f"import cycles among engine/ and course/ modules: {loops}"


def test_every_file_states_its_job_in_its_first_docstring_line():
    missing = [str(rel) for rel in layout.tracked_python()
               if rel.parts[0] in ("engine", "solutions", "course")
               and not layout.first_docstring_line(ast.parse((ROOT / rel).read_text()))]
    assert not missing, f"files without a module docstring saying what they are for: {missing}"


def test_only_the_engine_is_installed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["engine*"], (
        "the installed package is the engine alone; course/ runs from the repository root")


def test_the_checks_can_fail(tmp_path):
    """The graph reader on a made-up tree: a lazy engine -> course import and a two-module loop
    are both found (so the two tests above are not vacuous)."""
    for rel, text in {
        "engine/__init__.py": '"""pkg."""\n',
        "engine/a.py": '"""a."""\nfrom engine import b\n',
        "engine/b.py": '"""b."""\ndef f():\n    import engine.a\n    from course.bench.compare import run\n',
        "course/__init__.py": '"""tools."""\n',
        "course/bench/compare.py": '"""bench."""\nimport json\n',
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "solutions").mkdir()
    graph = layout.import_graph(tmp_path)
    assert graph["engine.a"] == {"engine.b"} and graph["course.bench.compare"] == set()
    assert layout.engine_to_course(graph) == [("engine.b", "course.bench.compare")]
    assert layout.cycles(graph) == [["engine.a", "engine.b"]]
